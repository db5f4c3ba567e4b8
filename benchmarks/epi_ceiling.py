"""How much of the fused gate/up kernel's time is its GeGLU epilogue, and so how fast could the MLP forward be if the
epilogue were hidden under the next tile's main loop? Issue 7 asks for the forward at 8192x4096x14336 in <= 4100 us;
the paired kernel (`PAIRED_LARGE`, persistent 128x256 tile, epilogue between two tiles' main loops) runs at about
cuBLAS's rate. Here the same kernel is compiled a second time with its epilogue replaced by one add a output
(h = round(g + u): the accumulators, the split and the store stay), which is the most any design that overlaps the
GeGLU with the main loop (epilogue warps, ping-pong consumers) can gain with this tile and pipeline. And the
Gluon kernel that does so (`_gluon_fwd.py`: the GeGLU in its own warps while the MMA warps run the next tile).

Times, interleaved over rounds (do_bench medians, L2 flushed): cuBLAS's two gate/up GEMMs, cuBLAS's one GEMM over the
stacked [2H, D] weight, the paired kernel with its fast GeGLU epilogue and with the trivial one, cuBLAS's down_proj,
and the MLP forward as eager, as the paired kernel + down_proj and as the trivial-epilogue kernel + down_proj (the
ceiling). Prints medians and each round's ratio to cuBLAS's two GEMMs (drift between rounds cancels).

Dev tool (device); bf16, tanh.

    python benchmarks/epi_ceiling.py [--build-dir build] [--shapes 8192x4096x14336 8192x2304x9216] [--rounds 7]
                                     [--gluon-sweep]
"""
import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median, _median_us, cublas_tflops  # noqa: E402


