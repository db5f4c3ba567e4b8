"""Experimental (issue 7): the fused gate/up GEMM with the GeGLU in its epilogue as a warp-specialised Gluon kernel for
Hopper, whose epilogue runs in its own warps, under the next tile's main loop.

The paired Triton kernel (`_fused_mlp_triton._paired_gate_up_geglu_kernel`) computes a 128x256 tile ([gate | up]
for 128 columns of h) and then its GeGLU epilogue, while the tensor cores wait. On the H200 the same kernel with a
one-add epilogue is 1.3-3.5 % faster (`benchmarks/epi_ceiling.py`, epi-ceiling.txt run 2): the most hiding the
epilogue can gain with this tile. Here three partitions share each SM:

- a producer warp issues the TMA loads of x's [128, 64] tile and of both weights' [128, 64] tiles (read in place,
  two descriptors: any two weights of one shape) into a ring of shared-memory stages;
- the default partition, two warpgroups, runs the wgmma main loop over the 128x256 tile (64 rows each, one
  m64n256k16 per k16: both weights' tiles are one [256, 64] operand), rounds the accumulators to the storage dtype
  (eager's g and u), stages them in shared memory and goes on with its next tile at once;
- an epilogue warpgroup takes the staged g, u, computes h = gelu(g) * u in fp32 with one rounding (the fast
  epilogue's formulation, from the rounded g, u: one rounding fewer than eager's, no less accurate) and writes h
  (and with ``save`` g, u) to global memory, then frees the staging buffer.

Measured on the H200 (`benchmarks/epi_ceiling.py --gluon-sweep --rounds 11`, epi-ceiling.txt run 6): per-round time
0.989 / 0.982 of the paired kernel's at 8192x4096x14336 / 8192x2304x9216 (the one-add ceiling: ~0.985 / ~0.965), h's
error against fp64 3.0e-3 (eager 3.5e-3; the paired kernel, which applies the GeGLU to the fp32 accumulators,
1.7e-3); with ``save`` no faster than the paired kernel. Not used by default (a 1-2 % gain within the rounds' spread,
and the paired kernel is more accurate). Needs Triton's Gluon (triton >= 3.5) and sm_90; imported lazily.
"""

from typing import Optional, Tuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._fused_mlp_triton import _fast_exp2, _fast_rcp, _tile_coords
from ._triton import K_ALPHA, K_BETA_TANH, K_KAPPA, _gelu


# 8 + 2 + 1 warps take three warpgroups: 168 registers a thread fill the register file (the MMA warps' 128
# accumulator registers need ~154); setmaxnreg may then move some from the other warpgroup to the MMA warpgroups.
MAXNREG = 168


@gluon.jit
def _producer(x_desc, wg_desc, wu_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    c = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + 2 * wg_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            b = b_bufs.index(s)
            tma.async_copy_global_to_shared(wg_desc, [off_n, kk * BLOCK_K], ready.index(s), b.slice(0, BLOCK_N))
            tma.async_copy_global_to_shared(wu_desc, [off_n, kk * BLOCK_K], ready.index(s),
                                            b.slice(BLOCK_N, BLOCK_N))
            c += 1


@gluon.jit
def _mma(a_bufs, b_bufs, ready, empty, stage, epi_ready, epi_free, M, N, K, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    W: gl.constexpr = gl.num_warps()
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, 2 * BLOCK_N, 16])
    T: gl.constexpr = a_bufs.dtype
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    c = 0
    t = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, mma_layout)
        for kk in range(k_tiles):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            # the previous stage's wgmma has finished: give that stage back to the producer
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
            c += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        # hand [g | u] (rounded as eager's GEMMs store them) to the epilogue warps once they have freed the buffer
        mbarrier.wait(epi_free, (t & 1) ^ 1)
        stage._reinterpret(T, [BLOCK_M, 2 * BLOCK_N], stage.layout).store(acc.to(T))
        mbarrier.arrive(epi_ready)
        t += 1


