"""Triton kernel of the MoE experts' gate/up grouped GEMM with the GeGLU in its epilogue:
``h[r] = gelu(x[r] @ Wg_e^T) * (x[r] @ Wu_e^T)`` for the rows r of expert e, x [S, D] sorted by expert, weights
``gate_up_proj`` [E, 2I, D] (gate rows first) read in place as [E, 2, I, D]. The dense paired tile
(`mlp.tiles._paired_tile`) with the fast epilogue (not eager's bits); rows of the next expert in a tile are
computed and masked out of the store. A persistent grid walks a tile list built on the device (`schedule`).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..mlp.kernels import INTERPRETER, Config, tma_aligned, tma_supported
from ..mlp.tiles import geglu_epilogue, split_halves
from ..runtime import aot as _aot
from ..runtime.gelu_math import INTERPRET, K_ALPHA, K_BETA_TANH, K_KAPPA
from ..runtime.launch import desc_type, device_guard, launch, prebuild, sm_count


@triton.jit
def _grouped_geglu_kernel(x_desc, w_desc, out_ptr, tile_expert_ptr, tiles_end_ptr, m_tiles_ptr, offsets_ptr, S, E, N,
                          stride_o, K, bound, TANH: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr, FAST_EPI: tl.constexpr,
                          K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    total = tl.minimum(tl.load(tiles_end_ptr + E - 1), bound)  # bound: the listed tile ids (offsets past S)
    cols = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        e = tl.load(tile_expert_ptr + t)
        first = tl.load(tiles_end_ptr + e - 1, mask=e > 0, other=0)
        row_start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        row_end = tl.load(offsets_ptr + e)
        m_tiles = tl.load(m_tiles_ptr + e)
        local = t - first
        off_m = row_start + (local % m_tiles) * BLOCK_M
        off_n = (local // m_tiles) * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([off_m, k * BLOCK_K])
            b = tl.reshape(w_desc.load([e, 0, off_n, k * BLOCK_K]), (2 * BLOCK_N, BLOCK_K))
            if DOT_F32:  # interpreter: exact products of the bf16/fp16 values, fp32 accumulation
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        acc_g, acc_u = split_halves(acc, BLOCK_M, 2 * BLOCK_N)
        y = geglu_epilogue(acc_g, acc_u, x_desc.dtype, TANH, FAST_EPI, K_BETA_TANH, K_KAPPA, K_ALPHA)
        r = off_m + rows
        c = off_n + cols
        mask = ((r < row_end) & (r < S))[:, None] & (c < N)[None, :]  # S: offsets past the rows write nothing
        tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], y, mask=mask)


# LARGE where experts average more than 256 rows, else SMALL_M (64-row tiles)
LARGE = Config(128, 128, 64, 1, 8, 3, persistent=True, flatten=True, fast_epi=True, pair=True)
SMALL_M = LARGE._replace(block_m=64, num_warps=4, num_stages=4)
INTERPRETER_CFG = INTERPRETER._replace(fast_epi=True, pair=True)


def grouped_consts(tanh: bool, cfg: Config) -> tuple:
    return (tanh, INTERPRET, cfg.block_m, cfg.block_n, cfg.block_k, cfg.flatten, cfg.fast_epi, K_BETA_TANH, K_KAPPA,
            K_ALPHA)


def default_config(S: int, E: int) -> Config:
    return INTERPRETER_CFG if INTERPRET else SMALL_M if S <= 256 * E else LARGE


def applies(x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: fp16/bf16 of one dtype and device with TMA (or the interpreter),
    x [S, D] and gate_up_proj [E, 2I, D] contiguous with 16-byte aligned rows."""
    if x.dtype not in (torch.float16, torch.bfloat16) or gate_up_proj.dtype != x.dtype:
        return False
    if x.dim() != 2 or gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != x.shape[1] or gate_up_proj.shape[1] % 2:
        return False
    if x.device != gate_up_proj.device or not (x.is_cuda or INTERPRET) or not tma_supported(x.device):
        return False
    es = x.element_size()
    I, D = gate_up_proj.shape[1] // 2, x.shape[1]
    return (x.is_contiguous() and gate_up_proj.is_contiguous() and tma_aligned(x) and (D * es) % 16 == 0
            and (I * es) % 16 == 0 and gate_up_proj.data_ptr() % 16 == 0)


