"""Benchmarks (GPU), one module per concern:

* ``pointwise``: the GeGLU kernels alone against eager, torch.compile and Liger (% of the copy floor);
* ``mlp``: the whole Gemma-style MLP layer (% of cuBLAS, ratio to eager, memory);
* ``model``: whole transformers models through ``kernelize`` (prefill, decode, training; eager, kernelized,
  compile, kernelized + compile);
* ``profile``: the profiling analysis behind the project (kernels per forward, CPU time, recompiles);
* ``cold``: a fresh process's first calls, eager against kernelized, with an empty Triton cache (``--cold-start``);
* ``fused_rule``: where the fused gate/up GEMM wins, the measurement behind the package's shipped rule.

    python -m kerneltools bench [--quick] [--dtype bfloat16] [--out DIR]     # pointwise + MLP
    python -m kerneltools bench --mlp-only
    python -m kerneltools bench --model gemma3-4b [--model all] [--parts ...] [--modes ...]
    python -m kerneltools bench --cold-start [--model gemma3-4b] [--processes 2]
    python -m kerneltools profile
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import model as _model


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the kernels, the MLP layer or whole models (GPU; --tiny models run on "
                                     "CPU)")
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--out", type=Path, default=None, help="where results go (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="pointwise: fewer sizes, no max-autotune")
    p.add_argument("--no-peers", action="store_true", help="pointwise: skip torch.compile and Liger")
    p.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-max-autotune", action="store_true",
                   help="pointwise: skip torch.compile(mode='max-autotune') (minutes of autotuning per shape)")
    p.add_argument("--no-mlp", action="store_true", help="skip the whole-MLP benchmark")
    p.add_argument("--mlp-only", action="store_true",
                   help="only the whole-MLP benchmark (writes mlp.md and mlp.json under --out)")
    p.add_argument("--cold-start", action="store_true",
                   help="time a fresh process's first and second calls (prefill, generate, training step), eager "
                        "and kernelized, with an empty Triton cache (writes cold-start.md / .json under --out)")
    p.add_argument("--cold-modes", default="eager,kernelized,kernelized-jit",
                   help="--cold-start's modes (default eager,kernelized,kernelized-jit: the kernelized model with "
                        "GEGLU_PREBUILT=0; also kernelized-noarch: loaded from the build's noarch variants alone)")
    _model.add_arguments(p)
    p.set_defaults(_main=main)


def main(args) -> int:
    import torch

    if args.out is None:
        args.out = Path("benchmarks/results")
    if args.cold_start:
        from . import cold

        return cold.main(args)
    if args.model or args.merge or args.pool:
        return _model.main(args)
    if args.mlp_only and args.no_mlp:
        print("error: --mlp-only and --no-mlp leave nothing to run; give one of them.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (the whole-model benchmark runs on CPU with --model NAME "
              "--tiny).", file=sys.stderr)
        return 2
    from . import mlp, pointwise
    from .common import meta

    if args.mlp_only:
        res = mlp.run_mlp(args.build_dir)
        args.out.mkdir(parents=True, exist_ok=True)
        m = meta(torch)
        (args.out / "mlp.json").write_text(json.dumps(dict(meta=m, mlp=res), indent=1))
        (args.out / "mlp.md").write_text(f"# Whole GeGLU MLP on {m['card']}\n\n{m['date']}, commit {m['commit']}, "
                                         f"torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}.\n"
                                         + mlp.mlp_markdown(res))
        return 0
    res = pointwise.run(args.build_dir, args.out, args.quick, not args.no_peers,
                        args.dtype or ["bfloat16", "float16", "float32"], max_autotune=not args.no_max_autotune)
    pointwise.plot(res, args.out / "pointwise.png")
    if not args.no_mlp:
        res["mlp"] = mlp.run_mlp(args.build_dir)
        (args.out / "pointwise.json").write_text(json.dumps(res, indent=1))
        with (args.out / "pointwise.md").open("a") as f:
            f.write(mlp.mlp_markdown(res["mlp"]))
    return 0
