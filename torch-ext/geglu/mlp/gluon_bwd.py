"""The training backward step of the ``fused_training`` setting: d_h = dY @ Wd with the dGeGLU (or, with ``deriv``,
its two products) in the epilogue, as a warp-specialised Gluon kernel for sm_90 (wgmma), so that the epilogue
overlaps the next tile's main loop instead of idling the tensor cores.

One producer warp issues every TMA load of the program's tiles into a ring of shared-memory stages, and two consumer
warpgroups take alternate tiles ("ping-pong"): while one runs its tile's epilogue, the other's wgmma main loop keeps
the tensor cores busy. The epilogue stages d_h (rounded to the storage dtype, as eager's GEMM stores it) in shared
memory and walks it in row chunks with coalesced loads and stores, so the accumulator's registers are free for it.
Without ``deriv`` the epilogue is our pointwise backward (eager's rounding; the tests check it bit for bit against
the pointwise kernel); with it, g and u hold the forward's gelu(g) and u * gelu'(g) and the epilogue is
d_gate = d_h * (u * gelu'(g)), d_up = d_h * gelu(g), each rounded once.

Needs Triton's Gluon (triton >= 3.5) and sm_90; imported lazily (``mlp.inference._gluon_backward``).
"""

from typing import Optional, Tuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..runtime.gelu_math import K_3KAPPA, K_ALPHA, K_BETA_ERF, K_BETA_TANH, K_KAPPA, gelu, gelu_grad, round_to
from .tiles import _fast_exp2, _fast_rcp, _tile_coords

# Ring stages when the caller does not say: the deriv epilogue (two products, about half the registers of the
# dGeGLU) has room for a fifth: 5 stages of 32 KiB and the 64 KiB staging buffer fill 224 of the 227 KiB of shared
# memory.
DEFAULT_STAGES = 4
DERIV_STAGES = 5


@gluon.jit
def _producer(dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, M, N, K,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
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
            mbarrier.expect(ready.index(s), dy_desc.block_type.nbytes + wd_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dy_desc, [off_m, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(wd_desc, [kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, order, dh_bufs, g_ptr, u_ptr, M, N, K, stride_g, stride_u, out_delta,
              WG: gl.constexpr, TANH: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CHUNK: gl.constexpr,
              K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr,
              K_BETA_ERF: gl.constexpr, K_3KAPPA: gl.constexpr, EPI_MODE: gl.constexpr,
              LOOP_CHUNKS: gl.constexpr, FAST: gl.constexpr, EVEN: gl.constexpr):
    CW: gl.constexpr = gl.num_warps()  # 4: one warpgroup; 8: two, each taking 64 rows of the tile
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    epi_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CW, 1], [1, 0])
    T: gl.constexpr = a_bufs.dtype
    NCH: gl.constexpr = BLOCK_M // CHUNK
    if LOOP_CHUNKS:  # dh_bufs: [2 * NCH, CHUNK, BLOCK_N]; this warpgroup's [BLOCK_M, BLOCK_N] view (same swizzle:
        # the XOR pattern repeats every 8 rows and CHUNK is a multiple of 8)
        dh_smem = dh_bufs._reinterpret(T, [2 * BLOCK_M, BLOCK_N], dh_bufs.layout).slice(WG * BLOCK_M, BLOCK_M, dim=0)
    else:
        dh_smem = dh_bufs.index(WG)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nprog = gl.num_programs(0)
    c = WG * k_tiles  # this warpgroup's place in the producer's sequence of stages
    j = 0  # this warpgroup's tile count; the program's tile sequence index is t = 2 j + WG
    for tile_id in range(gl.program_id(0) + WG * nprog, num_pid_m * num_pid_n, 2 * nprog):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        # Main loops in tile order: wait until the other warpgroup has taken every stage of the tile before this
        # one. A stage's `ready` barrier is then at most one phase behind this wait, which its parity needs (a
        # warpgroup starting tiles ahead would see an older phase of the same parity and read a stale stage).
        prev = j - 1 + WG  # the other warpgroup's count at tile t - 1
        mbarrier.wait(order.index(1 - WG), prev & 1, pred=(2 * j + WG) > 0)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for kk in range(k_tiles):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            # the wgmma of the previous stage has finished: give that stage back to the producer
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
            c += 1
        mbarrier.arrive(order.index(WG))  # every stage of this tile taken: the other warpgroup's tile may start
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        c += k_tiles  # the other warpgroup's tile
        j += 1
        # Epilogue: d_h as eager's GEMM stores it, staged in shared memory, then walked in row chunks.
        dh_smem.store(acc.to(T))
        # EPI_MODE: 1 the dGeGLU; 2 one product each (d_gate = d_h * u, d_up = d_h * g: the real epilogue when g, u
        # hold the forward's derivative factors, `deriv`); diagnostics: 0 none, 3 the math without the g, u loads
        if EPI_MODE != 0:
            if LOOP_CHUNKS:  # one copy of the chunk's code (a runtime loop): less for the instruction cache
                for i in range(NCH):
                    _epi_chunk(dh_bufs.index(WG * NCH + i).load(epi_layout).to(gl.float32), pid_m * BLOCK_M + i * CHUNK,
                               pid_n * BLOCK_N, g_ptr, u_ptr, M, N, stride_g, stride_u, out_delta, T, TANH, CHUNK,
                               BLOCK_N,
                               epi_layout, EPI_MODE, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA, FAST, EVEN)
            else:
                for r in gl.static_range(0, BLOCK_M, CHUNK):
                    _epi_chunk(dh_smem.slice(r, CHUNK, dim=0).load(epi_layout).to(gl.float32), pid_m * BLOCK_M + r,
                               pid_n * BLOCK_N, g_ptr, u_ptr, M, N, stride_g, stride_u, out_delta, T, TANH, CHUNK,
                               BLOCK_N,
                               epi_layout, EPI_MODE, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA, FAST, EVEN)


@gluon.jit
def _epi_ptrs(row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, CHUNK: gl.constexpr, BLOCK_N: gl.constexpr,
              epi_layout: gl.constexpr):
    rows = row0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, epi_layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, epi_layout))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    c2 = gl.expand_dims(cols, 0)
    return g_ptr + r64 * stride_g + c2, u_ptr + r64 * stride_u + c2, mask