@triton.jit
def _trivial_epilogue(acc_g, acc_u, T: tl.constexpr, TANH: tl.constexpr, SAVE: tl.constexpr, FAST_EPI: tl.constexpr,
                      K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """`_geglu_epilogue`'s signature with one add a output instead of the GeGLU (a wrong h: timing only)."""
    y = (acc_g + acc_u).to(T)
    return y, y, y


# --gluon-sweep: the Gluon kernel's variants, each against its defaults (epi-ceiling.txt runs 4 and 6; the epilogue
# warps' default was 152 registers until run 6)
GLUON_SWEEP = [("BLOCK_K 32, 6 stages", dict(block_k=32, stages=6)),
               ("BLOCK_K 32, 5 stages", dict(block_k=32, stages=5)), ("GROUP_M 8", dict(group_m=8)), ("GROUP_M 32", dict(group_m=32)), ("CHUNK 32", dict(chunk=32)),
               ("epilogue regs 152", dict(epi_regs=152))]


def _trivial_copy(kt):
    """A second instance of the kernel module whose kernels call `_trivial_epilogue` (compiled separately; the
    package's own module is untouched)."""
    spec = importlib.util.spec_from_file_location(kt.__name__ + "_trivial_epilogue", kt.__file__)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod._geglu_epilogue = _trivial_epilogue  # before any compile: Triton resolves the global when it compiles
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shapes", nargs="+", default=["8192x4096x14336", "8192x2304x9216"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gluon-sweep", action="store_true", help="also the Gluon kernel's tile variants (BLOCK_K 32 "
                    "with more stages, GROUP_M, CHUNK)")
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    triv = _trivial_copy(kt)
    gf = importlib.import_module(geglu.__name__ + "._gluon_fwd")  # the epilogue in its own warps (_gluon_fwd.py)
    peak = cublas_tflops(torch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; cuBLAS bf16 "
          f"8192^3: {peak:.0f} TFLOP/s", flush=True)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for shape in args.shapes:
        M, D, H = map(int, shape.split("x"))
        unit = 2 * M * D * H
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, D, generator=gen, **bf)
        wg, wu = (torch.randn(H, D, generator=gen, **bf) * D ** -0.5 for _ in range(2))
        wd = torch.randn(D, H, generator=gen, **bf) * H ** -0.5
        wstack = torch.cat([wg, wu])
        g_buf, u_buf, h_buf = (torch.empty(M, H, **bf) for _ in range(3))
        cfg = kt.PAIRED_LARGE

        # the trivial epilogue's h is g + u: check it (same kernel otherwise, so the timing is of the same GEMM)
        h_t = triv.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg)[0]
        ref = (F.linear(x, wg).float() + F.linear(x, wu).float())
        print(f"\n{M}x{D}x{H}: trivial-epilogue kernel: max |h - (g + u)| {(h_t.float() - ref).abs().max().item():.3e} "
              f"(|g + u| max {ref.abs().max().item():.2f}); regs {triv.last_compiled.n_regs} spills "
              f"{triv.last_compiled.n_spills}", flush=True)
        h_p = kt.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg)[0]
        print(f"  paired kernel: regs {kt.last_compiled.n_regs} spills {kt.last_compiled.n_spills}", flush=True)
        eager_h = F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu)
        ref64 = F.gelu(x.double() @ wg.double().t(), approximate="tanh") * (x.double() @ wu.double().t())
        h_w = gf.gate_up_geglu_ws(x, wg, wu, True)[0]
        rel = lambda t: ((t.double() - ref64).norm() / ref64.norm()).item()  # noqa: E731
        print(f"  h against fp64: eager {rel(eager_h):.3e}, paired {rel(h_p):.3e}, Gluon epilogue warps "
              f"{rel(h_w):.3e}; max |Gluon - paired| {(h_w.float() - h_p.float()).abs().max().item():.3e}",
              flush=True)
        del eager_h, ref64, h_w
        h_buf.copy_(h_p)  # down_proj's own row reads a real h (an uninitialised, zero buffer ran 20 % faster: the
        # tensor cores draw less power on zeros, epi-ceiling.txt run 1)
        h_sum = h_t  # the trivial kernel's h = g + u: down_proj on it shows how much h's values change its speed
        del ref, h_p

        cands = {
            "cuBLAS g, u: 2 x mm": (lambda: (torch.mm(x, wg.t(), out=g_buf), torch.mm(x, wu.t(), out=u_buf)), 2),
            "cuBLAS [g|u]: 1 mm over the stacked [2H, D]": (lambda: torch.mm(x, wstack.t()), 2),
            f"paired {cfg.label()} (GeGLU epilogue)": (
                lambda: kt.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg), 2),
            "paired, trivial epilogue (h = g + u)": (
                lambda: triv.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg), 2),
            "Gluon, GeGLU in epilogue warps": (lambda: gf.gate_up_geglu_ws(x, wg, wu, True), 2),
            **({f"Gluon, {k}": (lambda kw=kw: gf.gate_up_geglu_ws(x, wg, wu, True, **kw), 2)
                for k, kw in GLUON_SWEEP} if args.gluon_sweep else {}),
            "train: paired, save g,u,h (PAIRED_LARGE)": (
                lambda: kt.paired_gate_up_geglu(x, wg, wu, True, True, config=cfg), 2),
            "train: Gluon epilogue warps, save g,u,h": (lambda: gf.gate_up_geglu_ws(x, wg, wu, True, True), 2),
            "down: mm(h, Wd^T)": (lambda: torch.mm(h_buf, wd.t()), 1),
            "down: mm(h, Wd^T), h = g + u (the ceiling's h)": (lambda: torch.mm(h_sum, wd.t()), 1),
            "MLP fwd: eager": (lambda: F.linear(F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd), 3),
            "MLP fwd: paired + down": (
                lambda: torch.mm(kt.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg)[0], wd.t()), 3),
            "MLP fwd: Gluon epilogue warps + down": (
                lambda: torch.mm(gf.gate_up_geglu_ws(x, wg, wu, True)[0], wd.t()), 3),
            "MLP fwd ceiling: trivial epilogue + down": (
                lambda: torch.mm(triv.paired_gate_up_geglu(x, wg, wu, True, False, config=cfg)[0], wd.t()), 3),
        }
        times = {k: [] for k in cands}
        for r in range(args.rounds):
            for k, (fn, _) in cands.items():
                times[k].append(_median_us(fn, rep_ms=100))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
        base = times["cuBLAS g, u: 2 x mm"]
        eager = times["MLP fwd: eager"]
        print(f"\n{M}x{D}x{H} (GEMM unit {unit / 1e12:.3f} TFLOP): median us, TFLOP/s, and the per-round ratio "
              "median [min, max] of cuBLAS's two gate/up GEMMs' time to this one's, per GEMM unit (% of cuBLAS's "
              "rate) or of this one's to eager's forward (MLP rows)")
        for k, (fn, units) in cands.items():
            t = _median(times[k])
            if k.startswith("MLP"):
                r = sorted(a / b for a, b in zip(times[k], eager))
                rel = f"{_median(r):.3f} of eager [{r[0]:.3f}, {r[-1]:.3f}]"
            else:
                r = sorted(100 * b * units / 2 / a for a, b in zip(times[k], base))
                rel = f"{_median(r):6.1f} % of cuBLAS's gate/up rate [{r[0]:.1f}, {r[-1]:.1f}]"
            print(f"  {k:<48} {t:9.1f} us  {units * unit / t / 1e6:6.0f} TFLOP/s  {rel}", flush=True)
        paired = times[f"paired {cfg.label()} (GeGLU epilogue)"]
        for k in [k for k in cands if k.startswith("Gluon")]:
            r = sorted(a / b for a, b in zip(times[k], paired))
            print(f"  {k}: per-round time ratio to the paired kernel {_median(r):.3f} [{r[0]:.3f}, {r[-1]:.3f}]",
                  flush=True)
        # The ceiling row's down_proj reads h = g + u, whose values make the tensor cores draw different power than
        # a real h does; so also the sums of separately timed parts, each with a real h for down_proj.
        down = _median(times["down: mm(h, Wd^T)"])
        for k in (f"paired {cfg.label()} (GeGLU epilogue)", "paired, trivial epilogue (h = g + u)",
                  "Gluon, GeGLU in epilogue warps"):
            print(f"  sum: {k} + down on a real h: {_median(times[k]) + down:9.1f} us "
                  f"({(_median(times[k]) + down) / _median(eager):.3f} of eager's forward)", flush=True)
        del cands, x, wg, wu, wd, wstack, g_buf, u_buf, h_buf, h_sum, h_t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
