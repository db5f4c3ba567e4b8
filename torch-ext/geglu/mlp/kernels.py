"""Host side of the fused GeGLU MLP's gate/up GEMM: tile configs (fixed, chosen per (M bucket, D, H, dtype)), the
launcher ``gate_up_geglu`` and the launches the build prebuilds. Device code: ``mlp.tiles``.
"""

from typing import NamedTuple, Optional

import torch
import triton

from ..runtime import aot as _aot
from ..runtime.gelu_math import INTERPRET, K_ALPHA, K_BETA_TANH, K_KAPPA
from ..runtime.launch import TensorDescriptor, desc_type, device_guard, launch, prebuild, sm_count
from .tiles import _gate_up_geglu_kernel, _paired_gate_up_geglu_kernel


class Config(NamedTuple):
    block_m: int = 128
    block_n: int = 128  # per accumulator: the tile covers BLOCK_N columns of gate and of up
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # one program per SM looping over the tiles
    flatten: bool = False  # persistent: flatten the tile and K loops into one pipelined loop
    tma: bool = True  # TMA descriptors where the device and the strides allow them
    fast_epi: bool = False  # GeGLU of the fp32 accumulators with hardware approximations, rounded once
    pair: bool = False  # the paired kernel (one N = 2 * BLOCK_N dot per K step) where `pair_layout` allows


# Shared memory per stage: (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes.
MEDIUM = Config(64, 128, 64, 8, 4, 4)  # 65 <= M <= 256
INTERPRETER = Config(16, 16, 16, 2, 1, 1)  # several tiles and K steps at test sizes
PAIRED_LARGE = Config(128, 128, 64, 16, 8, 3, persistent=True, flatten=True, fast_epi=True, pair=True)
# (M bucket, D, H, dtype, device) -> the Config `gate_up_geglu` fell back to after OutOfResources (one stage fewer)
TUNED: dict = {}


def inference_config(M: int) -> Config:
    """The fused inference tile: the fast epilogue, paired weights above 256 rows."""
    base = INTERPRETER if INTERPRET else (MEDIUM if M <= 256 else PAIRED_LARGE)
    return base._replace(fast_epi=True)


def m_bucket(M: int) -> int:
    """Power-of-two bucket of M (capped at 8192): TUNED's row key."""
    return min(1 << max(M - 1, 1).bit_length(), 8192)


def choose_config(M: int, D: int, H: int, dtype: torch.dtype, device: torch.device) -> Config:
    return TUNED.get((m_bucket(M), D, H, dtype, device)) or inference_config(M)