def schedule(offsets: torch.Tensor, S: int, I: int, block_m: int, block_n: int):
    """``(tile_expert, tiles_end, m_tiles, offsets, bound)`` on the device, no host sync: per expert its row tiles
    and cumulative tile count, the expert of each tile id below ``bound = (S // BLOCK_M + E) * column tiles``, int32
    offsets."""
    n_tiles = triton.cdiv(I, block_n)
    offsets = offsets.to(torch.int32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    m_tiles = (counts + (block_m - 1)) // block_m
    tiles_end = torch.cumsum(m_tiles * n_tiles, 0, dtype=torch.int32)
    bound = (S // block_m + offsets.numel()) * n_tiles
    ids = torch.arange(bound, device=offsets.device, dtype=torch.int32)
    tile_expert = torch.searchsorted(tiles_end, ids, right=True, out_int32=True)
    return tile_expert, tiles_end, m_tiles.to(torch.int32), offsets, bound


def grouped_gate_up_geglu(x: torch.Tensor, gate_up_proj: torch.Tensor, offsets: torch.Tensor, tanh: bool,
                          config: Optional[Config] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [S, I] of x [S, D] (rows sorted by expert; ``offsets`` [E] cumulative counts <= S) and gate_up_proj [E, 2I, D]
    as :func:`applies` takes them; rows past ``offsets[-1]`` unwritten. ValueError for a bad ``out`` (contiguous [S, I]
    of x's dtype and device) or D = 0 (S, I > 0)."""
    S, D = x.shape
    E, I2, _ = gate_up_proj.shape
    I = I2 // 2
    if out is None:
        out = torch.empty((S, I), dtype=x.dtype, device=x.device)
    elif out.shape != (S, I) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"grouped_gate_up_geglu: out must be a contiguous {x.dtype} tensor of shape ({S}, {I}) on "
                         f"{x.device}; got {out.dtype} {tuple(out.shape)} on {out.device}.")
    if S == 0 or I == 0 or E == 0:  # E == 0: no expert, every row unwritten
        return out
    if D == 0:
        raise ValueError("grouped_gate_up_geglu: hidden size 0 is not supported by the fused kernel.")
    cfg = config or default_config(S, E)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tile_expert, tiles_end, m_tiles, offs, bound = schedule(offsets, S, I, bm, bn)
    x_desc = _aot.Desc(x, [S, D], [D, 1], [bm, bk])
    w_desc = _aot.Desc(gate_up_proj, [E, 2, I, D], [I2 * D, I * D, D, 1], [1, 2, bn, bk])
    grid = (min(bound, sm_count(x.device)),)
    with device_guard(x):
        launch(_grouped_geglu_kernel, grid,
               [x_desc, w_desc, out, tile_expert, tiles_end, m_tiles, offs, S, E, I, out.stride(0), D, bound],
               grouped_consts(tanh, cfg), cfg.num_warps, x.device, cfg.num_stages)
    return out


# The build compiles every launch listed here ahead of time for sm_90+; any other launch runs Triton's JIT.
PREBUILD_MIN_ARCH = 90


def prebuild_launches() -> list:
    """The grouped kernel at both configs, fp16 and bf16, with and without width hints."""
    out = []
    for dt in ("bf16", "fp16"):
        for cfg in (LARGE, SMALL_M):
            bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
            types = dict(x_desc=desc_type(dt, [bm, bk]), w_desc=desc_type(dt, [1, 2, bn, bk]), tile_expert_ptr="*i32",
                         tiles_end_ptr="*i32", m_tiles_ptr="*i32", offsets_ptr="*i32")
            for hinted in (("N", "stride_o"), ()):
                for tanh in (False, True):
                    out.append(prebuild(_grouped_geglu_kernel, grouped_consts(tanh, cfg), cfg.num_warps,
                                        cfg.num_stages, dtype=dt, hinted=hinted, types=types))
    return out