@gluon.jit
def _epilogue(stage, epi_ready, epi_free, h_ptr, g_ptr, u_ptr, M, N, stride_h, stride_g, stride_u,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, CHUNK: gl.constexpr,
              TANH: gl.constexpr, SAVE: gl.constexpr, EVEN: gl.constexpr, EPI_WARPS: gl.constexpr,
              K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [EPI_WARPS, 1], [1, 0])
    T: gl.constexpr = stage.dtype
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    t = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        mbarrier.wait(epi_ready, t & 1)
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        for i in range(BLOCK_M // CHUNK):
            rows = pid_m * BLOCK_M + i * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            chunk = stage.index(i)
            gv = chunk.slice(0, BLOCK_N, dim=1).load(layout)
            uv = chunk.slice(BLOCK_N, BLOCK_N, dim=1).load(layout)
            x = gv.to(gl.float32)
            if TANH:  # gelu(x) = x * sigmoid(2 * inner(x)), hardware exp2 and reciprocal approximations
                z = (-2.0 * K_BETA_TANH * 1.4426950408889634) * x * gl.fma(x * x, K_KAPPA, 1.0)
                gelu = x * _fast_rcp(1.0 + _fast_exp2(z))
            else:
                gelu = _gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
            h = (gelu * uv.to(gl.float32)).to(T)
            r64 = gl.expand_dims(rows.to(gl.int64), 1)
            c2 = gl.expand_dims(cols, 0)
            if EVEN:
                gl.store(h_ptr + r64 * stride_h + c2, h)
                if SAVE:
                    gl.store(g_ptr + r64 * stride_g + c2, gv)
                    gl.store(u_ptr + r64 * stride_u + c2, uv)
            else:
                mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
                gl.store(h_ptr + r64 * stride_h + c2, h, mask=mask)
                if SAVE:
                    gl.store(g_ptr + r64 * stride_g + c2, gv, mask=mask)
                    gl.store(u_ptr + r64 * stride_u + c2, uv, mask=mask)
        mbarrier.arrive(epi_free)  # the staged tile is in registers and written: the MMA warps may reuse it
        t += 1


@gluon.jit
def _gate_up_geglu_ws_kernel(x_desc, wg_desc, wu_desc, h_ptr, g_ptr, u_ptr, M, N, K, stride_h, stride_g, stride_u,
                             TANH: gl.constexpr, SAVE: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             CHUNK: gl.constexpr, EVEN: gl.constexpr, EPI_WARPS: gl.constexpr,
                             EPI_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = wg_desc.block_type.shape[0]
    T: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(T, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_K], T)
    b_bufs = gl.allocate_shared_memory(T, [STAGES, 2 * BLOCK_N, BLOCK_K], b_layout)
    # [g | u] of one tile as BLOCK_M / CHUNK row chunks (the epilogue walks them in a runtime loop): 16-byte vectors
    # XOR-swizzled by row within 8 rows (the epilogue's 16-byte row loads without bank conflicts; the pattern repeats
    # every 8 rows, so the MMA warps store the whole tile through a [BLOCK_M, 2 * BLOCK_N] view)
    stage = gl.allocate_shared_memory(T, [BLOCK_M // CHUNK, CHUNK, 2 * BLOCK_N],
                                      gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=1)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, ready, empty, stage, epi_ready, epi_free, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                GROUP_M)),
        (_epilogue, (stage, epi_ready, epi_free, h_ptr, g_ptr, u_ptr, M, N, stride_h, stride_g, stride_u, BLOCK_M,
                     BLOCK_N, GROUP_M, CHUNK, TANH, SAVE, EVEN, EPI_WARPS, K_BETA_TANH, K_KAPPA, K_ALPHA)),
        (_producer, (x_desc, wg_desc, wu_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                     STAGES, GROUP_M)),
    ], [EPI_WARPS, 1], [EPI_REGS, PRODUCER_REGS])


def descriptors(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, block_m: int, block_n: int,
                block_k: int):
    """TMA descriptors: x tiles [block_m, block_k] and each weight's [block_n, block_k] (K-major, wgmma's layout)."""
    gt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gt)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gt)
    return (TensorDescriptor.from_tensor(x, [block_m, block_k], a_layout),
            TensorDescriptor.from_tensor(w_gate, [block_n, block_k], b_layout),
            TensorDescriptor.from_tensor(w_up, [block_n, block_k], b_layout))


def gate_up_geglu_ws(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, tanh: bool, save: bool = False,
                     out: Optional[torch.Tensor] = None, block_m: int = 128, block_n: int = 128, block_k: int = 64,
                     stages: int = 3, group_m: int = 16, chunk: int = 16, epi_warps: int = 2, epi_regs: int = 120,
                     producer_regs: int = 24, num_sms: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h = gelu(x @ w_gate^T) * (x @ w_up^T) [M, H] (and with ``save`` gu = [g | u] [M, 2H], the pre-activations
    rounded to the storage dtype). x [M, D], the weights [H, D]: fp16/bf16 on one sm_90 device, unit last-dim
    strides, 16-byte aligned rows (TMA). ``epi_regs``: the epilogue warps' register budget (setmaxnreg; 120 was
    1-2 % faster than 152 on the H200, epi-ceiling.txt runs 4 and 6, so the MMA warps get more)."""
    M, K = x.shape
    N = w_gate.shape[0]
    h = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    gu = torch.empty((M, 2 * N), dtype=x.dtype, device=x.device) if save else None
    if M == 0 or N == 0:
        return h, gu
    g_view, u_view = (gu[:, :N], gu[:, N:]) if save else (h, h)
    x_d, wg_d, wu_d = descriptors(x, w_gate, w_up, block_m, block_n, block_k)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
    _gate_up_geglu_ws_kernel[(min(sms, tiles), )](
        x_d, wg_d, wu_d, h, g_view, u_view, M, N, K, h.stride(0), g_view.stride(0), u_view.stride(0), TANH=tanh,
        SAVE=save, STAGES=stages, GROUP_M=group_m, CHUNK=chunk, EVEN=M % block_m == 0 and N % block_n == 0,
        EPI_WARPS=epi_warps, EPI_REGS=epi_regs, PRODUCER_REGS=producer_regs, K_BETA_TANH=K_BETA_TANH, K_KAPPA=K_KAPPA,
        K_ALPHA=K_ALPHA, num_warps=8, maxnreg=MAXNREG)
    return h, gu
