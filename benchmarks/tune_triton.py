"""Sweep the Triton tile shapes of the pointwise kernels on the GPU, to choose the heuristics in
torch-ext/geglu/_triton.py (`_tiles` for the 2-D row-strided kernels, `FLAT_TILES` for the flat kernels that
contiguous tensors take), plus experimental flat variants (streaming cache hints, a persistent grid-stride loop).
Dev tool: prints median µs and % of the copy floor.

    python benchmarks/tune_triton.py [--build-dir build]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median_us, copy_floor_tbs, per_call_us  # noqa: E402


def _experiments(tr):
    """Flat forward variants not in the package (yet): cache hints, persistent loop."""
    _gelu, _round = tr._gelu, tr._round

    @triton.jit
    def fwd_stream(gate_ptr, up_ptr, out_ptr, n, TANH: tl.constexpr, BLOCK: tl.constexpr,
                   K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(gate_ptr + offs, eviction_policy="evict_first")
        u = tl.load(up_ptr + offs, eviction_policy="evict_first")
        T = out_ptr.dtype.element_ty
        h = _round(_gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
        tl.store(out_ptr + offs, _round(h * u.to(tl.float32), T), cache_modifier=".cs")

    @triton.jit
    def fwd_persistent(gate_ptr, up_ptr, out_ptr, n, TANH: tl.constexpr, BLOCK: tl.constexpr,
                       K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
        nblocks = n // BLOCK
        T = out_ptr.dtype.element_ty
        for b in tl.range(tl.program_id(0), nblocks, tl.num_programs(0), num_stages=2):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(gate_ptr + offs)
            u = tl.load(up_ptr + offs)
            h = _round(_gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
            tl.store(out_ptr + offs, _round(h * u.to(tl.float32), T))

    return fwd_stream, fwd_persistent


def flat_sweep(tr, floor, consts, bconsts, experiments=False):
    """The flat kernels' (BLOCK, warps) and the experimental variants, bf16, at the benchmark shapes."""
    fwd_stream, fwd_persistent = _experiments(tr)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (M, N) in [(8192, 14336), (4096, 9216), (16384, 24576), (8192, 3072)]:
        n = M * N
        g = (torch.randn(M, N, device="cuda") * 3).bfloat16()
        u = torch.randn(M, N, device="cuda").bfloat16()
        dy = torch.randn(M, N, device="cuda").bfloat16()
        o, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        E = n * 2
        for tanh in (True, False):
            res = []
            for block, w in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (1024, 2), (512, 2)]:
                grid = (triton.cdiv(n, block),)
                even = n % block == 0
                f = lambda: tr._geglu_fwd_flat_kernel[grid](g, u, o, n, TANH=tanh, BLOCK=block, EVEN=even, WIDE=False,
                                                            num_warps=w, enable_fp_fusion=False, **consts)
                b = lambda: tr._geglu_bwd_flat_kernel[grid](dy, g, u, dg, du, n, TANH=tanh, BLOCK=block, EVEN=even,
                                                            WIDE=False, num_warps=w, enable_fp_fusion=False, **bconsts)
                tf, tb = _median_us(f, 100), _median_us(b, 100)
                res.append((f"flat {block}", w, tf, 100 * 3 * E / (tf * 1e-6) / 1e12 / floor, tb,
                            100 * 5 * E / (tb * 1e-6) / 1e12 / floor))
            for block, w in [(2048, 4), (1024, 4), (4096, 8)] if experiments else []:
                if n % block:
                    continue
                grid = (n // block,)
                f = lambda: fwd_stream[grid](g, u, o, n, TANH=tanh, BLOCK=block, num_warps=w,
                                             enable_fp_fusion=False, **consts)
                tf = _median_us(f, 100)
                res.append((f"stream {block}", w, tf, 100 * 3 * E / (tf * 1e-6) / 1e12 / floor, 0, 0))
                for per_sm in (4, 8):
                    grid = (min(per_sm * sms, n // block),)
                    f = lambda: fwd_persistent[grid](g, u, o, n, TANH=tanh, BLOCK=block, num_warps=w,
                                                     enable_fp_fusion=False, **consts)
                    tf = _median_us(f, 100)
                    res.append((f"persist{per_sm} {block}", w, tf, 100 * 3 * E / (tf * 1e-6) / 1e12 / floor, 0, 0))
            ref = torch.nn.functional.gelu(g, approximate="tanh" if tanh else "none") * u
            tr._geglu_fwd_flat_kernel[(triton.cdiv(n, 2048),)](g, u, o, n, TANH=tanh, BLOCK=2048, EVEN=n % 2048 == 0,
                                                               WIDE=False, num_warps=4, enable_fp_fusion=False,
                                                               **consts)
            exact = torch.equal(o, ref)
            print(f"FLAT {M}x{N} {'tanh' if tanh else 'erf'} (flat 2048 bit-exact: {exact})")
            for r in sorted(res, key=lambda r: r[2]):
                print(f"   {r[0]:>16} w{r[1]}: fwd {r[2]:8.1f}us {r[3]:5.1f}%   bwd {r[4]:8.1f}us {r[5]:5.1f}%")
        del g, u, dy, o, dg, du
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--flat-only", action="store_true", help="only the flat kernels and the decode rows")
    ap.add_argument("--experiments", action="store_true", help="also the experimental flat variants")
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    tr = importlib.import_module(geglu.__name__ + "._triton")
    floor = copy_floor_tbs(torch)
    print(f"copy floor {floor:.3f} TB/s")
    consts = dict(K_BETA_TANH=tr.K_BETA_TANH, K_KAPPA=tr.K_KAPPA, K_ALPHA=tr.K_ALPHA)
    bconsts = dict(consts, K_BETA_ERF=tr.K_BETA_ERF, K_3KAPPA=tr.K_3KAPPA)
    flat_sweep(tr, floor, consts, bconsts, args.experiments)
    for (M, N) in [] if args.flat_only else [(8192, 14336), (4096, 9216), (16384, 24576), (8192, 3072)]:
        g = (torch.randn(M, N, device="cuda") * 3).bfloat16()
        u = torch.randn(M, N, device="cuda").bfloat16()
        dy = torch.randn(M, N, device="cuda").bfloat16()
        o, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        E = M * N * 2
        for tanh in (True, False):
            res = []
            for bm, bn, w in [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (4, 512, 4), (8, 512, 4),
                              (1, 2048, 8), (2, 2048, 8), (4, 2048, 8), (16, 256, 4), (8, 256, 4)]:
                grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
                f = lambda: tr._geglu_fwd_kernel[grid](g, u, o, M, N, N, N, N, TANH=tanh, BLOCK_M=bm, BLOCK_N=bn,
                                                       num_warps=w, enable_fp_fusion=False, **consts)
                b = lambda: tr._geglu_bwd_kernel[grid](dy, g, u, dg, du, M, N, N, N, N, N, N, TANH=tanh,
                                                       BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                                                       enable_fp_fusion=False, **bconsts)
                tf, tb = _median_us(f, 100), _median_us(b, 100)
                res.append((bm, bn, w, tf, 100 * 3 * E / (tf * 1e-6) / 1e12 / floor, tb,
                            100 * 5 * E / (tb * 1e-6) / 1e12 / floor))
            cur = tr._tiles(M, N, 2, g.device, 3), tr._tiles(M, N, 2, g.device, 5)
            print(f"{M}x{N} {'tanh' if tanh else 'erf'} (current fwd {cur[0]}, bwd {cur[1]})")
            for r in sorted(res, key=lambda r: r[3]):
                print(f"   {r[0]:>3}x{r[1]:<5} w{r[2]}: fwd {r[3]:8.1f}us {r[4]:5.1f}%   bwd {r[5]:8.1f}us {r[6]:5.1f}%")
        del g, u, dy, o, dg, du
        torch.cuda.empty_cache()
    # decode: per-call time through the public function (launch and Python overhead included)
    for impl in ["triton"] + (["cuda"] if geglu.HAS_CUDA_LIB else []):
        geglu.set_backend(impl)
        g = torch.randn(1, 14336, device="cuda").bfloat16()
        out = torch.empty_like(g)
        t = per_call_us(lambda: geglu.geglu(g, g, "tanh", out=out))
        t2 = per_call_us(lambda: geglu.geglu(g, g, "tanh"))
        print(f"decode 1x14336 {impl}: out= {t:.2f}us, alloc {t2:.2f}us")
    geglu.set_backend("auto")
    g = torch.randn(1, 14336, device="cuda").bfloat16()
    print(f"decode 1x14336 eager F.gelu(g)*u: {per_call_us(lambda: torch.nn.functional.gelu(g, approximate='tanh') * g):.2f}us")


if __name__ == "__main__":
    main()
