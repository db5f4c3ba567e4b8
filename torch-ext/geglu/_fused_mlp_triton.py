"""Triton kernel of the fused GeGLU MLP: one GEMM computes x @ Wg^T and x @ Wu^T into two fp32 accumulators per
output tile and applies the GeGLU in its epilogue (see docs/fused-mlp.md).

    h[M, H] = round(round(gelu(round(x @ Wg^T))) * round(x @ Wu^T))        (round = to the storage dtype, RNE)

The epilogue is our pointwise forward (`_triton._gelu`, `_triton._round`, eager's constants and operation order,
launched without FMA contraction), applied to the accumulators rounded to the storage dtype as eager's GEMMs store
them: the result equals "cuBLAS-like GEMMs, then our pointwise kernel" up to the GEMMs' accumulation order. With
``save=True`` (training) it also writes those rounded pre-activations, packed as ``gu[M, 2H] = [g | u]``, which is
what the backward needs; with ``deriv`` (the ``fused_training`` setting) the backward's two factors gelu(g) and
u * gelu'(g) instead.

Weights are read in place in nn.Linear's layout (Wg, Wu: [H, D], unit stride on D): no packed copy, no extra
memory. A program computes a BLOCK_M x BLOCK_N tile of h: per K step it loads one x tile [BLOCK_M, BLOCK_K] and
one tile of each weight [BLOCK_N, BLOCK_K] (TMA tensor descriptors on sm_90 when the strides are 16-byte aligned,
plain pointer loads otherwise), and issues two dots that share the x tile. The paired kernel (`Config.pair`, the
default above 256 rows where `pair_layout` accepts the weights) does the same work with one dot: a single TMA box
[2, BLOCK_N, BLOCK_K] over the two weights, seen as one strided 3-D tensor, loads both tiles into one
[2 * BLOCK_N, BLOCK_K] operand, so each K step is one N = 256 wgmma that reads the x tile once (still in place, no
copy; bit-equal to the two-dot kernel). Tiles are visited in GROUP_M-row groups (L2 reuse of the weight tiles);
the grid is one program per tile, or persistent (one program per SM looping over tiles, optionally with Triton's
loop flattening / warp specialisation).

Configs are a small fixed set chosen per (M bucket, D, H, dtype, save) (`choose_config`); nothing is autotuned at
call time. Under the Triton interpreter (CPU tensors) the dots run on fp32 copies of the tiles (the interpreter
multiplies bf16 as integers); products of bf16/fp16 values are exact in fp32, so this is still an fp32-accumulated
GEMM of the same inputs.
"""

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _aot
from ._triton import (INTERPRET, K_3KAPPA, K_ALPHA, K_BETA_ERF, K_BETA_TANH, K_KAPPA, _gelu, _gelu_grad, _round,
                      prebuilt)

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None


if INTERPRET:
    @triton.jit
    def _fast_rcp(x):
        return 1.0 / x

    @triton.jit
    def _fast_exp2(x):
        return tl.exp2(x)
else:
    @triton.jit
    def _fast_rcp(x):
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _fast_exp2(x):  # one MUFU.EX2 (tl.exp2's non-ftz form adds two multiplies for subnormal results)
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id -> (row block, column block), walking GROUP_M row blocks down each column before moving right, so
    programs running together share weight tiles (and x tiles) in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % rows, in_group // rows


# gelu' of the erf GELU in the SAVE = 2 epilogue (constexpr globals: the kernels' signatures stay as they are)
_K_BETA_ERF = tl.constexpr(K_BETA_ERF)
_K_3KAPPA = tl.constexpr(K_3KAPPA)


@triton.jit
def _tanh_gelu_sigmoid(x, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr):
    """s = sigmoid(2 * inner(x)) = (1 + tanh(inner)) / 2 of the tanh GELU (gelu = x * s: no cancellation near -1),
    with the hardware exp2 and reciprocal approximations (~2 ulp in fp32, far below the bf16/fp16 rounding)."""
    z = (2.0 * K_BETA_TANH * 1.4426950408889634) * x * tl.fma(x * x, K_KAPPA, 1.0)
    return _fast_rcp(1.0 + tl.exp2(-z))


