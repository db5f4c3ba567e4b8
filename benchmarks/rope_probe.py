"""Probe: what the rotary embedding layers (cos and sin from one op under torch.compile, which Inductor reads instead of
recomputing them inside every layer's q/k norm + RoPE kernel) save in a compiled Gemma 3 prefill, alone and with the
other kernelized layers: the compiled host, the host with only our rotary layer, the kernelized model with the
host's rotary forward, and the kernelized model.

python3 benchmarks/rope_probe.py --build-dir build   (an H200; prints GPU time by kernel per compiled variant)
"""

import argparse
import copy
import statistics
import time
import types
from pathlib import Path

import torch


def bind_rotary(model, forward) -> None:
    """Give ``model``'s rotary embedding the forward ``forward`` (a kernelized one's: our layer), as kernelize does;
    None restores the host's own."""
    rot = model.model.rotary_emb
    if forward is None:
        rot.__dict__.pop("forward", None)
    else:
        rot.forward = types.MethodType(forward, rot)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_by_kernel(fn, calls=2):
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type.name == "CUDA":
            rows[e.key] = rows.get(e.key, 0) + t / 1000 / calls
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--model", default="gemma3-4b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="a tiny config on the CPU (checks the script; no timings)")
    args = ap.parse_args()
    dev = "cpu" if args.cpu else "cuda"
    from kerneltools.bench.model.models import MODELS, build_models, own_code
    from kerneltools.bench.model.rounds import _ids, prefill_kwargs
    from kerneltools.transformers_kernels import DEFAULT_REPO_ID

    spec = MODELS[args.model]
    s = build_models(spec, Path(args.build_dir), dev, torch.bfloat16, args.cpu, "inductor", DEFAULT_REPO_ID)
    eager, kern = s.models["eager"], s.models["kernelized+compile"]  # kernelized for INFERENCE | TORCH_COMPILE
    ours = kern.model.rotary_emb.forward.__func__  # the layer kernelize bound
    if ours.__qualname__.rpartition(".")[0] not in ("RotaryEmbedding", "LayerTypeRotaryEmbedding"):
        raise SystemExit(f"error: the kernelized model's rotary embedding runs {ours.__qualname__}, not our layer: "
                         "rebuild with this checkout (python -m kerneltools build) and pass its --build-dir")
    host_rope, kern_no_rope = copy.deepcopy(eager), copy.deepcopy(kern)
    bind_rotary(host_rope, ours)
    bind_rotary(kern_no_rope, None)
    variants = {"compile": eager, "compile+rope-layer": host_rope, "kernelized+compile-rope-layer": kern_no_rope,
                "kernelized+compile": kern}
    compiled = {k: torch.compile(own_code(m.forward, k.replace("+", "_").replace("-", "_"))) for k, m in variants.items()}
    b, n = spec.prefill
    ids = _ids(s, b, n)

    def call(k):
        m = variants[k]
        with torch.inference_mode():
            return compiled[k](**prefill_kwargs(s, m, ids, None))

    for k in variants:
        t0 = time.time()
        call(k)
        sync()
        print(f"{k}: first call {time.time() - t0:.1f} s", flush=True)
    times = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants)[r % 4:] + list(variants)[:r % 4]
        for k in order:
            ts = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                call(k)
                sync()
                ts.append(time.perf_counter() - t0)
            times[k].append(statistics.median(ts) * 1000)
    for k in variants:
        rs = [t / c for t, c in zip(times[k], times["compile"])]
        print(f"{k}: {statistics.median(times[k]):.2f} ms, / compile {statistics.median(rs):.3f} "
              f"[{min(rs):.3f}, {max(rs):.3f}]")
    for k in variants if dev == "cuda" else ():
        rows = gpu_by_kernel(lambda: call(k))
        tot = sum(rows.values())
        print(f"\n{k}: GPU {tot:.2f} ms per call")
        for name, ms in sorted(rows.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {ms:8.2f}  {name[:120]}")
    with torch.inference_mode():
        ref = call("compile").logits.float()
        for k in variants:
            out = call(k).logits.float()
            print(f"{k}: max |logits - compile's| {(out - ref).abs().max().item():.4g}")


if __name__ == "__main__":
    main()
