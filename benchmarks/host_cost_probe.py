"""Probe: where a kernelized model's host time goes inside a compiled forward at batch-1 serving lengths.

A compiled forward of the kernelized model launches our ops from Inductor's generated code; where the GPU work is
short (batch 1, a few hundred tokens) the host's time per forward decides the wall time. For the compiled host and
the kernelized compiled model, both made dynamic as a server's are (two prompt lengths first), this prints:

- wall time per forward (back-to-back calls) and one profiled call's GPU time;
- the host's CPU time by operator in one call (torch.profiler, CPU events: calls and self time per name), our ops'
  rows beside Inductor's kernels';
- cProfile of repeated calls: the Python functions with the most own time, i.e. what each op call runs on the host.

python3 benchmarks/host_cost_probe.py --build-dir build [--layers 16] [--length 256[,2048,...]] [--out DIR]
(a GPU; on CPU it runs with the tiny config, for a smoke test: the figures then mean nothing)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wall_us(fn, device: str, n: int) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n * 1e6


def _profile(fn, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    fn()
    _sync(device)
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    cpu, gpu_us = {}, 0.0
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            cpu[e.key] = (e.count, round(e.self_cpu_time_total, 1))
        gpu_us += getattr(e, "self_device_time_total", 0.0) or 0.0
    top = sorted(cpu.items(), key=lambda kv: -kv[1][1])[:30]
    return dict(gpu_ms=round(gpu_us / 1e3, 3), cpu_self_us_total=round(sum(v[1] for v in cpu.values()), 1),
                cpu_by_op=[(k[:100], n, us) for k, (n, us) in top])


def _python_profile(fn, calls: int) -> list:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append((f"{Path(path).name}:{line}({name})", nc, round(tt / calls * 1e6, 2), round(ct / calls * 1e6, 2)))
    rows.sort(key=lambda r: -r[2])
    return rows[:40]


def _probe(s, modes, length: int, calls: int, device: str) -> dict:
    """Both compiled modes at one prompt length: wall time, one profiled call, cProfile of repeated calls."""
    from kerneltools.bench.model.rounds import _as_mode, _kernelize_for, make_dynamic, make_part

    make_dynamic(s, modes, (length // 2 + 1, length // 2 + 2))
    fn, _, _ = make_part(s, "serve", length=length)
    result = dict(length=length, modes={})
    for mode in modes:
        _kernelize_for(s, mode, False)
        with _as_mode(s, mode, "serve") as m:
            call = lambda: fn(m, True)  # noqa: E731
            r = dict(wall_us=round(_wall_us(call, device, calls), 1))
            r.update(_profile(call, device))
            r["python"] = _python_profile(call, max(calls // 5, 3))
        result["modes"][mode] = r
        print(f"{length} tokens, {mode}: {r['wall_us']} us per forward, GPU {r['gpu_ms']} ms, "
              f"host self CPU {r['cpu_self_us_total']} us")
        for k, n, us in r["cpu_by_op"][:15]:
            print(f"    {us:9.1f} us  {n:5d} calls  {k}")
        print("  python, own time per forward:")
        for name, nc, tt, ct in r["python"][:20]:
            print(f"    {tt:9.2f} us own {ct:9.2f} us cum  {nc:6d}  {name}")
    return result


def main(argv=None) -> int:
    from kerneltools.bench.model.models import MODELS, build_models
    from kerneltools.transformers_kernels import DEFAULT_REPO_ID

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", type=Path, required=True)
    p.add_argument("--model", default="gemma3-4b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--length", default="256", help="prompt length(s), comma-separated (default 256)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = device == "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch._dynamo.config.cache_size_limit = 64
    s = build_models(MODELS[args.model], args.build_dir, device, dtype, tiny, "inductor", DEFAULT_REPO_ID,
                     layers=args.layers)
    modes = ["compile", "kernelized+compile"]
    result = dict(model=args.model, layers=s.models["eager"].config.num_hidden_layers, device=device,
                  torch=torch.__version__, lengths=[])
    for length in [int(n) for n in args.length.split(",")]:
        result["lengths"].append(_probe(s, modes, min(length, 12) if tiny else length, args.calls, device))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host-cost.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
