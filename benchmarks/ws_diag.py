"""Why is the warp-specialised Gluon backward (_gluon_bwd.py) slower than cuBLAS's dY @ Wd? Times, at the issue's
shapes, the plain GEMM d_h = dY @ Wd as cuBLAS and as plain Triton TMA GEMMs of several tiles (no epilogue beyond the
store: how fast this GEMM can be with a 128x128 tile at all, when every tile reads its operands from L2), the Gluon
kernel with and without its dGeGLU epilogue (its pipeline alone), and the Triton fused backward. ``--once`` launches
each kernel once after compiling (for ``ncu``).

Dev tool (device); bf16, tanh; do_bench medians with L2 flushed, interleaved rounds.

    python benchmarks/ws_diag.py [--build-dir build] [--shapes 8192x2304x9216 8192x4096x14336] [--rounds 5] [--once]
                                 [--only LABEL-REGEX]
"""
import argparse
import re
import importlib
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median, _median_us  # noqa: E402


@triton.jit
def _plain_gemm(a_desc, b_desc, c_desc, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, M, N):
    """c = a @ b, one program a tile, GROUP_M swizzle: the GEMM with nothing after it but the store."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([k * BLOCK_K, pid_n * BLOCK_N]), acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def plain_gemm(a, b, c, bm, bn, bk, warps, stages):
    M, K = a.shape
    N = b.shape[1]
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), blk)
             for t, blk in ((a, [bm, bk]), (b, [bk, bn]), (c, [bm, bn]))]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    return _plain_gemm[grid](*descs, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, M=M, N=N, num_warps=warps,
                             num_stages=stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shapes", nargs="+", default=["8192x2304x9216", "8192x4096x14336"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--once", action="store_true", help="launch each kernel once (after compiling), for ncu")
    ap.add_argument("--only", default="", help="time or launch only the kernels whose label matches this regular expression "
                    "(and cuBLAS, the baseline)")
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for shape in args.shapes:
        M, D, H = map(int, shape.split("x"))
        unit = 2 * M * D * H
        gen = torch.Generator(device="cuda").manual_seed(0)
        dy = torch.randn(M, D, generator=gen, **bf)
        wd = torch.randn(D, H, generator=gen, **bf) * H ** -0.5
        g0, u0 = (torch.randn(M, H, generator=gen, **bf) for _ in range(2))
        g, u, dh = g0.clone(), u0.clone(), torch.empty(M, H, **bf)
        cands = {
            "cuBLAS d_h = mm(dy, Wd)": lambda: torch.mm(dy, wd, out=dh),
            "Triton GEMM 128x128x64 w4 s4": lambda: plain_gemm(dy, wd, dh, 128, 128, 64, 4, 4),
            "Triton GEMM 128x128x64 w8 s4": lambda: plain_gemm(dy, wd, dh, 128, 128, 64, 8, 4),
            "Triton GEMM 128x256x64 w8 s3": lambda: plain_gemm(dy, wd, dh, 128, 256, 64, 8, 3),
            "Gluon ws, no epilogue, 4 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, stages=4, epi_mode=0),
            "Gluon ws, full, unrolled chunks (before the loop)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True,
                                                                                           loop_chunks=False),
            "Gluon ws, full (default: CHUNK 32 loop, 4 stages)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True),
            "Gluon ws, loads/stores only": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, epi_mode=2),
            "Gluon ws, math only (no loads)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, epi_mode=3),
            "Gluon ws, full, CHUNK 16": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, chunk=16),
            "Gluon ws, full, GROUP_M 16": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, group_m=16),
            "Gluon ws, full, CHUNK 16, 8-warp consumers": lambda: ws.down_dgeglu_ws(
                dy, wd, g, u, True, chunk=16, consumer_warps=8, consumer_regs=120),
            "Gluon ws, fast dGeGLU": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, fast=True),
            "Gluon ws, fast dGeGLU, 5 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, fast=True, stages=5),
            "Gluon ws, fast dGeGLU, BLOCK_K 128, 2 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, fast=True,
                                                                                      block_k=128, stages=2),
            "Gluon ws, full, 5 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, stages=5),
            "Gluon ws, full, BLOCK_K 128, 2 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, block_k=128,
                                                                                stages=2),
            "Gluon ws, no epilogue, BLOCK_K 128, 2 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, block_k=128,
                                                                                       stages=2, epi_mode=0),
            "Gluon ws, deriv (two products)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True),
            "Gluon ws, deriv, 5 stages": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True, stages=5),
            "Gluon ws, deriv, CHUNK 64": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True, chunk=64),
            "Gluon ws, deriv, CHUNK 16": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True, chunk=16),
            "Gluon ws, deriv, GROUP_M 16": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True, group_m=16),
            "Gluon ws, deriv, unrolled chunks": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, deriv=True,
                                                                          loop_chunks=False),
            f"Triton fused backward {kt.BWD_LARGE.label()}": lambda: kt.down_dgeglu_into(dy, wd, g, u, True, False),
        }
        cands = {k: fn for k, fn in cands.items() if re.search(args.only, k) or k.startswith("cuBLAS")}
        for k, fn in list(cands.items()):  # compile; drop what does not (e.g. out of shared memory)
            g.copy_(g0), u.copy_(u0)
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                print(f"{shape}: {k}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                del cands[k]
        torch.cuda.synchronize()
        # the real epilogue (any CHUNK) gives the Triton kernel's bits
        g.copy_(g0), u.copy_(u0)
        kt.down_dgeglu_into(dy, wd, g, u, True, False)
        ref = g.clone(), u.clone()
        for chunk, loop, cw in () if args.once else ((16, False, 4), (32, False, 4), (64, False, 4),
                                                     (32, True, 4), (16, True, 4), (16, True, 8)):
            g.copy_(g0), u.copy_(u0)
            ws.down_dgeglu_ws(dy, wd, g, u, True, chunk=chunk, loop_chunks=loop, consumer_warps=cw,
                              consumer_regs=232 if cw == 4 else 120)
            print(f"{shape}: Gluon ws CHUNK {chunk} loop_chunks {loop} consumer warps {cw} equals the "
                  f"Triton fused backward: {torch.equal(g, ref[0]) and torch.equal(u, ref[1])}", flush=True)
        del ref
        if args.once:
            for k, fn in cands.items():
                g.copy_(g0), u.copy_(u0)
                torch.cuda.nvtx.range_push(k)
                fn()
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"{shape}: each kernel launched once", flush=True)
            continue
        times = {k: [] for k in cands}
        for _ in range(args.rounds):
            for k, fn in cands.items():
                g.copy_(g0), u.copy_(u0)
                times[k].append(_median_us(fn, rep_ms=100))
        base = _median(times["cuBLAS d_h = mm(dy, Wd)"])
        print(f"\n{M}x{D}x{H}: d_h = dY @ Wd [{M}, {H}], K = {D}; % = of cuBLAS's time", flush=True)
        for k, ts in times.items():
            t = _median(ts)
            print(f"  {k:<48} {t:8.1f} us  {unit / t / 1e6:5.0f} TFLOP/s  {100 * base / t:6.1f} %  "
                  f"(spread {(max(ts) - min(ts)) / t * 100:.1f} %)", flush=True)


if __name__ == "__main__":
    main()
