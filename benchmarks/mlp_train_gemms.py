"""Where the time of a GeGLU MLP training step goes, GEMM by GEMM, and what other layouts of the same GEMMs cost:
which of them could make our training step faster (issue 7: forward+backward >= 3 % ahead of the best peer).
Dev tool; bf16, tanh; every time is a do_bench median (L2 flushed), interleaved over rounds, medians of rounds.

    python benchmarks/mlp_train_gemms.py [--build-dir build] [--shapes 8192x2304x9216 8192x4096x14336]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median, _median_us, cublas_tflops, mlp_impls  # noqa: E402


def candidates(geglu, M, D, H):
    """name -> (fn, flops). The eager step's GEMMs in its own layouts, then alternatives."""
    pw = importlib.import_module(geglu.__name__ + "._custom_ops")
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, D, **bf)
    wg, wu, wd = (torch.randn(H, D, **bf) * 0.02, torch.randn(H, D, **bf) * 0.02, torch.randn(D, H, **bf) * 0.02)
    wgu = torch.cat([wg, wu])
    dy = torch.randn(M, D, **bf)
    g, u, h = torch.randn(M, H, **bf), torch.randn(M, H, **bf), torch.randn(M, H, **bf)
    gu = torch.randn(M, 2 * H, **bf)
    out_h, dg, du = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
    unit = 2 * M * D * H
    fast_save = kt.FAST_LARGE._replace(fast_epi=True)
    return {
        "fwd g, u: 2 x mm(x, W.t())": (lambda: (torch.mm(x, wg.t()), torch.mm(x, wu.t())), 2 * unit),
        "fwd g, u: 2 x mm into the halves of gu (out=)": (
            lambda: (torch.mm(x, wg.t(), out=gu[:, :H]), torch.mm(x, wu.t(), out=gu[:, H:])), 2 * unit),
        "fwd gu: mm(x, Wgu.t()), packed weight": (lambda: torch.mm(x, wgu.t()), 2 * unit),
        "fwd geglu pointwise (Triton)": (lambda: pw._forward_into(out_h, g, u, "tanh", True), 0),
        "fwd fused gate/up + GeGLU, save g,u,h (FAST_LARGE)": (
            lambda: kt.gate_up_geglu(x, wg, wu, True, True, config=fast_save), 2 * unit),
        "fwd fused gate/up + GeGLU, save g,u,h (eager epilogue)": (
            lambda: kt.gate_up_geglu(x, wg, wu, True, True, config=kt.FAST_LARGE), 2 * unit),
        "fwd down: mm(h, Wd.t())": (lambda: torch.mm(h, wd.t()), unit),
        "bwd dWd: mm(dy.t(), h)": (lambda: torch.mm(dy.t(), h), unit),
        "bwd dWd: mm(h.t(), dy).t()": (lambda: torch.mm(h.t(), dy).t(), unit),
        "bwd d_h: mm(dy, Wd)": (lambda: torch.mm(dy, wd), unit),
        "bwd dgeglu pointwise (Triton)": (lambda: pw._backward_into(dg, du, h, g, u, "tanh"), 0),
        "bwd dX: mm(dg, Wg) + mm(du, Wu)": (lambda: torch.mm(g, wg) + torch.mm(u, wu), 2 * unit),
        "bwd dX: mm(dg, Wg).addmm_(du, Wu)": (lambda: torch.mm(g, wg).addmm_(u, wu), 2 * unit),
        "bwd dX: mm(dgu, Wgu), K=2H": (lambda: torch.mm(gu, wgu), 2 * unit),
        "bwd dWg, dWu: 2 x mm(d.t(), x)": (lambda: (torch.mm(g.t(), x), torch.mm(u.t(), x)), 2 * unit),
        "bwd dWg, dWu: 2 x mm(x.t(), d).t()": (lambda: (torch.mm(x.t(), g).t(), torch.mm(x.t(), u).t()), 2 * unit),
        "bwd dWgu: mm(dgu.t(), x), N=2H": (lambda: torch.mm(gu.t(), x), 2 * unit),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shapes", nargs="+", default=["8192x2304x9216", "8192x4096x14336"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    peak = cublas_tflops(torch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; cuBLAS bf16 8192^3: {peak:.0f} TFLOP/s")
    for shape in args.shapes:
        M, D, H = map(int, shape.split("x"))
        cands = candidates(geglu, M, D, H)
        impls = mlp_impls(geglu, D, H)
        xg = torch.randn(M, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        for name in ("eager", "liger", "ours"):
            if name in impls:
                mod = impls[name]
                params = list(mod.parameters()) + [xg]
                cands[f"step: {name}"] = (lambda mod=mod, params=params: torch.autograd.grad(mod(xg), params, dy),
                                          9 * 2 * M * D * H)
        times = {k: [] for k in cands}
        for _ in range(args.rounds):
            for k, (fn, _) in cands.items():
                times[k].append(_median_us(fn, rep_ms=100))
        print(f"\n{M}x{D}x{H} (one GEMM unit 2*M*D*H = {2 * M * D * H / 1e12:.3f} TFLOP)")
        for k, (fn, flops) in cands.items():
            t = _median(times[k])
            rate = f"{flops / t / 1e6:6.0f} TFLOP/s {100 * flops / t / 1e6 / peak:5.1f}%" if flops else ""
            print(f"  {k:<58} {t:9.1f} us  {rate}")
        del cands, impls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
