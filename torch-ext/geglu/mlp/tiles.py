"""Triton kernels of the fused GeGLU MLP (host side: ``mlp.kernels``): x @ Wg^T and x @ Wu^T into two fp32
accumulators per tile (weights in place, [H, D]; the paired kernel: one N = 2 * BLOCK_N dot per K step), then
``h = round(round(gelu(round(acc_g))) * round(acc_u))`` (round: to the storage dtype, RNE), i.e. our pointwise
forward (no FMA contraction) on the GEMMs' stored outputs; ``FAST_EPI``: the GeGLU of the fp32 accumulators,
rounded once. Interpreter dots run on fp32 copies (exact products, fp32 accumulation).
"""

import triton
import triton.language as tl

from ..runtime.gelu_math import INTERPRET, gelu, round_to


if INTERPRET:
    @triton.jit
    def _fast_rcp(x):
        return 1.0 / x
else:
    @triton.jit
    def _fast_rcp(x):
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id -> (row block, column block), walking GROUP_M row blocks down each column before moving right."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % rows, in_group // rows


@triton.jit
def _tanh_gelu_sigmoid(x, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr):
    """(1 + tanh(inner(x))) / 2 of the tanh GELU via approximate exp2 and reciprocal (~2 ulp in fp32)."""
    z = (2.0 * K_BETA_TANH * 1.4426950408889634) * x * tl.fma(x * x, K_KAPPA, 1.0)
    return _fast_rcp(1.0 + tl.exp2(-z))


@triton.jit
def geglu_epilogue(acc_g, acc_u, T: tl.constexpr, TANH: tl.constexpr, FAST_EPI: tl.constexpr,
                   K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """A tile of h in the storage dtype T from its fp32 gate and up accumulators."""
    if FAST_EPI:
        if TANH:
            h = acc_g * _tanh_gelu_sigmoid(acc_g, K_BETA_TANH, K_KAPPA)
        else:
            h = gelu(acc_g, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
        return round_to(h * acc_u, T)
    g = round_to(acc_g, T)
    u = round_to(acc_u, T)
    h = round_to(gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    return round_to(h * u.to(tl.float32), T)


@triton.jit
def _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, stride_x, stride_wg, stride_wu, stride_o, pid_m, pid_n,
                  TANH: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_EPI: tl.constexpr, K_BETA_TANH: tl.constexpr,
                  K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if TMA:
        T = x_ptr.dtype
    else:
        T = x_ptr.dtype.element_ty
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
        wg_ptrs = wg_ptr + cols.to(tl.int64)[:, None] * stride_wg + ks[None, :]
        wu_ptrs = wu_ptr + cols.to(tl.int64)[:, None] * stride_wu + ks[None, :]
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:
            a = x_ptr.load([off_m, k * BLOCK_K])
            bg = wg_ptr.load([off_n, k * BLOCK_K])
            bu = wu_ptr.load([off_n, k * BLOCK_K])
        else:
            k_ok = (k * BLOCK_K + ks) < K
            a = tl.load(x_ptrs, mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(wg_ptrs, mask=(cols < N)[:, None] & k_ok[None, :], other=0.0)
            bu = tl.load(wu_ptrs, mask=(cols < N)[:, None] & k_ok[None, :], other=0.0)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        if DOT_F32:  # interpreter: exact products of the bf16/fp16 values, fp32 accumulation
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
            acc_g = tl.dot(a, bg.T, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu.T, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg.T, acc_g)
            acc_u = tl.dot(a, bu.T, acc_u)
    y = geglu_epilogue(acc_g, acc_u, T, TANH, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    if TMA:
        out_ptr.store([off_m, off_n], y)
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], y, mask=mask)


@triton.jit
def _gate_up_geglu_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, stride_x, stride_wg, stride_wu, stride_o,
                          TANH: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, FAST_EPI: tl.constexpr,
                          K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, stride_x, stride_wg, stride_wu, stride_o, pid_m,
                          pid_n, TANH, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, stride_x, stride_wg, stride_wu, stride_o, pid_m, pid_n,
                      TANH, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)


@triton.jit
def split_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of acc."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _paired_tile(x_ptr, w_ptr, out_ptr, M, N, K, pid_m, pid_n, TANH: tl.constexpr, DOT_F32: tl.constexpr,
                 GATE_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FAST_EPI: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of h from w, the two weights as one 3-D descriptor [2, N, K] (`pair_layout`;
    plane 0 the gate iff GATE_FIRST): one N = 2 * BLOCK_N dot per K step, its column halves the two products."""
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    T = x_ptr.dtype
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = x_ptr.load([off_m, k * BLOCK_K])
        b = tl.reshape(w_ptr.load([0, off_n, k * BLOCK_K]), (2 * BLOCK_N, BLOCK_K))
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    if GATE_FIRST:
        acc_g, acc_u = split_halves(acc, BLOCK_M, 2 * BLOCK_N)
    else:
        acc_u, acc_g = split_halves(acc, BLOCK_M, 2 * BLOCK_N)
    out_ptr.store([off_m, off_n], geglu_epilogue(acc_g, acc_u, T, TANH, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA))


@triton.jit
def _paired_gate_up_geglu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, TANH: tl.constexpr, DOT_F32: tl.constexpr,
                                 GATE_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
                                 FLATTEN: tl.constexpr, FAST_EPI: tl.constexpr,
                                 K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _paired_tile(x_ptr, w_ptr, out_ptr, M, N, K, pid_m, pid_n, TANH, DOT_F32, GATE_FIRST,
                         BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _paired_tile(x_ptr, w_ptr, out_ptr, M, N, K, pid_m, pid_n, TANH, DOT_F32, GATE_FIRST,
                     BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
