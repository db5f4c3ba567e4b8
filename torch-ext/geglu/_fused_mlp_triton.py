"""Triton kernel of the fused GeGLU MLP: one GEMM computes x @ Wg^T and x @ Wu^T into two fp32 accumulators per
output tile and applies the GeGLU in its epilogue (see docs/fused-mlp.md).

    h[M, H] = round(round(gelu(round(x @ Wg^T))) * round(x @ Wu^T))        (round = to the storage dtype, RNE)

The epilogue is our pointwise forward (`_triton._gelu`, `_triton._round`, eager's constants and operation order,
launched without FMA contraction), applied to the accumulators rounded to the storage dtype as eager's GEMMs store
them: the result equals "cuBLAS-like GEMMs, then our pointwise kernel" up to the GEMMs' accumulation order. With
``save=True`` (training) it also writes those rounded pre-activations, packed as ``gu[M, 2H] = [g | u]``, which is
what the backward needs (the dGeGLU then writes [d_g | d_u] over it, and dX / dW become single GEMMs).

Weights are read in place in nn.Linear's layout (Wg, Wu: [H, D], unit stride on D): no packed copy, no extra
memory. A program computes a BLOCK_M x BLOCK_N tile of h: per K step it loads one x tile [BLOCK_M, BLOCK_K] and
one tile of each weight [BLOCK_N, BLOCK_K] (TMA tensor descriptors on sm_90 when the strides are 16-byte aligned,
plain pointer loads otherwise), and issues two dots that share the x tile. Tiles are visited in GROUP_M-row
groups (L2 reuse of the weight tiles); the grid is one program per tile, or persistent (one program per SM looping
over tiles, optionally with Triton's loop flattening / warp specialisation).

Configs are a small fixed set chosen per (M bucket, D, H, dtype, save) (`choose_config`); nothing is autotuned at
call time. Under the Triton interpreter (CPU tensors) the dots run on fp32 copies of the tiles (the interpreter
multiplies bf16 as integers); products of bf16/fp16 values are exact in fp32, so this is still an fp32-accumulated
GEMM of the same inputs.
"""

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, K_ALPHA, K_BETA_TANH, K_KAPPA, _gelu, _round

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None


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


@triton.jit
def _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                  stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                  TANH: tl.constexpr, SAVE: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS_K: tl.constexpr,
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
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WS_K):
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
    # Epilogue: the GEMM outputs as eager stores them (rounded to T), then our pointwise GeGLU with eager's rounding.
    g = _round(acc_g, T)
    u = _round(acc_u, T)
    h = _round(_gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    y = _round(h * u.to(tl.float32), T)
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
                          WARP_SPECIALIZE: tl.constexpr,
                          K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN,
                                warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                          stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                          TANH, SAVE, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, False, K_BETA_TANH, K_KAPPA, K_ALPHA)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _gate_up_tile(x_ptr, wg_ptr, wu_ptr, out_ptr, g_ptr, u_ptr, M, N, K,
                      stride_x, stride_wg, stride_wu, stride_o, stride_g, stride_u, pid_m, pid_n,
                      TANH, SAVE, TMA, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, WARP_SPECIALIZE,
                      K_BETA_TANH, K_KAPPA, K_ALPHA)


# --- configs ------------------------------------------------------------------------------------------------------


class Config(NamedTuple):
    block_m: int = 128
    block_n: int = 128  # per accumulator: the tile covers BLOCK_N columns of gate and of up
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    flatten: bool = False
    warp_specialize: bool = False  # Triton's automatic warp specialisation: on the tile loop when persistent, else
    #                                on the K loop (a TMA producer warp and wgmma consumer warpgroups)
    tma: bool = True  # use TMA descriptors where the hardware and the strides allow it
    programs_per_sm: int = 1  # persistent grid size = programs_per_sm * SMs (2 for tiles that fit twice on an SM)

    def label(self) -> str:
        s = f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.persistent:
            s += " persistent" + (f"x{self.programs_per_sm}" if self.programs_per_sm > 1 else "") + (
                " flat" if self.flatten else "")
        if self.warp_specialize:
            s += " ws"
        if not self.tma:
            s += " ptr"
        return s


# Shared memory per stage is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes: 48 KiB at 128x128x64. Registers: two
# 128x128 fp32 accumulators over 8 warps are 128 a thread. Checked offline for sm_90a with Triton 3.6's compiler and
# ptxas (benchmarks/aot_fused_mlp.py, no GPU needed): the persistent 128x128x64 w8 s3 kernel issues its 8 wgmma of a
# K step back to back (one wait per step, 2 groups in flight), 172 registers (181 with save), 176 KiB of shared
# memory, no spills. The same tile without the persistent loop compiles to a *serialized* wgmma pipeline (ptxas
# C7515: every wgmma waits for the previous one), so it is not the default.
LARGE = Config(128, 128, 64, 8, 8, 3, persistent=True)
MEDIUM = Config(64, 128, 64, 8, 4, 4)  # 65 <= M <= 256: one warpgroup, m64 wgmma (not serialized; 173 registers)
INTERPRETER = Config(16, 16, 16, 2, 1, 1)  # tiny tiles: several tiles and K steps at test sizes

