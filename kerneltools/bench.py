"""Pointwise GeGLU benchmark: our CUDA and Triton kernels against eager PyTorch, torch.compile and Liger-Kernel.

Every time is the median of many runs (``triton.testing.do_bench``, which flushes L2 between runs), reported with
the bytes that must move (forward: read gate, up, write out = 3 passes; backward: read dy, gate, up, write d_gate,
d_up = 5 passes), the achieved TB/s and the % of the copy floor measured in the same run.

    python -m kerneltools bench [--quick] [--out benchmarks/results] [--build-dir build]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
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


def per_call_us(fn, n: int = 2000) -> float:
    """Wall time per call of back-to-back calls, launch and Python overhead included (what decode sees)."""
    import time

    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_call_us(fn, calls: int = 100) -> float:
    """Time per call of ``calls`` calls captured in one CUDA graph and replayed: the GPU time plus the graph's
    per-kernel cost, with the host out of it (decode with transformers' static cache and "reduce-overhead")."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    t = per_call_us(graph.replay, n=200) / calls
    del graph
    return t


def copy_floor_tbs(torch) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the floor every pointwise pass is held to."""
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = _median_us(lambda: dst.copy_(src), rep_ms=500)
    return 2 * src.numel() * 2 / (t * 1e-6) / 1e12


def _meta(torch) -> dict:
    import triton

    return dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(),
                commit=_git_commit(Path(__file__).resolve().parents[1]),
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def _git_commit(root: Path) -> str:
    """HEAD's short id; GEGLU_COMMIT when set (the GPU machine gets a copy of the tree without .git)."""
    import os

    if os.environ.get("GEGLU_COMMIT"):
        return os.environ["GEGLU_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


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
    meta = dict(_meta(torch), copy_floor_tbs=round(floor, 3), variant=geglu.__name__)
    result = dict(meta=meta, rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pointwise.json").write_text(json.dumps(result, indent=1))
    (out_dir / "pointwise.md").write_text(to_markdown(result))
    return result


MLP_SHAPES = [(8192, 2304, 9216), (8192, 4096, 14336), (16, 4096, 14336)]


def cublas_tflops(torch) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = _median_us(lambda: a @ b, rep_ms=500)
    return 2 * 8192**3 / (t * 1e-6) / 1e12


def _no_grad_call(torch, mod, x):
    with torch.no_grad():
        return mod(x)


def mlp_impls(geglu, D: int, H: int) -> dict:
    """The same Gemma-style MLP (bf16, tanh GeGLU, shared weights) as eager, torch.compile, Liger's LigerGEGLUMLP
    (when installed) and ours (the hub layer's forward bound to the module, as kernelize does)."""
    import torch
    from torch import nn

    class GatedMLP(nn.Module):  # transformers' Gemma MLP
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(D, H, bias=False)
            self.up_proj = nn.Linear(D, H, bias=False)
            self.down_proj = nn.Linear(H, D, bias=False)
            self.act_fn = nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    base = GatedMLP().to("cuda", torch.bfloat16)
    impls = {"eager": base, "torch.compile": torch.compile(base, dynamic=False)}
    try:
        from liger_kernel.transformers.geglu import LigerGEGLUMLP  # type: ignore

        class Cfg:
            hidden_size, intermediate_size, hidden_act = D, H, "gelu_pytorch_tanh"

        liger = LigerGEGLUMLP(Cfg()).to("cuda", torch.bfloat16)
        liger.load_state_dict(base.state_dict(), strict=False)
        impls["liger"] = liger
    except Exception as e:  # not installed
        print(f"(Liger not available: {e})", file=sys.stderr)
    ours = GatedMLP().to("cuda", torch.bfloat16)
    ours.load_state_dict(base.state_dict())
    ours.forward = geglu.layers.GeGLUMLP.forward.__get__(ours)
    impls["ours"] = ours
    fm = importlib.import_module(geglu.__name__ + "._fused_mlp")
    if fm.ENABLED:  # ours without the fused inference path, as its own row; training is the same path
        unfused = GatedMLP().to("cuda", torch.bfloat16)
        unfused.load_state_dict(base.state_dict())
        layer_forward = geglu.layers.GeGLUMLP.forward.__get__(unfused)

        def unfused_forward(x):
            fm.ENABLED = False
            try:
                return layer_forward(x)
            finally:
                fm.ENABLED = True

        unfused.forward = unfused_forward
        impls[UNFUSED_ROW] = unfused
    return impls


UNFUSED_ROW = "ours, GEGLU_FUSED_MLP=0"


def run_mlp(build_dir: Path, shapes=MLP_SHAPES, log=print) -> dict:
    """The whole MLP (bf16, tanh GeGLU): eager, torch.compile, Liger's LigerGEGLUMLP and our GeGLUMLP layer;
    forward and forward+backward median times, % of the cuBLAS FLOP rate measured here, peak memory."""
    import torch
    import kernels

    geglu = kernels.get_local_kernel(build_dir)
    peak_tflops = cublas_tflops(torch)
    log(f"cuBLAS bf16 8192^3: {peak_tflops:.0f} TFLOP/s")
    rows = []
    fm = importlib.import_module(geglu.__name__ + "._fused_mlp")
    for M, D, H in shapes:
        decided_before = set(getattr(fm, "DECISION_TIMES", {}))
        impls = mlp_impls(geglu, D, H)
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        xg = x.clone().requires_grad_()
        dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        flops_f = 6 * M * D * H
        # GEMM-bound timings drift with the GPU's clocks (seen: the same cuBLAS kernels 6% apart between two
        # runs), and host-bound rows (M <= 64) shift by 15 % with their place in a round (the same ops measured
        # 1.15x eager in the middle of a round with compile and Liger, 0.97x in a round without them). So each
        # implementation is timed in a pair with eager, right next to it, the pair's order alternating; every
        # time is kept for the medians, and each pair gives a ratio to eager.
        timings = {name: ([], []) for name in impls}
        ratios = {name: ([], []) for name in impls}
        others = [name for name in impls if name != "eager"]
        rounds = 3 if M > 64 else 11  # decode-sized rows are host-bound and noisier (±30 %)
        for pair in _pair_schedule(others, rounds):
            name = pair[1] if pair[0] == "eager" else pair[0]
            got = {}
            for n in pair:
                mod = impls[n]
                params = [p for p in mod.parameters()] + [xg]
                t_f = _median_us(lambda: _no_grad_call(torch, mod, x), rep_ms=100)
                t_fb = None
                if n != UNFUSED_ROW:  # its training path is "ours"
                    t_fb = _median_us(lambda: torch.autograd.grad(mod(xg), params, dy), rep_ms=100)
                got[n] = (t_f, t_fb)
                timings[n][0].append(t_f)
                if t_fb is not None:
                    timings[n][1].append(t_fb)
            ratios[name][0].append(got[name][0] / got["eager"][0])
            if got[name][1] is not None:
                ratios[name][1].append(got[name][1] / got["eager"][1])
        for name, mod in impls.items():
            params = [p for p in mod.parameters()] + [xg]

            def fwd_bwd():
                torch.autograd.grad(mod(xg), params, dy)

            t_f = _median(timings[name][0])
            t_fb = _median(timings[name][1]) if timings[name][1] else None
            vs_f = round(_median(ratios[name][0]), 3) if name != "eager" else 1.0
            vs_fb = (round(_median(ratios[name][1]), 3) if ratios[name][1] else None) if name != "eager" else 1.0
            fwd_peak = _peak_mib(torch, lambda: _no_grad_call(torch, mod, x))
            peak = _peak_mib(torch, fwd_bwd) if t_fb is not None else None
            rows.append(dict(M=M, D=D, H=H, impl=name, fwd_us=round(t_f, 1),
                             fwd_bwd_us=round(t_fb, 1) if t_fb else None,
                             fwd_pct_cublas=round(100 * flops_f / (t_f * 1e-6) / 1e12 / peak_tflops, 1),
                             fwd_bwd_pct_cublas=(round(100 * 3 * flops_f / (t_fb * 1e-6) / 1e12 / peak_tflops, 1)
                                                 if t_fb else None),
                             fwd_vs_eager=vs_f, fwd_bwd_vs_eager=vs_fb,
                             fwd_peak_mib=round(fwd_peak, 1), peak_mib=round(peak, 1) if peak is not None else None))
            log(f"MLP {M}x{D}x{H} {name}: fwd {t_f:.1f}us fwd+bwd {t_fb or float('nan'):.1f}us "
                f"peak fwd {fwd_peak:.0f} MiB, fwd+bwd {peak or float('nan'):.0f} MiB")
        for key, t in getattr(fm, "DECISION_TIMES", {}).items():
            if key not in decided_before and t:
                log(f"MLP {M}x{D}x{H} ours: the fused-path rule timed fused {t['fused_ms'] * 1e3:.0f} us vs regular "
                    f"{t['regular_ms'] * 1e3:.0f} us -> {'fused' if fm._DECISIONS.get(key) else 'regular'}")
        del impls, x, xg, dy
        torch.cuda.empty_cache()
    return dict(cublas_tflops=round(peak_tflops, 1), rows=rows)


def _pair_schedule(others: list, rounds: int) -> list:
    """The benchmark's timing order: per round, each implementation in ``others`` next to eager, as a pair
    [first, second]; the implementations' order reverses every round and eager's place in the pair alternates, so
    that neither a place in the round nor a place in the pair favours anyone."""
    pairs = []
    for r in range(rounds):
        for name in others if r % 2 == 0 else others[::-1]:
            # eager's place alternates per implementation from round to round (keyed on the implementation, not on
            # its place in the reversed order, which would pin each one to one side of its pair)
            pairs.append(["eager", name] if (r + others.index(name)) % 2 == 0 else [name, "eager"])
    return pairs


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def _peak_mib(torch, fn) -> float:
    """Memory allocated above what was live before, at its peak during one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def mlp_markdown(res: dict) -> str:
    def cell(v):
        return "—" if v is None else v

    lines = ["", f"## Whole MLP (bf16, tanh), cuBLAS 8192^3 at {res['cublas_tflops']} TFLOP/s in the same run", "",
             "Each implementation is timed in a pair with eager (the pair's order alternating), 3 rounds (11 at "
             "M <= 64, host-bound); times are medians of all its do_bench medians; peak = "
             "memory allocated above the inputs during one forward (no grad) or forward+backward. "
             "'ours' takes the fused gate/up GEMM in inference where it times faster; "
             f"'{UNFUSED_ROW}' is ours without it (forward only: training is the same path). "
             "'/ eager' = the median over the pairs of its time divided by eager's in the same pair.", "",
             "| M x D x H | impl | fwd µs | fwd % cuBLAS | fwd / eager | fwd+bwd µs | fwd+bwd % cuBLAS "
             "| fwd+bwd / eager | peak extra MiB (fwd) | peak extra MiB (fwd+bwd) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['M']}x{r['D']}x{r['H']} | {r['impl']} | {r['fwd_us']} | {r['fwd_pct_cublas']} | "
                     f"{cell(r.get('fwd_vs_eager'))} | {cell(r['fwd_bwd_us'])} | {cell(r['fwd_bwd_pct_cublas'])} | "
                     f"{cell(r.get('fwd_bwd_vs_eager'))} | {cell(r.get('fwd_peak_mib'))} | {cell(r['peak_mib'])} |")
    return "\n".join(lines) + "\n"


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
    p.add_argument("--no-max-autotune", action="store_true",
                   help="skip torch.compile(mode='max-autotune') (minutes of autotuning per shape)")
    p.add_argument("--no-mlp", action="store_true", help="skip the whole-MLP benchmark")
    p.add_argument("--mlp-only", action="store_true",
                   help="only the whole-MLP benchmark (writes mlp.md and mlp.json under --out)")
    p.set_defaults(_main=main)


def main(args) -> int:
    import torch

    if args.mlp_only and args.no_mlp:
        print("error: --mlp-only and --no-mlp leave nothing to run; give one of them.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (run it on one; `benchmarks/device_run.sh bench` shows how).",
              file=sys.stderr)
        return 2
    if args.mlp_only:
        mlp = run_mlp(args.build_dir)
        args.out.mkdir(parents=True, exist_ok=True)
        m = _meta(torch)
        (args.out / "mlp.json").write_text(json.dumps(dict(meta=m, mlp=mlp), indent=1))
        (args.out / "mlp.md").write_text(f"# Whole GeGLU MLP on {m['card']}\n\n{m['date']}, commit {m['commit']}, "
                                         f"torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}.\n"
                                         + mlp_markdown(mlp))
        return 0
    res = run(args.build_dir, args.out, args.quick, not args.no_peers,
              args.dtype or ["bfloat16", "float16", "float32"], max_autotune=not args.no_max_autotune)
    plot(res, args.out / "pointwise.png")
    if not args.no_mlp:
        mlp = run_mlp(args.build_dir)
        res["mlp"] = mlp
        (args.out / "pointwise.json").write_text(json.dumps(res, indent=1))
        with (args.out / "pointwise.md").open("a") as f:
            f.write(mlp_markdown(mlp))
    return 0


if __name__ == "__main__":  # python -m kerneltools.bench
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    a = ap.parse_args(["bench", *sys.argv[1:]])
    sys.exit(a._main(a))