@gluon.jit
def _epi_load(row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, CHUNK: gl.constexpr, BLOCK_N: gl.constexpr,
              epi_layout: gl.constexpr, EVEN: gl.constexpr):
    """g, u of one [CHUNK, BLOCK_N] chunk in the storage dtype (EVEN: the tiles divide M and N, no masks)."""
    g_ptrs, u_ptrs, mask = _epi_ptrs(row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, CHUNK, BLOCK_N, epi_layout)
    if EVEN:
        return gl.load(g_ptrs), gl.load(u_ptrs)
    return gl.load(g_ptrs, mask=mask, other=0.0), gl.load(u_ptrs, mask=mask, other=0.0)


@gluon.jit
def _epi_math_store(dh, gv, uv, row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, out_delta, T: gl.constexpr,
                    TANH: gl.constexpr, CHUNK: gl.constexpr, BLOCK_N: gl.constexpr, epi_layout: gl.constexpr,
                    EPI_MODE: gl.constexpr, K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr,
                    K_BETA_ERF: gl.constexpr, K_3KAPPA: gl.constexpr, FAST: gl.constexpr, EVEN: gl.constexpr):
    """d_g, d_u of one chunk from d_h (fp32 of the rounded d_h) and its loaded g, u, written over g, u (or
    ``out_delta`` elements past them: another buffer of their layout). FAST (tanh
    GELU only): fp32 math with the hardware exp2 and reciprocal approximations and one rounding per output, instead
    of eager's operation order and roundings (about half the instructions; not eager's bits, no less accurate)."""
    g_ptrs, u_ptrs, mask = _epi_ptrs(row0, col0, g_ptr + out_delta, u_ptr + out_delta, M, N, stride_g, stride_u,
                                     CHUNK, BLOCK_N, epi_layout)
    x = gv.to(gl.float32)
    uf = uv.to(gl.float32)
    if EPI_MODE == 2:
        d_up = round_to(dh * x, T)
        d_gate = round_to(dh * uf, T)
    elif FAST and TANH:
        # s = sigmoid(2 * inner) = (1 + tanh(inner)) / 2: gelu = x * s and
        # gelu' = s + x * (1 - tanh^2) * inner' / 2 = s + 2 * kBeta * x * s * (1 - s) * (1 + 3 * kKappa * x^2)
        x2 = x * x
        z = (-2.0 * K_BETA_TANH * 1.4426950408889634) * x * gl.fma(x2, K_KAPPA, 1.0)  # -2 * inner * log2(e)
        s = _fast_rcp(1.0 + _fast_exp2(z))
        d_up = round_to(dh * (x * s), T)
        w = gl.fma(-s, s, s)  # s * (1 - s)
        gp = gl.fma((2.0 * K_BETA_TANH) * x * w, gl.fma(x2, K_3KAPPA, 1.0), s)
        d_gate = round_to(dh * uf * gp, T)
    else:
        h = round_to(gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(gl.float32)
        d_up = round_to(dh * h, T)
        d_hg = round_to(dh * uf, T).to(gl.float32)
        d_gate = round_to(d_hg * gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA), T)
    if EVEN:
        gl.store(g_ptrs, d_gate)
        gl.store(u_ptrs, d_up)
    else:
        gl.store(g_ptrs, d_gate, mask=mask)
        gl.store(u_ptrs, d_up, mask=mask)


