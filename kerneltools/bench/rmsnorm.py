"""Gemma RMSNorm benchmark: our Triton kernels against eager (the host module's ops) and torch.compile of them.

Times are medians of ``triton.testing.do_bench`` (L2 flushed between runs) on a GPU; each row gives the bytes
that must move (forward: read x, write y; backward: read x and dy, write dx; the weight and dw are negligible),
the achieved TB/s and the % of the device-to-device copy floor measured in the same run. Decode-sized rows
(one row) give the wall time per back-to-back call instead: there the host is the cost.

    python -m kerneltools.bench.rmsnorm [--quick] [--build-dir build] [--out DIR] [--sweep]

``--sweep`` also times a few tile shapes of the forward and backward at the first shape (the defaults are
``rmsnorm.kernels.fwd_plan`` / ``bwd_plan``). Without a GPU, ``--quick`` runs the same code on CPU tensors (the
Triton kernels under the interpreter with TRITON_INTERPRET=1, else the CPU implementation) with a wall-clock
timer: a check of the plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path

from .common import copy_floor_tbs, per_call_us, timer, wall_us

# (rows, D): Gemma 3 4B prefill 8x2048 (hidden 2560), its q_norm/k_norm rows (8x2048 tokens x 8 heads of 256),
# Gemma 2/3 27B width, a wide row, decode.
SHAPES = [(16384, 2560), (131072, 256), (16384, 5376), (4096, 16384), (1, 2560)]
QUICK_SHAPES = [(16384, 2560), (1, 2560)]
CPU_SHAPES = [(16, 256), (1, 256)]
EPS = 1e-6


def host(x, w, eps=EPS):
    """transformers' GemmaRMSNorm.forward."""
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * (1.0 + w.float())).type_as(x)


def _copy_floor_tbs(torch, cuda: bool) -> float:
    if cuda:
        return copy_floor_tbs(torch)
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    t = wall_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (t * 1e-6) / 1e12


def run(build_dir: Path, quick: bool, dtypes: list[str], sweep: bool, log=print) -> dict:
    import kernels
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    geglu = kernels.get_local_kernel(build_dir)
    tri = importlib.import_module(geglu.__name__ + ".rmsnorm.kernels")
    if not cuda:
        geglu.set_backend("triton" if tri.INTERPRET else "auto")
    time_us = timer(cuda)
    floor = _copy_floor_tbs(torch, cuda)
    log(f"copy floor: {floor:.3f} TB/s on {torch.cuda.get_device_name() if cuda else 'cpu'}")
    torch._dynamo.config.cache_size_limit = 64
    # Inductor on the GPU; on CPU (the plumbing check) aot_eager, which needs no C++ compiler
    compiled = torch.compile(host, dynamic=False, backend="inductor" if cuda else "aot_eager")
    shapes = CPU_SHAPES if not cuda else QUICK_SHAPES if quick else SHAPES
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for M, D in shapes:
            x = torch.randn(M, D, device=device).to(dtype)
            w = (torch.randn(D, device=device) * 0.5).to(dtype)
            dy = torch.randn(M, D, device=device).to(dtype)
            nbytes = M * D * x.element_size()
            impls = {}
            for name, fn in (("ours", lambda x, w: geglu.rms_norm(x, w, EPS)), ("eager", host),
                             ("torch.compile", compiled)):
                xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = fn(xr, wr)
                impls[name] = (lambda fn=fn: fn(x, w),
                               lambda y=y, xr=xr, wr=wr: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True))
            for name, (fwd, bwd) in impls.items():
                if M == 1:  # decode: the host's cost per call, back to back
                    with torch.no_grad():
                        us = per_call_us(fwd) if cuda else wall_us(fwd)
                    rows.append(dict(dtype=dname, M=M, D=D, impl=name, pass_="fwd per call", us=round(us, 2)))
                    continue
                with torch.no_grad():
                    t_f = time_us(fwd)
                t_b = time_us(bwd)
                for pas, t, passes in (("fwd", t_f, 2), ("bwd", t_b, 3)):
                    tbs = passes * nbytes / (t * 1e-6) / 1e12
                    rows.append(dict(dtype=dname, M=M, D=D, impl=name, pass_=pas, us=round(t, 2), tbs=round(tbs, 3),
                                     pct_floor=round(100 * tbs / floor, 1)))
            for r in rows:  # time relative to eager's, same shape and pass
                if (r["dtype"], r["M"], r["D"]) == (dname, M, D):
                    ref = next(q["us"] for q in rows if (q["dtype"], q["M"], q["D"], q["pass_"], q["impl"])
                               == (dname, M, D, r["pass_"], "eager"))
                    r["vs_eager"] = round(r["us"] / ref, 3) if ref else None
            log(f"{dname} {M}x{D}: " + ", ".join(f"{r['impl']} {r['pass_']} {r['us']}us"
                                                 + (f" {r['pct_floor']}%" if "pct_floor" in r else "")
                                                 for r in rows if (r["dtype"], r["M"], r["D"]) == (dname, M, D)))
    sweeps = _sweep(torch, tri, time_us, floor, shapes[0], dtypes[0], device) if sweep else []
    geglu.set_backend("auto")
    from .common import meta as _meta

    meta = _meta(torch) if cuda else dict(card="cpu", torch=torch.__version__)
    return dict(meta=dict(meta, copy_floor_tbs=round(floor, 3), variant=geglu.__name__), rows=rows, sweep=sweeps)


