"""Probe: does Inductor recompute RoPE's cos/sin inside every layer's q/k norm + RoPE kernel of a compiled Gemma 3
prefill, and what does computing them once (an opaque op, so Inductor reads them from memory) save?

python3 benchmarks/rope_probe.py --build-dir build   (an H200; prints GPU time by kernel per compiled variant)
"""

import argparse
import copy
import statistics
import time
import types
from pathlib import Path

import torch


@torch.library.custom_op("probe::rope_cos_sin", mutates_args=())
def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].float() * inv_freq.to(device=like.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(like.dtype), (emb.sin() * scaling).to(like.dtype)


@rope_cos_sin.register_fake
def _(position_ids, inv_freq, scaling, like):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return like.new_empty(shape), like.new_empty(shape)


def opaque_rope(model):
    rot = model.model.rotary_emb

    def forward(self, x, position_ids, layer_type=None):
        inv = getattr(self, f"{layer_type}_inv_freq")
        scale = getattr(self, f"{layer_type}_attention_scaling")
        return torch.ops.probe.rope_cos_sin(position_ids, inv, float(scale), x)

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
    from kernels import Mode, kernelize

    s = build_models(spec, Path(args.build_dir), dev, torch.bfloat16, args.cpu, "inductor", DEFAULT_REPO_ID)
    eager, kern = s.models["eager"], s.models["kernelized"]
    kernelize(kern, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device=dev)
    host_rope, kern_rope = copy.deepcopy(eager), copy.deepcopy(kern)
    opaque_rope(host_rope)
    opaque_rope(kern_rope)
    variants = {"compile": eager, "compile+opaque-rope": host_rope, "kernelized+compile": kern,
                "kernelized+compile+opaque-rope": kern_rope}
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
        pe = {lt: eager.model.rotary_emb(torch.empty(1, device=dev, dtype=torch.bfloat16),
                                         torch.arange(n, device=dev)[None], lt) for lt in set(eager.config.layer_types)}
        po = {lt: host_rope.model.rotary_emb(torch.empty(1, device=dev, dtype=torch.bfloat16),
                                             torch.arange(n, device=dev)[None], lt) for lt in pe}
    print("\ncos/sin bitwise equal to eager:", all(torch.equal(a, c) for lt in pe for a, c in zip(pe[lt], po[lt])))
    with torch.inference_mode():
        ref = call("compile").logits.float()
        for k in variants:
            out = call(k).logits.float()
            print(f"{k}: max |logits - compile's| {(out - ref).abs().max().item():.4g}")


if __name__ == "__main__":
    main()
