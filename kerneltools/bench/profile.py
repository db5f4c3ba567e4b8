"""Reproduce the profiling analysis behind the project with torch.profiler (GPU):

eager nn.Linear with bias, compiled nn.Linear, eager GeGLU MLP, compiled MLP, Liger's MLP and our GeGLUMLP:
the GPU kernels one forward launches (with their times), the CPU time per forward, and whether a new input shape
recompiles.

    python -m kerneltools profile [--build-dir build] [--out benchmarks/results] [--trace DIR]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _setups(geglu, D: int, H: int):
    import torch
    from torch import nn

    from .mlp import mlp_impls

    lin = nn.Linear(D, H, bias=True).to("cuda", torch.bfloat16)
    mlps = mlp_impls(geglu, D, H)
    names = {"eager": ("eager GeGLU MLP", False), "torch.compile": ("compiled GeGLU MLP", True),
             "liger": ("Liger LigerGEGLUMLP", False), "ours": ("ours GeGLUMLP (hub layer)", False)}
    return [("eager nn.Linear(bias=True)", lin, False), ("compiled nn.Linear(bias=True)", torch.compile(lin), True)] + [
        (names[k][0], mod, names[k][1]) for k, mod in mlps.items()]


def profile_setups(build_dir: Path, M: int = 8192, D: int = 768, H: int = 3072, trace_dir: Path | None = None,
                   log=print) -> list[dict]:
    import torch
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile
    import kernels

    geglu = kernels.get_local_kernel(build_dir)
    rows = []
    for name, mod, compiled in _setups(geglu, D, H):
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(3):
                mod(x)
            torch.cuda.synchronize()
            # host time to issue one forward: the median of 50 forwards timed one by one without a sync (the GPU
            # runs behind; 50 forwards stay far inside the launch queue)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                mod(x)
                times.append(time.perf_counter() - t0)
            cpu_us = sorted(times)[len(times) // 2] * 1e6
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                mod(x)
                torch.cuda.synchronize()
            if trace_dir is not None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(trace_dir / (name.replace(" ", "_").replace("/", "") + ".json")))
            kernels_ = [(e.name, e.device_time) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memset")]
            recompiled = "n/a"
            if compiled:
                before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                mod(torch.randn(M // 2 + 8, D, device="cuda", dtype=torch.bfloat16))
                mod(torch.randn(M // 4 + 24, D, device="cuda", dtype=torch.bfloat16))
                recompiled = "yes" if torch._dynamo.utils.counters["stats"]["unique_graphs"] > before else "no"
        rows.append(dict(setup=name, kernels=len(kernels_), gpu_us=round(sum(t for _, t in kernels_), 1),
                         cpu_us=round(cpu_us, 1), recompile_on_new_shape=recompiled,
                         kernel_list=[(k, round(t, 1)) for k, t in kernels_]))
        log(f"{name}: {len(kernels_)} kernels, {rows[-1]['gpu_us']} µs GPU, {rows[-1]['cpu_us']} µs CPU/forward, "
            f"recompile on new shape: {recompiled}")
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Profile of one forward on {meta['card']} (bf16, M={meta['M']}, D={meta['D']}, H={meta['H']})", "",
           f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}. GPU kernels from torch.profiler; CPU "
           "time = host time to issue one forward (median of 50, no sync); recompile = a new input shape adds a "
           "Dynamo graph.", "",
           "| setup | GPU kernels (memsets not counted) | GPU µs | CPU µs / forward | recompiles on new shape |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['setup']} | {r['kernels']} | {r['gpu_us']} | {r['cpu_us']} | {r['recompile_on_new_shape']} |")
    out += ["", "## Kernels per forward", ""]
    for r in rows:
        out.append(f"**{r['setup']}**")
        out.append("")
        for k, t in r["kernel_list"]:
            out.append(f"- `{k[:110]}` {t} µs")
        out.append("")
    return "\n".join(out)


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="torch.profiler analysis: kernels per forward, CPU time, recompiles (GPU)")
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--trace", type=Path, default=None, help="also write Chrome traces (one per setup) here")
    p.add_argument("--shape", default="8192,768,3072", help="M,D,H (default: the blog's 8192,768,3072)")
    p.set_defaults(_main=main)


def main(args) -> int:
    import datetime as dt
    import json

    import torch

    if not torch.cuda.is_available():
        print("error: profiling needs a CUDA GPU.", file=sys.stderr)
        return 2
    from .common import git_commit

    M, D, H = (int(v) for v in args.shape.split(","))
    rows = profile_setups(args.build_dir, M, D, H, args.trace)
    meta = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, M=M, D=D, H=H,
                commit=git_commit(),
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.md").write_text(to_markdown(rows, meta))
    (args.out / "profile.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(to_markdown(rows, meta).split("## Kernels")[0])
    return 0
