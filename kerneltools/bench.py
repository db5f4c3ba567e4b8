"""Pointwise GeGLU benchmark: our CUDA and Triton kernels against eager PyTorch, torch.compile and Liger-Kernel.

Every time is the median of many runs (``triton.testing.do_bench``, which flushes L2 between runs), reported with
the bytes that must move (forward: read gate, up, write out = 3 passes; backward: read dy, gate, up, write d_gate,
d_up = 5 passes), the achieved TB/s and the % of the copy floor measured in the same run.

    python -m kerneltools bench [--quick] [--out benchmarks/results] [--build-dir build]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import subprocess
import sys
from pathlib import Path

SIZES = [(4096, 9216), (8192, 14336), (16384, 24576), (8192, 3072), (1, 14336), (16, 14336), (64, 14336)]
QUICK_SIZES = [(4096, 9216), (8192, 14336), (16384, 24576), (1, 14336)]


def _median_us(fn, rep_ms=200):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def copy_floor_tbs(torch) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the floor every pointwise pass is held to."""
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = _median_us(lambda: dst.copy_(src), rep_ms=500)
    return 2 * src.numel() * 2 / (t * 1e-6) / 1e12


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def run(build_dir: Path, out_dir: Path, quick: bool, peers: bool, dtypes: list[str], log=print) -> dict:
    import torch
    import torch.nn.functional as F
    import kernels

    torch.backends.cuda.matmul.allow_tf32 = False
    geglu = kernels.get_local_kernel(build_dir)
    impls = ["triton"] + (["cuda"] if geglu.HAS_CUDA_LIB else [])
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction  # type: ignore
    except Exception:  # not installed
        LigerGELUMulFunction = None

    floor = copy_floor_tbs(torch)
    log(f"copy floor: {floor:.3f} TB/s on {torch.cuda.get_device_name()}")
    rows = []
    sizes = QUICK_SIZES if quick else SIZES
    torch._dynamo.config.cache_size_limit = 256
    compiled = {}

    def compiled_fn(kind, approximate):
        key = (kind, approximate)
        if key not in compiled:
            mode = None if kind == "compile" else "max-autotune-no-cudagraphs"
            compiled[key] = torch.compile(lambda g, u: F.gelu(g, approximate=approximate) * u, mode=mode,
                                          dynamic=False)
        return compiled[key]

    for dname in dtypes:
        dtype = getattr(torch, dname)
        for approximate in ("tanh", "none"):
            for M, d in sizes:
                g = (torch.randn(M, d, device="cuda") * 3).to(dtype)
                u = torch.randn(M, d, device="cuda").to(dtype)
                dy = torch.randn(M, d, device="cuda").to(dtype)
                out = torch.empty_like(g)
                E = M * d * g.element_size()
                cands = {}
                for impl in impls:
                    def fwd(impl=impl):
                        geglu.set_backend(impl)
                        geglu.geglu(g, u, approximate, out=out)

                    def bwd(impl=impl):
                        geglu.set_backend(impl)
                        geglu.ops.geglu_backward(dy, g, u, approximate)

                    cands[f"ours-{impl}"] = (fwd, bwd)

                gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()

                def eager_fwd():
                    return F.gelu(g, approximate=approximate) * u

                def eager_bwd():
                    y = F.gelu(gr, approximate=approximate) * ur
                    return lambda: torch.autograd.grad(y, (gr, ur), dy, retain_graph=True)

                cands["eager"] = (eager_fwd, eager_bwd())
                if peers and dname == "bfloat16":
                    for kind in ("compile", "max-autotune"):
                        if kind == "max-autotune" and (quick or M * d < 2**24):
                            continue
                        fn = compiled_fn(kind, approximate)
                        cands[f"torch.{kind}"] = (lambda fn=fn: fn(g, u), None)
                    if LigerGELUMulFunction is not None and approximate == "tanh":
                        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
                        yl = LigerGELUMulFunction.apply(gl, ul)
                        cands["liger"] = (lambda: LigerGELUMulFunction.apply(g, u),
                                          lambda: torch.autograd.grad(yl, (gl, ul), dy, retain_graph=True))
                for name, (fwd, bwd) in cands.items():
                    t_f = _median_us(fwd)
                    t_b = _median_us(bwd) if bwd is not None else None
                    for pas, t, passes in (("fwd", t_f, 3), ("bwd", t_b, 5)):
                        if t is None:
                            continue
                        tbs = passes * E / (t * 1e-6) / 1e12
                        rows.append(dict(dtype=dname, approximate=approximate, M=M, d=d, impl=name, pass_=pas,
                                         us=round(t, 2), tbs=round(tbs, 3), pct_floor=round(100 * tbs / floor, 1)))
                    if t_b is not None:
                        t = t_f + t_b
                        tbs = 8 * E / (t * 1e-6) / 1e12
                        rows.append(dict(dtype=dname, approximate=approximate, M=M, d=d, impl=name, pass_="fwd+bwd",
                                         us=round(t, 2), tbs=round(tbs, 3), pct_floor=round(100 * tbs / floor, 1)))
                log(f"{dname} {approximate} {M}x{d}: " + ", ".join(
                    f"{r['impl']} {r['pass_']} {r['us']}us {r['pct_floor']}%" for r in rows
                    if (r["M"], r["d"], r["dtype"], r["approximate"]) == (M, d, dname, approximate)))
                del g, u, dy, out, gr, ur
                torch.cuda.empty_cache()
    geglu.set_backend("auto")
    import triton

    meta = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(),
                commit=_git_commit(Path(__file__).resolve().parents[1]),
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                copy_floor_tbs=round(floor, 3), variant=geglu.__name__)
    result = dict(meta=meta, rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pointwise.json").write_text(json.dumps(result, indent=1))
    (out_dir / "pointwise.md").write_text(to_markdown(result))
    return result


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Pointwise GeGLU on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
             f"copy floor {m['copy_floor_tbs']} TB/s measured in the same run. Median of many runs, L2 flushed.",
             "", "| dtype | gelu | M x d | pass | impl | µs | TB/s | % of floor |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['approximate']} | {r['M']}x{r['d']} | {r['pass_']} | {r['impl']} | "
                     f"{r['us']} | {r['tbs']} | {r['pct_floor']} |")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the pointwise kernels against eager, torch.compile and Liger (GPU)")
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="fewer sizes, no max-autotune")
    p.add_argument("--no-peers", action="store_true", help="skip torch.compile and Liger")
    p.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(_main=main)


def main(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU.", file=sys.stderr)
        return 2
    run(args.build_dir, args.out, args.quick, not args.no_peers, args.dtype or ["bfloat16", "float16", "float32"])
    return 0


if __name__ == "__main__":  # python -m kerneltools.bench
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    a = ap.parse_args(["bench", *sys.argv[1:]])
    sys.exit(a._main(a))