# Measured choices, (M bucket, D, H, dtype, save) -> Config; filled from benchmarks/bench_fused_mlp.py runs.
TUNED: dict = {}

# The tile configs the benchmark sweeps (inference mode); the best per shape goes into TUNED. Arithmetic intensity
# (outputs per loaded row per K step): 128x128 and 256x64 tiles (both gate and up) match cuBLAS's 128x256 tile.
SWEEP = [
    LARGE,
    Config(128, 128, 64, 16, 8, 3, persistent=True),
    Config(128, 128, 64, 8, 8, 3, persistent=True, warp_specialize=True),
    Config(256, 64, 64, 8, 8, 3),
    Config(256, 64, 64, 8, 8, 4),
    Config(256, 64, 64, 8, 8, 3, persistent=True),
    Config(128, 64, 64, 8, 4, 3),  # 96 KiB, ~173 registers x 128 threads: two programs per SM
    Config(128, 64, 64, 8, 4, 3, persistent=True, programs_per_sm=2),
    Config(128, 64, 64, 8, 4, 4),
    MEDIUM,
    Config(128, 128, 64, 8, 8, 3),  # reference: the serialized non-persistent compile (see above)
    Config(128, 128, 64, 8, 8, 3, tma=False),  # pointer loads instead of TMA
]


def m_bucket(M: int) -> int:
    """Power-of-two bucket of M (capped at 8192), the only M dependence of the config choice."""
    return min(1 << max(M - 1, 1).bit_length(), 8192)


def choose_config(M: int, D: int, H: int, dtype: torch.dtype, save: bool) -> Config:
    if INTERPRET:
        return INTERPRETER
    cfg = TUNED.get((m_bucket(M), D, H, dtype, save))
    if cfg is not None:
        return cfg
    return MEDIUM if M <= 256 else LARGE


# --- launcher -----------------------------------------------------------------------------------------------------

_SM_COUNT = {}
last_compiled = None  # the last launch's compiled kernel (registers, spills, shared memory: for benchmarks)


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


def gate_up_geglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, tanh: bool, save: bool,
                  config: Optional[Config] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h = geglu(x @ w_gate^T, x @ w_up^T) for 2-D x [M, D] and weights [H, D] (fp16/bf16, unit last-dim stride,
    validated by the caller); with ``save`` also gu = [g | u] [M, 2H], the rounded pre-activations."""
    M, K = x.shape
    N = w_gate.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    gu = torch.empty((M, 2 * N), dtype=x.dtype, device=x.device) if save else None
    if M == 0 or N == 0:
        return out, gu
    if K == 0:
        raise ValueError("geglu_mlp_fused: D = 0 is not supported by the fused kernel.")
    cfg = config or choose_config(M, K, N, x.dtype, save)
    g_view, u_view = (gu[:, :N], gu[:, N:]) if save else (out, out)
    tensors = (x, w_gate, w_up, out, g_view, u_view)
    use_tma = cfg.tma and tma_supported(x.device) and all(_aligned(t) for t in tensors)
    if use_tma:
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        args = [TensorDescriptor(t, list(t.shape), list(t.stride()), blk) for t, blk in
                ((x, [bm, bk]), (w_gate, [bn, bk]), (w_up, [bn, bk]), (out, [bm, bn]), (g_view, [bm, bn]),
                 (u_view, [bm, bn]))]
    else:
        args = list(tensors)
    try:
        _launch(args, M, N, K, x, w_gate, w_up, out, g_view, u_view, tanh, save, use_tma, cfg)
    except triton.runtime.errors.OutOfResources:
        if config is not None or cfg.num_stages <= 2:
            raise  # an explicit config (benchmarks, tests) reports its failure
        # Too much shared memory for this device (e.g. the epilogue's store staging with save=True): retry with
        # one pipeline stage fewer, down to 2, and remember the working choice for this (M bucket, D, H, dtype).
        TUNED[(m_bucket(M), K, N, x.dtype, save)] = cfg._replace(num_stages=cfg.num_stages - 1)
        return gate_up_geglu(x, w_gate, w_up, tanh, save)
    return out, gu


def _launch(args, M, N, K, x, w_gate, w_up, out, g_view, u_view, tanh, save, use_tma, cfg):
    global last_compiled
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    grid = (min(num_tiles, cfg.programs_per_sm * _sm_count(x.device)) if cfg.persistent else num_tiles,)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _nullcontext():
        last_compiled = _gate_up_geglu_kernel[grid](
            *args, M, N, K,
            x.stride(0), w_gate.stride(0), w_up.stride(0), out.stride(0), g_view.stride(0), u_view.stride(0),
            TANH=tanh, SAVE=save, TMA=use_tma, DOT_F32=INTERPRET,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            K_BETA_TANH=K_BETA_TANH, K_KAPPA=K_KAPPA, K_ALPHA=K_ALPHA,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        )


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