@contextlib.contextmanager
def _tiles(tri, plan_name: str, tiles):
    """``rmsnorm.kernels``' plan ``plan_name`` (``fwd_plan`` / ``bwd_plan``) with its (block_m, num_warps[,
    programs]) set to ``tiles`` for the launches inside the block (None: the shipped plan); yields the plan."""
    shipped = getattr(tri, plan_name)

    def plan(M, D, device):
        grid, block_m, block_d, warps, looped = shipped(M, D, device)
        if tiles is None or looped:
            return grid, block_m, block_d, warps, looped
        row_blocks = -(-M // tiles[0])  # the forward's grid; the backward's is capped at ``programs``
        grid = (max(1, min(row_blocks, tiles[2])) if len(tiles) > 2 else row_blocks,)
        return grid, tiles[0], block_d, tiles[1], False

    setattr(tri, plan_name, plan)
    try:
        yield plan
    finally:
        setattr(tri, plan_name, shipped)


def _sweep(torch, tri, time_us, floor, shape, dname, device) -> list:
    """Forward (block_m, num_warps) and backward (block_m, num_warps, programs) tiles at one shape."""
    M, D = shape
    dtype = getattr(torch, dname)
    x = torch.randn(M, D, device=device).to(dtype)
    w = (torch.randn(D, device=device) * 0.5).to(dtype)
    dy = torch.randn(M, D, device=device).to(dtype)
    eps = tri.f32(EPS)
    _, rstd = tri.forward(x, w, eps, 1.0, True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    nbytes = M * D * x.element_size()
    out = []
    for tiles in [None, (1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)]:
        with _tiles(tri, "fwd_plan", tiles) as plan_of:
            t = time_us(lambda: tri.forward(x, w, eps, 1.0, False))
            plan = plan_of(M, D, x.device)
        out.append(dict(pass_="fwd", tiles=str(tiles or (plan[1], plan[3])), us=round(t, 2),
                        pct_floor=round(100 * 2 * nbytes / (t * 1e-6) / 1e12 / floor, 1)))
    for tiles in [None, (1, 8, 4 * sms), (1, 16, 2 * sms), (1, 16, 4 * sms), (1, 32, sms), (1, 32, 2 * sms),
                  (2, 16, 2 * sms)]:
        with _tiles(tri, "bwd_plan", tiles) as plan_of:
            t = time_us(lambda: tri.backward(dy, x, w, rstd, eps, 1.0, True))
            plan = plan_of(M, D, x.device)
        out.append(dict(pass_="bwd", tiles=str(tiles or (plan[1], plan[3], plan[0][0])), us=round(t, 2),
                        pct_floor=round(100 * 3 * nbytes / (t * 1e-6) / 1e12 / floor, 1)))
    return out


def to_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Gemma RMSNorm on {m['card']}", "",
             f"{m.get('date', '')} commit {m.get('commit', '?')}, torch {m['torch']}, triton {m.get('triton', '?')}; "
             f"copy floor {m['copy_floor_tbs']} TB/s; variant {m['variant']}.", "",
             "| dtype | M x D | pass | impl | µs | TB/s | % of copy floor | time vs eager |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['dtype']} | {r['M']}x{r['D']} | {r['pass_']} | {r['impl']} | {r['us']} | "
                     f"{r.get('tbs', '–')} | {r.get('pct_floor', '–')} | {r.get('vs_eager', '–')} |")
    if res.get("sweep"):
        lines += ["", "Tiles at the first shape (block_m, num_warps[, programs] in place of `rmsnorm.kernels.fwd_plan`'s "
                  "/ `bwd_plan`'s):", "",
                  "| pass | tiles | µs | % of copy floor |", "|---|---|---|---|"]
        lines += [f"| {s['pass_']} | {s['tiles']} | {s['us']} | {s['pct_floor']} |" for s in res["sweep"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kerneltools.bench.rmsnorm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", type=Path, default=Path("build"), help="the build tree to load the kernel from")
    ap.add_argument("--out", type=Path, default=None, help="write rmsnorm.md and rmsnorm.json here")
    ap.add_argument("--quick", action="store_true", help="two shapes (on a GPU); the only mode without one")
    ap.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--sweep", action="store_true", help="also time tile shapes at the first shape")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.quick:
        print("error: without a CUDA GPU only --quick runs (a check of the code path, not a measurement).",
              file=sys.stderr)
        return 2
    if not (args.build_dir / "torch-cpu").is_dir() and not any(args.build_dir.glob("torch*")):
        print(f"error: no build tree at {args.build_dir}: run `python -m kerneltools build` first or pass "
              "--build-dir.", file=sys.stderr)
        return 2
    res = run(args.build_dir, args.quick, args.dtype or ["bfloat16"], args.sweep)
    md = to_markdown(res)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rmsnorm.json").write_text(json.dumps(res, indent=1))
        (args.out / "rmsnorm.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
