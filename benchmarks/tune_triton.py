"""Sweep the Triton tile shapes (BLOCK_M x BLOCK_N, warps) of the pointwise kernels on the GPU, to choose the
heuristic in torch-ext/geglu/_triton.py::_tiles. Dev tool: prints median µs and % of the copy floor.

    python benchmarks/tune_triton.py [--build-dir build]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median_us, copy_floor_tbs, per_call_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    tr = importlib.import_module(geglu.__name__ + "._triton")
    floor = copy_floor_tbs(torch)
    print(f"copy floor {floor:.3f} TB/s")
    consts = dict(K_BETA_TANH=tr.K_BETA_TANH, K_KAPPA=tr.K_KAPPA, K_ALPHA=tr.K_ALPHA)
    bconsts = dict(consts, K_BETA_ERF=tr.K_BETA_ERF, K_3KAPPA=tr.K_3KAPPA)
    for (M, N) in [(8192, 14336), (4096, 9216), (16384, 24576), (8192, 3072)]:
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
