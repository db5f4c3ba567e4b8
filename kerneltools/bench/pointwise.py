"""Pointwise GeGLU benchmark: our CUDA and Triton kernels against eager PyTorch, torch.compile and Liger-Kernel.

Every time is the median of many runs (``triton.testing.do_bench``, which flushes L2 between runs), reported with
the bytes that must move (forward: read gate, up, write out = 3 passes; backward: read dy, gate, up, write d_gate,
d_up = 5 passes), the achieved TB/s and the % of the copy floor measured in the same run.

    python -m kerneltools bench [--quick] [--out benchmarks/results] [--build-dir build]
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import copy_floor_tbs, graph_call_us, median_us as _median_us, meta as _meta, per_call_us

# the autograd rows: every size from decode to the largest prefill, timed as users run it
AUTOGRAD_SIZES = [(1, 14336), (16, 14336), (64, 14336), (256, 9216), (2048, 9216), (4096, 9216), (8192, 14336),
                  (16384, 24576)]
SIZES = [(4096, 9216), (8192, 14336), (16384, 24576), (8192, 3072), (1, 14336), (16, 14336), (64, 14336)]
QUICK_SIZES = [(4096, 9216), (8192, 14336), (16384, 24576), (1, 14336)]


def run(build_dir: Path, out_dir: Path, quick: bool, peers: bool, dtypes: list[str], log=print,
        max_autotune: bool = True) -> dict:
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
                        geglu.geglu_backward(dy, g, u, approximate)

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
                        # max-autotune compiles for minutes per shape: one representative prefill shape
                        if kind == "max-autotune" and (quick or not max_autotune or (M, d) != (8192, 14336)):
                            continue
                        fn = compiled_fn(kind, approximate)
                        cands[f"torch.{kind}"] = (lambda fn=fn: fn(g, u), None)
                    if LigerGELUMulFunction is not None and approximate == "tanh":
                        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
                        yl = LigerGELUMulFunction.apply(gl, ul)
                        cands["liger"] = (lambda: LigerGELUMulFunction.apply(g, u),
                                          lambda: torch.autograd.grad(yl, (gl, ul), dy, retain_graph=True))
                for name, (fwd, bwd) in cands.items():
                    if M <= 64:  # decode: what a call costs back to back, launch and host overhead included
                        call = fwd
                        if name.startswith("ours-"):  # the call a model makes: the output allocated, as eager's
                            geglu.set_backend(name[5:])
                            call = lambda: geglu.geglu(g, u, approximate)  # noqa: E731
                        rows.append(dict(dtype=dname, approximate=approximate, M=M, d=d, impl=name,
                                         pass_="fwd per call", us=round(per_call_us(call), 2), tbs=0, pct_floor=0))
                        if name == "eager" or name.startswith("ours-"):
                            rows.append(dict(dtype=dname, approximate=approximate, M=M, d=d, impl=name,
                                             pass_="fwd per call, CUDA graph", us=round(graph_call_us(call), 2),
                                             tbs=0, pct_floor=0))
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
    rows += autograd_rows(geglu, AUTOGRAD_SIZES[:4] + AUTOGRAD_SIZES[5:7] if quick else AUTOGRAD_SIZES, log=log)
    meta = dict(_meta(torch), copy_floor_tbs=round(floor, 3), variant=geglu.__name__)
    result = dict(meta=meta, rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pointwise.json").write_text(json.dumps(result, indent=1))
    (out_dir / "pointwise.md").write_text(to_markdown(result))
    return result


def autograd_rows(geglu, sizes, dtype_name: str = "bfloat16", rounds: int = 5, log=print,
                  approximations=("tanh", "none")) -> list:
    """Forward+backward through autograd as users run it, ``y = geglu(g, u); torch.autograd.grad(y, (g, u), dy)``,
    wall time per step of back-to-back steps (host and GPU: whichever bounds it), ours against eager's
    ``F.gelu(g) * u`` in interleaved rounds; each row has the median of the per-round ratios to eager."""
    import torch
    import torch.nn.functional as F

    from .common import median

    dtype = getattr(torch, dtype_name)
    out = []
    for approximate in approximations:
        for M, d in sizes:
            g = (torch.randn(M, d, device="cuda") * 3).to(dtype).requires_grad_()
            u = torch.randn(M, d, device="cuda").to(dtype).requires_grad_()
            dy = torch.randn(M, d, device="cuda").to(dtype)
            n = max(20, min(1000, int(2e9 // max(M * d * 2 * 8, 1))))  # ~half a second of steps at large sizes
            steps = {"eager": lambda: torch.autograd.grad(F.gelu(g, approximate=approximate) * u, (g, u), dy),
                     "ours": lambda: torch.autograd.grad(geglu.geglu(g, u, approximate), (g, u), dy)}
            times = {k: [] for k in steps}
            for r in range(rounds):
                for name in (("eager", "ours") if r % 2 == 0 else ("ours", "eager")):
                    times[name].append(per_call_us(steps[name], n=n))
            ratio = median([o / e for o, e in zip(times["ours"], times["eager"])])
            for name in steps:
                out.append(dict(dtype=dtype_name, approximate=approximate, M=M, d=d, impl=name,
                                pass_="fwd+bwd autograd, wall per step", us=round(median(times[name]), 2), tbs=0,
                                pct_floor=0, vs_eager=round(ratio, 3) if name == "ours" else 1.0))
            log(f"autograd {approximate} {M}x{d}: eager {median(times['eager']):.1f} us, ours "
                f"{median(times['ours']):.1f} us per step ({ratio:.3f} of eager)")
            del g, u, dy
    return out


def plot(result: dict, path: Path) -> None:
    """% of the copy floor per implementation, bf16 tanh, forward and forward+backward."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    rows = [r for r in result["rows"] if r["dtype"] == "bfloat16" and r["approximate"] == "tanh"]
    sizes = sorted({(r["M"], r["d"]) for r in rows if r["M"] >= 1024})
    impls = sorted({r["impl"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        w = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            vals = [next((r["pct_floor"] for r in rows if (r["M"], r["d"]) == s and r["impl"] == impl
                          and r["pass_"] == pas), 0) for s in sizes]
            ax.bar([j + i * w for j in range(len(sizes))], vals, w, label=impl)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(sizes))], [f"{m}x{d}" for m, d in sizes])
        ax.set_title(f"{pas}, bf16 tanh")
        ax.axhline(100, color="k", lw=0.5)
    axes[0].set_ylabel("% of copy floor")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"GeGLU on {result['meta']['card']} (commit {result['meta']['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Pointwise GeGLU on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
             f"copy floor {m['copy_floor_tbs']} TB/s measured in the same run. Median of many runs, L2 flushed.",
             "", "| dtype | gelu | M x d | pass | impl | µs | TB/s | % of floor |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "vs_eager" in r:
            continue
        lines.append(f"| {r['dtype']} | {r['approximate']} | {r['M']}x{r['d']} | {r['pass_']} | {r['impl']} | "
                     f"{r['us']} | {r['tbs']} | {r['pct_floor']} |")
    auto = [r for r in result["rows"] if "vs_eager" in r]
    if auto:
        lines += ["", "## Forward+backward through autograd, wall time per step", "",
                  "`y = geglu(g, u); torch.autograd.grad(y, (g, u), dy)` back to back, against eager's "
                  "`F.gelu(g) * u`, interleaved rounds; ratio = median of the per-round ratios.", "",
                  "| gelu | M x d | eager µs | ours µs | ours / eager |", "|---|---|---|---|---|"]
        for r in auto:
            if r["impl"] == "ours":
                e = next(x for x in auto if x["impl"] == "eager" and (x["M"], x["d"], x["approximate"]) ==
                         (r["M"], r["d"], r["approximate"]))
                lines.append(f"| {r['approximate']} | {r['M']}x{r['d']} | {e['us']} | {r['us']} | {r['vs_eager']} |")
    return "\n".join(lines) + "\n"