def tma_aligned(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte-aligned base and row stride, and a unit stride on the last dim."""
    es = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_supported(device: torch.device) -> bool:
    return TensorDescriptor is not None and (INTERPRET or (device.type == "cuda"
                                                           and torch.cuda.get_device_capability(device)[0] >= 9))


def gate_up_geglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, tanh: bool,
                  config: Optional[Config] = None) -> torch.Tensor:
    """h [M, H] = geglu(x @ w_gate^T, x @ w_up^T) for x [M, D], weights [H, D] (fp16/bf16, unit last stride;
    validated by the caller), ValueError for D = 0 (M, H > 0). Without ``config`` (`choose_config`), OutOfResources
    retries with one pipeline stage fewer (down to 2) and records it in TUNED."""
    M, K = x.shape
    N = w_gate.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("gate_up_geglu: D = 0 is not supported by the fused kernel.")
    cfg = config or choose_config(M, K, N, x.dtype, x.device)
    use_tma = cfg.tma and tma_supported(x.device) and all(tma_aligned(t) for t in (x, w_gate, w_up, out))
    layout = pair_layout(w_gate, w_up) if use_tma and cfg.pair else None
    try:
        with device_guard(x):
            if layout is not None:
                _launch_paired(x, layout, w_gate, out, tanh, cfg)
            else:
                _launch(x, w_gate, w_up, out, tanh, use_tma, cfg)
    except triton.runtime.errors.OutOfResources:
        if config is not None or cfg.num_stages <= 2:
            raise  # an explicit config reports its failure
        TUNED[(m_bucket(M), K, N, x.dtype, x.device)] = cfg._replace(num_stages=cfg.num_stages - 1)
        return gate_up_geglu(x, w_gate, w_up, tanh)
    return out


def gate_up_consts(tanh, use_tma, cfg) -> tuple:
    return (tanh, use_tma, INTERPRET, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.persistent,
            cfg.flatten, cfg.fast_epi, K_BETA_TANH, K_KAPPA, K_ALPHA)


def paired_consts(tanh, gate_first, cfg) -> tuple:
    return (tanh, INTERPRET, gate_first, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.persistent,
            cfg.flatten, cfg.fast_epi, K_BETA_TANH, K_KAPPA, K_ALPHA)


def _grid(num_tiles: int, cfg: Config, device) -> tuple:
    return (min(num_tiles, sm_count(device)) if cfg.persistent else num_tiles,)


def _launch(x, w_gate, w_up, out, tanh, use_tma, cfg):
    (M, K), N = x.shape, w_gate.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tensors = ((x, [bm, bk]), (w_gate, [bn, bk]), (w_up, [bn, bk]), (out, [bm, bn]))
    args = [_aot.Desc(t, t.shape, t.stride(), blk) if use_tma else t for t, blk in tensors]
    strides = [t.stride(0) for t, _ in tensors]
    grid = _grid(triton.cdiv(M, bm) * triton.cdiv(N, bn), cfg, x.device)
    launch(_gate_up_geglu_kernel, grid, [*args, M, N, K, *strides], gate_up_consts(tanh, use_tma, cfg), cfg.num_warps,
           x.device, cfg.num_stages)


_TMA_MAX_STRIDE = 1 << 40  # bytes: cuTensorMapEncodeTiled's limit on a global stride


class PairLayout(NamedTuple):
    base: torch.Tensor  # the weight at the lower address
    outer_stride: int  # elements from that weight's start to the other's
    gate_first: bool  # whether the base is the gate weight


def pair_layout(w_gate: torch.Tensor, w_up: torch.Tensor) -> Optional[PairLayout]:
    """The two weights as one strided [2, H, D] tensor for a TMA descriptor, without a copy; None if they differ in
    shape, stride, dtype or device, are unaligned, overlap, interleave, or lie further apart than TMA can stride."""
    if (w_gate.shape != w_up.shape or w_gate.stride() != w_up.stride() or w_gate.dtype != w_up.dtype
            or w_gate.device != w_up.device or not (tma_aligned(w_gate) and tma_aligned(w_up))):
        return None
    delta = w_up.data_ptr() - w_gate.data_ptr()
    base, gate_first = (w_gate, True) if delta > 0 else (w_up, False)
    delta = abs(delta)
    es = w_gate.element_size()
    H, D = w_gate.shape
    extent = ((H - 1) * w_gate.stride(0) + D) * es  # bytes one weight spans
    # interleaved planes (outer stride < one plane) run the two-dot kernel
    if delta < extent or delta % 16 or delta >= _TMA_MAX_STRIDE:
        return None
    return PairLayout(base, delta // es, gate_first)


def _launch_paired(x, layout: PairLayout, w_gate, out, tanh, cfg):
    M, K = x.shape
    N = w_gate.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w_desc = _aot.Desc(layout.base, [2, N, K], [layout.outer_stride, w_gate.stride(0), 1], [2, bn, bk])
    args = [_aot.Desc(x, x.shape, x.stride(), [bm, bk]), w_desc, _aot.Desc(out, out.shape, out.stride(), [bm, bn])]
    grid = _grid(triton.cdiv(M, bm) * triton.cdiv(N, bn), cfg, x.device)
    launch(_paired_gate_up_geglu_kernel, grid, [*args, M, N, K], paired_consts(tanh, layout.gate_first, cfg),
           cfg.num_warps, x.device, cfg.num_stages)


# The build compiles every launch listed here ahead of time for sm_90+; any other launch runs Triton's JIT.
PREBUILD_MIN_ARCH = 90


def prebuild_launches() -> list:
    """The inference tiles of both kernels, fp16 and bf16; sizes are never hinted."""
    out = []
    for dt in ("bf16", "fp16"):
        for cfg, paired in ((inference_config(4096), True), (inference_config(4096), False),
                            (inference_config(128), False)):
            bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
            x, o = desc_type(dt, [bm, bk]), desc_type(dt, [bm, bn])
            for tanh in (False, True):
                if paired:
                    types = dict(x_ptr=x, w_ptr=desc_type(dt, [2, bn, bk]), out_ptr=o)
                    for gate_first in (True, False):
                        out.append(prebuild(_paired_gate_up_geglu_kernel, paired_consts(tanh, gate_first, cfg),
                                            cfg.num_warps, cfg.num_stages, types=types))
                else:
                    w = desc_type(dt, [bn, bk])
                    out.append(prebuild(_gate_up_geglu_kernel, gate_up_consts(tanh, True, cfg), cfg.num_warps,
                                        cfg.num_stages, types=dict(x_ptr=x, wg_ptr=w, wu_ptr=w, out_ptr=o)))
    return out