@gluon.jit
def _epi_chunk(dh, row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, out_delta, T: gl.constexpr,
               TANH: gl.constexpr,
               CHUNK: gl.constexpr, BLOCK_N: gl.constexpr, epi_layout: gl.constexpr, EPI_MODE: gl.constexpr,
               K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr,
               K_BETA_ERF: gl.constexpr, K_3KAPPA: gl.constexpr, FAST: gl.constexpr, EVEN: gl.constexpr):
    """d_g, d_u of one [CHUNK, BLOCK_N] chunk of d_h (fp32 of the rounded d_h), written over g, u (or
    ``out_delta`` elements past them)."""
    if EPI_MODE == 3:  # the math without the loads
        gv = dh
        uv = dh * 0.5
    else:
        gv, uv = _epi_load(row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, CHUNK, BLOCK_N, epi_layout, EVEN)
    _epi_math_store(dh, gv, uv, row0, col0, g_ptr, u_ptr, M, N, stride_g, stride_u, out_delta, T, TANH, CHUNK,
                    BLOCK_N,
                    epi_layout, EPI_MODE, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA, FAST, EVEN)


@gluon.jit
def _down_dgeglu_ws_kernel(dy_desc, wd_desc, g_ptr, u_ptr, M, N, K, stride_g, stride_u, out_delta,
                           TANH: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CHUNK: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           K_BETA_TANH: gl.constexpr, K_KAPPA: gl.constexpr, K_ALPHA: gl.constexpr,
                           K_BETA_ERF: gl.constexpr, K_3KAPPA: gl.constexpr, EPI_MODE: gl.constexpr = 1,
                           LOOP_CHUNKS: gl.constexpr = True, FAST: gl.constexpr = False,
                           EVEN: gl.constexpr = False):
    BLOCK_M: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd_desc.block_type.shape[1]
    T: gl.constexpr = dy_desc.dtype
    a_bufs = gl.allocate_shared_memory(T, [STAGES, BLOCK_M, BLOCK_K], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(T, [STAGES, BLOCK_K, BLOCK_N], wd_desc.layout)
    if LOOP_CHUNKS:  # 16-byte vectors XOR-swizzled by row within 8 rows: stmatrix and the epilogue's
        # 16-byte row loads without bank conflicts
        dh_bufs = gl.allocate_shared_memory(T, [2 * (BLOCK_M // CHUNK), CHUNK, BLOCK_N],
                                            gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    else:
        dh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], T)
        dh_bufs = gl.allocate_shared_memory(T, [2, BLOCK_M, BLOCK_N], dh_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, order, dh_bufs, g_ptr, u_ptr, M, N, K, stride_g, stride_u,
                     out_delta, 0, TANH, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, CHUNK, K_BETA_TANH, K_KAPPA,
                     K_ALPHA, K_BETA_ERF, K_3KAPPA, EPI_MODE, LOOP_CHUNKS, FAST, EVEN)),
        (_consumer, (a_bufs, b_bufs, ready, empty, order, dh_bufs, g_ptr, u_ptr, M, N, K, stride_g, stride_u,
                     out_delta, 1, TANH, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, CHUNK, K_BETA_TANH, K_KAPPA,
                     K_ALPHA, K_BETA_ERF, K_3KAPPA, EPI_MODE, LOOP_CHUNKS, FAST, EVEN)),
        (_producer, (dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                     GROUP_M)),
    ], [gl.num_warps(), 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(dy: torch.Tensor, w_down: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """The kernel's TMA descriptors: dY tiles [block_m, block_k] and Wd tiles [block_k, block_n], wgmma's layouts."""
    gt = gl.bfloat16 if dy.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gt)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_k, block_n], gt)
    return (TensorDescriptor.from_tensor(dy, [block_m, block_k], a_layout),
            TensorDescriptor.from_tensor(w_down, [block_k, block_n], b_layout))


