"""Does a gate/up GEMM with one N = 2 * BLOCK_N dot per K step (the widest wgmma; the x tile read from shared memory
once instead of twice) over the two weights in place (the paired kernel: one strided 3-D TMA box) beat the
two-accumulator fused kernel and cuBLAS? Issue 7's forward <= 4100 us at 8192x4096x14336 needs the gate/up GEMM a
few % faster than cuBLAS. (Runs up to f45f1ef also timed a row-interleaved packed copy [2H, D] of the weights:
no faster than paired, so it was removed; benchmarks/results/h200/packed-probe.txt.)
Dev tool (device); bf16, tanh; every time is a do_bench median (L2 flushed), interleaved over rounds, medians of
rounds. Prints the error of each path against an fp32 reference next to eager's.

    python benchmarks/packed_probe.py [--build-dir build] [--shapes 8192x4096x14336 8192x2304x9216] [--rounds 5]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median, _median_us, cublas_tflops  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shapes", nargs="+", default=["8192x4096x14336", "8192x2304x9216"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    pw = importlib.import_module(geglu.__name__ + "._custom_ops")
    peak = cublas_tflops(torch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; cuBLAS bf16 8192^3: {peak:.0f} TFLOP/s",
          flush=True)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for shape in args.shapes:
        M, D, H = map(int, shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, D, generator=gen, **bf)
        wg, wu, wd = (torch.randn(*s, generator=gen, **bf) * D ** -0.5 for s in ((H, D), (H, D), (D, H)))
        wd = wd * (D / H) ** 0.5
        wstack = torch.cat([wg, wu])
        h_buf, g_buf, u_buf = (torch.empty(M, H, **bf) for _ in range(3))
        fast = kt.FAST_LARGE._replace(fast_epi=True)
        unit = 2 * M * D * H

        def regular():
            torch.mm(x, wg.t(), out=g_buf)
            torch.mm(x, wu.t(), out=u_buf)
            pw._forward_into(h_buf, g_buf, u_buf, "tanh", True)
            return h_buf

        cands = {
            "cuBLAS g, u: 2 x mm": (lambda: (torch.mm(x, wg.t(), out=g_buf), torch.mm(x, wu.t(), out=u_buf)),
                                    2 * unit),
            "cuBLAS [g|u]: 1 mm, stacked [2H, D]": (lambda: torch.mm(x, wstack.t()), 2 * unit),
            "cuBLAS g, u + our GeGLU": (regular, 2 * unit),
            f"dual-acc fused {fast.label()}": (lambda: kt.gate_up_geglu(x, wg, wu, True, False, config=fast),
                                               2 * unit),
        }
        for cfg in kt.PAIRED_SWEEP:
            cands[f"paired {cfg.label()}"] = (
                lambda cfg=cfg: kt.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg), 2 * unit)
        cands["train: dual-acc fused, save g,u,h"] = (lambda: kt.gate_up_geglu(x, wg, wu, True, True, config=fast),
                                                      2 * unit)
        cands["train: dual-acc fused, save, eager epilogue"] = (
            lambda: kt.gate_up_geglu(x, wg, wu, True, True, config=kt.LARGE._replace(pair=False)), 2 * unit)
        cands["train: paired, save g,u,h"] = (lambda: kt.paired_gate_up_geglu(x, wg, wu, True, True), 2 * unit)
        cands["train: paired, save, eager epilogue"] = (
            lambda: kt.paired_gate_up_geglu(x, wg, wu, True, True, config=kt.PAIRED_SWEEP[-1]), 2 * unit)
        cands["down: mm(h, Wd.t())"] = (lambda: torch.mm(h_buf, wd.t()), unit)
        cands["MLP fwd: eager"] = (lambda: F.linear(F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu),
                                                    wd), 3 * unit)
        cands["MLP fwd: regular (cuBLAS + our GeGLU)"] = (lambda: torch.mm(regular(), wd.t()), 3 * unit)
        cands["MLP fwd: dual-acc fused + down"] = (
            lambda: torch.mm(kt.gate_up_geglu(x, wg, wu, True, False, config=fast)[0], wd.t()), 3 * unit)
        cands["MLP fwd: paired + down"] = (
            lambda: torch.mm(kt.paired_gate_up_geglu(x, wg, wu, True, False)[0], wd.t()), 3 * unit)

        # Correctness first: every GeGLU output against an fp64 reference of the same bf16 inputs, next to eager's.
        ref = F.gelu((x.double() @ wg.double().t()), approximate="tanh") * (x.double() @ wu.double().t())
        eager_h = F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu)

        def err(t):
            return ((t.double() - ref).norm() / ref.norm()).item()

        print(f"\n{M}x{D}x{H}: relative error of h against fp64: eager {err(eager_h):.3e}", flush=True)
        dual = kt.gate_up_geglu(x, wg, wu, True, False, config=fast)[0]
        print(f"  pair layout: gate first in memory: {kt.pair_layout(wg, wu).gate_first}")
        for cfg in kt.PAIRED_SWEEP:
            hp = kt.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg)[0]
            print(f"  paired {cfg.label():<46} {err(hp):.3e}  max |paired - dual| "
                  f"{(hp.float() - dual.float()).abs().max().item():.3e}  regs {kt.last_compiled.n_regs} "
                  f"spills {kt.last_compiled.n_spills}", flush=True)
        hp, gu = kt.paired_gate_up_geglu(x, wg, wu, True, True, config=kt.PAIRED_SWEEP[-1])
        hd, gud = kt.gate_up_geglu(x, wg, wu, True, True, config=kt.LARGE._replace(pair=False))
        print(f"  train outputs (eager epilogue): paired vs dual-acc: g,u equal {torch.equal(gu, gud)}, h equal "
              f"{torch.equal(hp, hd)}"
              f"; g vs cuBLAS max diff {(gu[:, :H].float() - F.linear(x, wg).float()).abs().max().item():.3e}")
        del ref, eager_h, dual, hp, gu, hd, gud

        times = {k: [] for k in cands}
        for r in range(args.rounds):
            for k, (fn, _) in cands.items():
                times[k].append(_median_us(fn, rep_ms=100))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
        cub = _median(times["cuBLAS g, u: 2 x mm"])
        print(f"\n{M}x{D}x{H} (GEMM unit 2*M*D*H = {unit / 1e12:.3f} TFLOP); % = of cuBLAS g, u time")
        for k, (fn, flops) in cands.items():
            t = _median(times[k])
            spread = (max(times[k]) - min(times[k])) / t * 100
            print(f"  {k:<58} {t:9.1f} us  {flops / t / 1e6:6.0f} TFLOP/s  {100 * cub / t:6.1f}% "
                  f" (rounds spread {spread:.1f}%)" if "MLP" not in k and "down" not in k else
                  f"  {k:<58} {t:9.1f} us  {flops / t / 1e6:6.0f} TFLOP/s  (rounds spread {spread:.1f}%)",
                  flush=True)
        del cands, x, wg, wu, wd, wstack, h_buf, g_buf, u_buf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