@triton.jit
def _geglu_epilogue(acc_g, acc_u, T: tl.constexpr, TANH: tl.constexpr, SAVE: tl.constexpr, FAST_EPI: tl.constexpr,
                    K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """(h, g, u) of a tile from its fp32 gate and up accumulators, h in the storage dtype T. What g and u hold (for
    training) depends on SAVE: 0 nothing, 1 the rounded pre-activations, 2 the backward's two factors gelu(g) and
    u * gelu'(g) (so that the backward's dGeGLU is d_up = d_h * gelu(g), d_gate = d_h * (u * gelu'(g)): two products),
    from the fp32 accumulators, each rounded once."""
    if SAVE == 2:
        x = acc_g
        if FAST_EPI and TANH:  # gelu = x * s, gelu' = s + 2 kBeta x s (1 - s)(1 + 3 kKappa x^2)
            s = _tanh_gelu_sigmoid(x, K_BETA_TANH, K_KAPPA)
            h = x * s
            gp = tl.fma((2.0 * K_BETA_TANH) * x * tl.fma(-s, s, s), tl.fma(x * x, _K_3KAPPA, 1.0), s)
        else:
            h = _gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
            gp = _gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, _K_BETA_ERF, _K_3KAPPA)
        return _round(h * acc_u, T), _round(h, T), _round(acc_u * gp, T)
    if FAST_EPI:
        # The GeGLU of the fp32 accumulators, rounded once: fewer instructions per output than eager's
        # formulation (an epilogue that is not overlapped with the next tile's main loop costs its full time).
        if TANH:
            h = acc_g * _tanh_gelu_sigmoid(acc_g, K_BETA_TANH, K_KAPPA)
        else:
            h = _gelu(acc_g, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
        y = _round(h * acc_u, T)
        if SAVE:
            g = _round(acc_g, T)
            u = _round(acc_u, T)
        else:
            g = y
            u = y
    else:
        # The GEMM outputs as eager stores them (rounded to T), then our pointwise GeGLU with eager's rounding.
        g = _round(acc_g, T)
        u = _round(acc_u, T)
        h = _round(_gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
        y = _round(h * u.to(tl.float32), T)
    return y, g, u


@triton.jit
def _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                  stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                  TANH: tl.constexpr, SAVE: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_EPI: tl.constexpr,
                  K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
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
    y, g, u = _geglu_epilogue(acc_g, acc_u, T, TANH, SAVE, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    if TMA:
        out_ptr.store([off_m, off_n], y)
        if SAVE:
            g_ptr.store([off_m, off_n], g)
            u_ptr.store([off_m, off_n], u)
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        tl.store(out_ptr + r64 * stride_o + cols[None, :], y, mask=mask)
        if SAVE:
            tl.store(g_ptr + r64 * stride_g + cols[None, :], g, mask=mask)
            tl.store(u_ptr + r64 * stride_u + cols[None, :], u, mask=mask)


@triton.jit
def _gate_up_geglu_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                          stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u,
                          TANH: tl.constexpr, SAVE: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
                          FAST_EPI: tl.constexpr,
                          K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                          stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                          TANH, SAVE, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI,
                          K_BETA_TANH, K_KAPPA, K_ALPHA)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                      stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                      TANH, SAVE, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI,
                      K_BETA_TANH, K_KAPPA, K_ALPHA)


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of acc."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


# --- paired weights: one N = 2 * BLOCK_N dot per K step over both weights, in place ---------------------------


@triton.jit
def _paired_tile(x_ptr, w_ptr, out_ptr, g_ptr, u_ptr, M, N, K, pid_m, pid_n,
                 TANH: tl.constexpr, SAVE: tl.constexpr, DOT_F32: tl.constexpr, GATE_FIRST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_EPI: tl.constexpr,
                 K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of h with one dot of N = 2 * BLOCK_N per K step (the widest wgmma; the x tile
    read once per step): w is the two weights as one strided 3-D tensor [2, N, K] (`pair_layout`), the gate first
    or the up weight first in memory, and a [2, BLOCK_N, BLOCK_K] box holds both weights' tiles. The accumulator's
    column halves are the two products; in the wgmma accumulator layout a thread holds columns of both halves, so
    the split is a register renaming (no shared-memory round trip)."""
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
        acc_g, acc_u = _halves(acc, BLOCK_M, 2 * BLOCK_N)
    else:
        acc_u, acc_g = _halves(acc, BLOCK_M, 2 * BLOCK_N)
    y, g, u = _geglu_epilogue(acc_g, acc_u, T, TANH, SAVE, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    out_ptr.store([off_m, off_n], y)
    if SAVE:
        g_ptr.store([off_m, off_n], g)
        u_ptr.store([off_m, off_n], u)


@triton.jit
def _paired_gate_up_geglu_kernel(x_ptr, w_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                                 TANH: tl.constexpr, SAVE: tl.constexpr, DOT_F32: tl.constexpr,
                                 GATE_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
                                 FLATTEN: tl.constexpr, FAST_EPI: tl.constexpr,
                                 K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _paired_tile(x_ptr, w_ptr, out_ptr, g_ptr, u_ptr, M, N, K, pid_m, pid_n, TANH, SAVE, DOT_F32, GATE_FIRST,
                         BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _paired_tile(x_ptr, w_ptr, out_ptr, g_ptr, u_ptr, M, N, K, pid_m, pid_n, TANH, SAVE, DOT_F32, GATE_FIRST,
                     BLOCK_M, BLOCK_N, BLOCK_K, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)


# --- configs ------------------------------------------------------------------------------------------------------


class Config(NamedTuple):
    block_m: int = 128
    block_n: int = 128  # per accumulator: the tile covers BLOCK_N columns of gate and of up
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # one program per SM looping over the tiles
    flatten: bool = False  # persistent: Triton's loop flattening of the tile and K loops into one pipelined loop,
    #                        so that the next tile's first loads are in flight during this tile's epilogue
    tma: bool = True  # use TMA descriptors where the hardware and the strides allow it
    fast_epi: bool = False  # GeGLU of the fp32 accumulators with hardware approximations, rounded once
    pair: bool = False  # forward: one [2 * BLOCK_N, BLOCK_K] weight operand holding both weights' tiles, one dot
    #                     of N = 2 * BLOCK_N per K step (`_launch_paired`), where the weights allow it

    def label(self) -> str:
        s = f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.persistent:
            s += " persistent" + (" flat" if self.flatten else "")
        if not self.tma:
            s += " ptr"
        if self.fast_epi:
            s += " fast-epi"
        if self.pair:
            s += " pair"
        return s


# Shared memory per stage is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes: 48 KiB at 128x128x64. Registers: two
# 128x128 fp32 accumulators over 8 warps are 128 a thread. The persistent loop matters on sm_90: without it ptxas
# serialises the tile's wgmma pipeline (warning C7515), with it a K step's wgmma issue back to back.
LARGE = Config(128, 128, 64, 16, 8, 3, persistent=True, pair=True)  # paired where the weights allow
MEDIUM = Config(64, 128, 64, 8, 4, 4)  # 65 <= M <= 256: one warpgroup, m64 wgmma
INTERPRETER = Config(16, 16, 16, 2, 1, 1)  # tiny tiles: several tiles and K steps at test sizes
# Paired-kernel tiles: BLOCK_N counts h columns, so the dot is BLOCK_M x (2 * BLOCK_N). The flattened persistent
# loop overlaps a tile's epilogue with the next tile's first loads (the outputs are bit-identical either way).
PAIRED_LARGE = Config(128, 128, 64, 16, 8, 3, persistent=True, flatten=True, fast_epi=True, pair=True)

# Choices per (M bucket, D, H, dtype, save) -> Config; `gate_up_geglu` fills it when a config runs out of shared
# memory on a device (one stage fewer), and the inference path with its configs.
TUNED: dict = {}


def inference_config(M: int) -> Config:
    """The tile of the fused inference path: the fast epilogue, paired weights above 256 rows."""
    base = INTERPRETER if INTERPRET else (MEDIUM if M <= 256 else PAIRED_LARGE)
    return base._replace(fast_epi=True)


def m_bucket(M: int) -> int:
    """Power-of-two bucket of M (capped at 8192), the only M dependence of the config choice."""
    return min(1 << max(M - 1, 1).bit_length(), 8192)


def choose_config(M: int, D: int, H: int, dtype: torch.dtype, save: bool) -> Config:
    cfg = TUNED.get((m_bucket(M), D, H, dtype, save))
    if cfg is not None:
        return cfg
    if INTERPRET:
        return INTERPRETER
    return MEDIUM if M <= 256 else LARGE


# --- launcher -----------------------------------------------------------------------------------------------------

_SM_COUNT = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _aligned(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte-aligned base and row stride, and a unit stride on the last dim."""
    es = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_supported(device: torch.device) -> bool:
    if TensorDescriptor is None:
        return False
    if INTERPRET:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _save_mode(save: bool, deriv: bool) -> int:
    """The kernels' SAVE: 0 h only, 1 also [g | u], 2 also [gelu(g) | u * gelu'(g)] (`_geglu_epilogue`)."""
    return 2 if save and deriv else int(save)


def gate_up_geglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, tanh: bool, save: bool,
                  config: Optional[Config] = None, deriv: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h = geglu(x @ w_gate^T, x @ w_up^T) for 2-D x [M, D] and weights [H, D] (fp16/bf16, unit last-dim stride,
    validated by the caller); with ``save`` also gu = [g | u] [M, 2H], the rounded pre-activations, or with ``deriv``
    as well [gelu(g) | u * gelu'(g)], the backward's two factors (from the fp32 accumulators, each rounded once)."""
    save_mode = _save_mode(save, deriv)
    M, K = x.shape
    N = w_gate.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    gu = torch.empty((M, 2 * N), dtype=x.dtype, device=x.device) if save else None
    if M == 0 or N == 0:
        return out, gu
    if K == 0:
        raise ValueError("gate_up_geglu: D = 0 is not supported by the fused kernel.")
    cfg = config or choose_config(M, K, N, x.dtype, save)
    g_view, u_view = (gu[:, :N], gu[:, N:]) if save else (out, out)
    tensors = (x, w_gate, w_up, out, g_view, u_view)
    use_tma = cfg.tma and tma_supported(x.device) and all(_aligned(t) for t in tensors)
    layout = pair_layout(w_gate, w_up) if use_tma and cfg.pair else None
    if layout is not None:
        _launch_paired(x, layout, w_gate, out, g_view, u_view, tanh, save_mode, cfg)
        return out, gu
    if use_tma:
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        args = [_aot.Desc(t, t.shape, t.stride(), blk) for t, blk in
                ((x, [bm, bk]), (w_gate, [bn, bk]), (w_up, [bn, bk]), (out, [bm, bn]), (g_view, [bm, bn]),
                 (u_view, [bm, bn]))]
    else:
        args = list(tensors)
    try:
        _launch(args, M, N, K, x, w_gate, w_up, out, g_view, u_view, tanh, save_mode, use_tma, cfg)
    except triton.runtime.errors.OutOfResources:
        if config is not None or cfg.num_stages <= 2:
            raise  # an explicit config (benchmarks, tests) reports its failure
        # Too much shared memory for this device (e.g. the epilogue's store staging with save=True): retry with
        # one pipeline stage fewer, down to 2, and remember the working choice for this (M bucket, D, H, dtype).
        TUNED[(m_bucket(M), K, N, x.dtype, save)] = cfg._replace(num_stages=cfg.num_stages - 1)
        return gate_up_geglu(x, w_gate, w_up, tanh, save, deriv=deriv)
    return out, gu


def _run(kernel, grid, args, consts, cfg, device) -> None:
    """The kernel's prebuilt binary for this launch where the variant ships one, else Triton's JIT (``args``: the
    runtime arguments, host-side TMA descriptors as `_aot.Desc`; ``consts``: the constexprs in order)."""
    with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
        if device.type == "cuda" and prebuilt(kernel, grid, args, consts, cfg.num_warps, cfg.num_stages,
                                              device.index):
            return
        jit_args = [TensorDescriptor(a.base, a.shape, a.strides, a.block) if isinstance(a, _aot.Desc) else a
                    for a in args]
        kernel[grid](*jit_args, *consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)


def gate_up_consts(tanh, save, use_tma, cfg) -> tuple:
    """The two-dot kernel's constexprs, in order."""
    return (tanh, save, use_tma, INTERPRET, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.persistent,
            cfg.flatten, cfg.fast_epi, K_BETA_TANH, K_KAPPA, K_ALPHA)


def paired_consts(tanh, save, gate_first, cfg) -> tuple:
    """The paired kernel's constexprs, in order."""
    return (tanh, save, INTERPRET, gate_first, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.persistent,
            cfg.flatten, cfg.fast_epi, K_BETA_TANH, K_KAPPA, K_ALPHA)


def _grid(num_tiles: int, cfg: Config, device) -> tuple:
    return (min(num_tiles, _sm_count(device)) if cfg.persistent else num_tiles,)


def _launch(args, M, N, K, x, w_gate, w_up, out, g_view, u_view, tanh, save, use_tma, cfg):
    grid = _grid(triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), cfg, x.device)
    strides = [x.stride(0), w_gate.stride(0), w_up.stride(0), out.stride(0), g_view.stride(0), u_view.stride(0)]
    _run(_gate_up_geglu_kernel, grid, [*args, M, N, K, *strides], gate_up_consts(tanh, save, use_tma, cfg), cfg,
         x.device)


_TMA_MAX_STRIDE = 1 << 40  # bytes: cuTensorMapEncodeTiled's limit on a global stride


class PairLayout(NamedTuple):
    base: torch.Tensor  # the weight at the lower address
    outer_stride: int  # elements from that weight's start to the other's
    gate_first: bool  # whether the base is the gate weight


def pair_layout(w_gate: torch.Tensor, w_up: torch.Tensor) -> Optional[PairLayout]:
    """The two weights as one strided 3-D tensor [2, H, D] for a TMA descriptor, without a copy; None when they
    cannot be (different shapes, strides or dtypes, unaligned, overlapping or interleaved, or further apart than
    TMA can stride)."""
    if (w_gate.shape != w_up.shape or w_gate.stride() != w_up.stride() or w_gate.dtype != w_up.dtype
            or w_gate.device != w_up.device or not (_aligned(w_gate) and _aligned(w_up))):
        return None
    delta = w_up.data_ptr() - w_gate.data_ptr()
    base, gate_first = (w_gate, True) if delta > 0 else (w_up, False)
    delta = abs(delta)
    es = w_gate.element_size()
    H, D = w_gate.shape
    extent = ((H - 1) * w_gate.stride(0) + D) * es  # bytes one weight spans
    # Planes that interleave (e.g. the two weights as alternate rows of one tensor) would make the outer stride
    # smaller than a plane: not a layout TMA promises to take, so those pairs run the two-accumulator kernel.
    if delta < extent or delta % 16 or delta >= _TMA_MAX_STRIDE:
        return None
    return PairLayout(base, delta // es, gate_first)


def _launch_paired(x, layout: PairLayout, w_gate, out, g_view, u_view, tanh, save, cfg):
    M, K = x.shape
    N = w_gate.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w_desc = _aot.Desc(layout.base, [2, N, K], [layout.outer_stride, w_gate.stride(0), 1], [2, bn, bk])
    args = [_aot.Desc(t, t.shape, t.stride(), blk) for t, blk in
            ((x, [bm, bk]), (out, [bm, bn]), (g_view, [bm, bn]), (u_view, [bm, bn]))]
    args.insert(1, w_desc)
    grid = _grid(triton.cdiv(M, bm) * triton.cdiv(N, bn), cfg, x.device)
    _run(_paired_gate_up_geglu_kernel, grid, [*args, M, N, K], paired_consts(tanh, save, layout.gate_first, cfg), cfg,
         x.device)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