def down_dgeglu_ws(dy: torch.Tensor, w_down: torch.Tensor, g: torch.Tensor, u: torch.Tensor, tanh: bool,
                   block_m: int = 128, block_n: int = 128, block_k: int = 64, stages: Optional[int] = None, group_m: int = 8,
                   chunk: int = 32, consumer_regs: int = 232, producer_regs: int = 40, num_sms: int = 0,
                   epi_mode: int = 1, loop_chunks: bool = True, consumer_warps: int = 4, fast: bool = False,
                   deriv: bool = False, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
    """In place: g, u [M, H] become d_g, d_u for d_h = dy @ w_down (dy [M, D], w_down [D, H]; fp16/bf16, unit
    last-dim strides, 16-byte aligned rows); or, with ``out`` = (d_g, d_u), g and u are read and the gradients
    written there (a buffer laid out as g, u are: the halves of a tensor like the one g and u are halves of).
    Returns the compiled kernel.

    ``deriv``: g, u hold the forward's [gelu(g) | u * gelu'(g)] (`gate_up_geglu(..., deriv=True)`), and the epilogue
    is two products, d_gate = d_h * (u * gelu'(g)) and d_up = d_h * gelu(g), each rounded once. ``stages`` (the TMA
    ring's depth) defaults to `DERIV_STAGES` with ``deriv`` and to `DEFAULT_STAGES` otherwise. ``loop_chunks`` (the
    default) walks the epilogue's row chunks in a runtime loop (one copy of their code) through an XOR-swizzled
    staging buffer; ``consumer_warps=8`` gives each consumer two warpgroups (pass ``consumer_regs`` <= 120 so that
    2 x 256 + 128 threads fit the register file). ``fast`` (tanh GELU): the dGeGLU in fp32 with hardware
    approximations and one rounding per output. ``epi_mode`` other than 1 is for diagnostics and gives wrong
    results: 0 stops after staging d_h, 2 keeps the epilogue's loads and stores with one product for the math, 3 keeps
    the math without the g, u loads."""
    M, K = dy.shape
    N = w_down.shape[1]
    if stages is None:
        stages = DERIV_STAGES if deriv else DEFAULT_STAGES
    dy_desc, wd_desc = descriptors(dy, w_down, block_m, block_n, block_k)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    sms = num_sms or torch.cuda.get_device_properties(dy.device).multi_processor_count
    grid = (min(sms, tiles), )
    out_delta = 0
    if out is not None:  # d_g, d_u into another buffer of g, u's layout: the stores' offset from the loads
        es = g.element_size()
        out_delta = (out[0].data_ptr() - g.data_ptr()) // es
        if (out[0].stride() != g.stride() or out[1].stride() != u.stride()
                or out[1].data_ptr() - u.data_ptr() != out_delta * es):
            raise ValueError("down_dgeglu_ws: out must be (d_g, d_u) laid out as g, u are, at one offset from them")
    return _down_dgeglu_ws_kernel[grid](
        dy_desc, wd_desc, g, u, M, N, K, g.stride(0), u.stride(0), out_delta, TANH=tanh, STAGES=stages, GROUP_M=group_m,
        CHUNK=chunk, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, K_BETA_TANH=K_BETA_TANH,
        K_KAPPA=K_KAPPA, K_ALPHA=K_ALPHA, K_BETA_ERF=K_BETA_ERF, K_3KAPPA=K_3KAPPA, EPI_MODE=2 if deriv else epi_mode,
        LOOP_CHUNKS=loop_chunks,
        FAST=fast and tanh, EVEN=M % block_m == 0 and N % block_n == 0, num_warps=consumer_warps,
        enable_fp_fusion=False)  # eager's bits: FMAs only where written (runtime/gelu_math.py)
