"""Triton kernels for Gemma's RMSNorm (``rmsnorm.ops``): forward, backward and the weight-gradient reduction.

Per row of ``D`` elements, in fp32 with each product and sum rounded separately (no FMA contraction)::

    r  = rsqrt(sum(x * x) * fl(1/D) + eps)             # as eager's CUDA mean
    y  = T((x * r) * (offset + w))                     # offset + w rounded to fp32 first
    dxn = dy * (offset + w);  c = sum(dxn * xn) * fl(1/D)  with xn = x * r
    dx = T((dxn - xn * c) * r);  dw = W(sum over rows of dy * xn)

Only the order of the row sums differs from eager's (bound: docs/rmsnorm.md). Rows have a unit-stride last dim
and any row stride (64-bit offsets); rows up to ``MAX_FUSED_D`` stay in registers, wider ones loop over
``CHUNK``-wide slices. dw is deterministic: fp32 per-program partials, summed in a fixed order.
"""

import functools

import torch
import triton
import triton.language as tl

from ..runtime.gelu_math import INTERPRET, round_to  # noqa: F401  (INTERPRET: read by rmsnorm.ops)
from ..runtime.launch import device_guard, launch, next_pow2, pow2_up_to, prebuild, sm_count

MAX_FUSED_D = 16384  # widest row kept in registers (power of two)
CHUNK = 4096  # slice width of the looped kernels (rows wider than MAX_FUSED_D)
DW_BLOCK_G, DW_BLOCK_C = 32, 128  # the dw reduction's tile: partial rows x columns


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, stride_x, stride_y, D, EPS, INV_D, OFFSET,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SAVE_RSTD: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M).to(tl.int64) + tl.cast(pid, tl.int64) * BLOCK_M
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * INV_D + EPS)
    s = OFFSET + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = (x * r[:, None]) * s[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=mask)
    if SAVE_RSTD:
        tl.store(rstd_ptr + rows, r, mask=rmask)


@triton.jit
def _row_rstd(x_row, D, EPS, INV_D, CHUNK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of one row, the squares summed in CHUNK-wide slices."""
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for k in range(0, D, CHUNK):
        cols = k + tl.arange(0, CHUNK)
        x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += x * x
    return tl.math.rsqrt(tl.sum(acc, axis=0) * INV_D + EPS)


@triton.jit
def _fwd_looped_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, D, EPS, INV_D, OFFSET,
                       CHUNK: tl.constexpr, SAVE_RSTD: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    r = _row_rstd(x_row, D, EPS, INV_D, CHUNK)
    for k in range(0, D, CHUNK):
        cols = k + tl.arange(0, CHUNK)
        cmask = cols < D
        x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
        s = OFFSET + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, round_to((x * r) * s, y_ptr.dtype.element_ty), mask=cmask)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, r)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, stride_dy, stride_x, stride_dx, D, EPS, INV_D,
                OFFSET, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RSTD: tl.constexpr, HAS_DW: tl.constexpr):
    """Program pid of G handles row blocks pid, pid + G, ...; writes its dw partial to row pid of fp32 dwp [G, D]."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    s = OFFSET + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, G * BLOCK_M):
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + start
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RSTD:
            r = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        else:
            r = tl.math.rsqrt(tl.sum(x * x, axis=1) * INV_D + EPS)
        xn = tl.where(mask, x * r[:, None], 0.0)
        dxn = dy * s[None, :]
        c = tl.sum(dxn * xn, axis=1) * INV_D
        dx = (dxn - xn * c[:, None]) * r[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            acc += dy * xn
    if HAS_DW:
        tl.store(dwp_ptr + tl.cast(pid, tl.int64) * D + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def _bwd_looped_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, stride_dy, stride_x, stride_dx, D, EPS,
                       INV_D, OFFSET, CHUNK: tl.constexpr, HAS_RSTD: tl.constexpr, HAS_DW: tl.constexpr):
    """Rows wider than MAX_FUSED_D, one at a time in slices; accumulates into its own dwp row (caller zeroes it)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    dwp_row = dwp_ptr + tl.cast(pid, tl.int64) * D
    for row in range(pid, M, G):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_x
        dy_row = dy_ptr + row64 * stride_dy
        dx_row = dx_ptr + row64 * stride_dx
        if HAS_RSTD:
            r = tl.load(rstd_ptr + row64)
        else:
            r = _row_rstd(x_row, D, EPS, INV_D, CHUNK)
        cacc = tl.zeros([CHUNK], dtype=tl.float32)
        for k in range(0, D, CHUNK):
            cols = k + tl.arange(0, CHUNK)
            cmask = cols < D
            x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
            s = OFFSET + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            cacc += (dy * s) * (x * r)
        c = tl.sum(cacc, axis=0) * INV_D
        for k in range(0, D, CHUNK):
            cols = k + tl.arange(0, CHUNK)
            cmask = cols < D
            x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
            s = OFFSET + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            xn = x * r
            dxn = dy * s
            tl.store(dx_row + cols, round_to((dxn - xn * c) * r, dx_ptr.dtype.element_ty), mask=cmask)
            if HAS_DW:
                p = tl.load(dwp_row + cols, mask=cmask, other=0.0)
                tl.store(dwp_row + cols, p + dy * xn, mask=cmask)


@triton.jit
def _dw_kernel(dwp_ptr, dw_ptr, G, D, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """dw[cols] = W(sum over the G partial rows), in a fixed order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < D
    acc = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = tl.arange(0, BLOCK_G).to(tl.int64) + g0
        acc += tl.load(dwp_ptr + g[:, None] * D + cols[None, :], mask=(g < G)[:, None] & cmask[None, :], other=0.0)
    tl.store(dw_ptr + cols, round_to(tl.sum(acc, axis=0), dw_ptr.dtype.element_ty), mask=cmask)


@functools.lru_cache(maxsize=4096)
def f32(v: float) -> float:
    """``v`` rounded to fp32, cached."""
    return torch.tensor(v, dtype=torch.float32).item()


@functools.lru_cache(maxsize=4096)
def inv_d(D: int) -> float:
    """fl(1/D) in fp32, the factor eager's CUDA mean applies to the sum."""
    return (torch.ones((), dtype=torch.float32) / D).item()


@functools.lru_cache(maxsize=4096)
def fwd_plan(M: int, D: int, device: torch.device):
    """(grid, block_m, block_d, num_warps, looped) for the forward: up to 4096 elements per program (fewer rows
    while the grid would not cover the SMs four times), 16 per thread."""
    block_d = next_pow2(D)
    if block_d > MAX_FUSED_D:
        return (M,), 1, CHUNK, 8, True
    block_m = max(1, 4096 // block_d)
    while block_m > 1 and triton.cdiv(M, block_m) < 4 * sm_count(device):
        block_m //= 2
    num_warps = max(1, min(16, block_m * block_d // 512))
    return (triton.cdiv(M, block_m),), block_m, block_d, num_warps, False


@functools.lru_cache(maxsize=4096)
def bwd_plan(M: int, D: int, device: torch.device):
    """(grid, block_m, block_d, num_warps, looped) for the backward: 8 elements per thread (at most 32 warps),
    about one resident wave of programs looping over rows."""
    block_d = next_pow2(D)
    sms = sm_count(device)
    if block_d > MAX_FUSED_D:
        return (max(1, min(M, 2 * sms)),), 1, CHUNK, 8, True
    block_m = max(1, 2048 // block_d)
    while block_m > 1 and triton.cdiv(M, block_m) < 4 * sms:
        block_m //= 2
    num_warps = max(1, min(32, block_m * block_d // 256))
    programs = sms * max(1, 64 // num_warps)
    return (max(1, min(triton.cdiv(M, block_m), programs)),), block_m, block_d, num_warps, False


def _rows_view(t: torch.Tensor, D: int) -> torch.Tensor:
    """``t`` as [M, D] rows in logical order, unit-stride last dim: a view where possible, else a contiguous copy."""
    try:
        v = t.view(-1, D)
    except RuntimeError:
        return t.reshape(-1, D).contiguous()
    if D > 1 and v.stride(1) != 1:
        return v.contiguous()
    return v


def _row_stride(t: torch.Tensor, M: int, D: int) -> int:
    return t.stride(0) if M > 1 else D


def _memory_rows(t: torch.Tensor, like: torch.Tensor, D: int) -> bool:
    """``t`` is dense (``like = empty_like(t)`` has its strides) with a unit-stride last dim: [numel / D, D] rows."""
    return t.stride() == like.stride() and (D == 1 or t.stride(-1) == 1)


def launch_fwd(y2, x2, w, rstd, M: int, D: int, eps: float, offset: float, sx: int, sy: int) -> None:
    """y2 rows = norm(x2 rows), row strides sx, sy; rstd [M] fp32 or None."""
    grid, block_m, block_d, num_warps, looped = fwd_plan(M, D, x2.device)
    save = rstd is not None
    rstd_arg = rstd if save else y2
    with device_guard(x2):
        if looped:
            launch(_fwd_looped_kernel, grid, (x2, w, y2, rstd_arg, sx, sy, D, eps, inv_d(D), offset),
                    (block_d, save), num_warps, x2.device)
        else:
            launch(_fwd_kernel, grid, (x2, w, y2, rstd_arg, M, sx, sy, D, eps, inv_d(D), offset),
                    (block_m, block_d, save), num_warps, x2.device)


def forward(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, save_rstd: bool = False):
    """(y, rstd or None): y = empty_like(x), the norm of x's rows (x, w validated; eps, offset fp32 values); rstd
    [M] fp32 in the kernel's row order."""
    D = x.shape[-1]
    y = torch.empty_like(x)
    M = x.numel() // D if D else 0
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if save_rstd else None
    if M == 0:
        return y, rstd
    w = w.contiguous()
    if _memory_rows(x, y, D):
        launch_fwd(y, x, w, rstd, M, D, eps, offset, D, D)
        return y, rstd
    x2 = _rows_view(x, D)
    if y.is_contiguous():
        launch_fwd(y, x2, w, rstd, M, D, eps, offset, _row_stride(x2, M, D), D)
    else:  # a dense x whose last dim is strided: compute rows, then lay them out as empty_like(x)
        tmp = torch.empty((M, D), dtype=x.dtype, device=x.device)
        launch_fwd(tmp, x2, w, rstd, M, D, eps, offset, _row_stride(x2, M, D), D)
        y.copy_(tmp.view(x.shape))
    return y, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd, eps: float, offset: float,
             need_dw: bool = True):
    """(dx, dw): dx = empty_like(x), dw like w (None unless need_dw). ``rstd``: the forward's or None (recompute);
    used only when the rows are enumerated as the forward did."""
    D = x.shape[-1]
    M = x.numel() // D if D else 0
    dx = torch.empty_like(x)
    if M == 0:
        return dx, (torch.zeros_like(w) if need_dw else None)
    w = w.contiguous()
    x_memory = _memory_rows(x, dx, D)
    if x_memory and dy.stride() == x.stride():
        x2, dy2, dx2, tmp = x, dy, dx, None
        sx = sdy = sdx = D
    else:
        if x_memory and not x.is_contiguous():
            rstd = None  # forward's rows were in memory order; these are in logical order
        x2, dy2 = _rows_view(x, D), _rows_view(dy, D)
        tmp = None if dx.is_contiguous() else torch.empty((M, D), dtype=x.dtype, device=x.device)
        dx2 = dx if tmp is None else tmp
        sx, sdy, sdx = _row_stride(x2, M, D), _row_stride(dy2, M, D), D
    grid, block_m, block_d, num_warps, looped = bwd_plan(M, D, x.device)
    G = grid[0]
    dwp = None
    if need_dw:
        dwp = (torch.zeros if looped else torch.empty)((G, D), dtype=torch.float32, device=x.device)
    has_rstd = rstd is not None
    with device_guard(x):
        args = (dy2, x2, w, rstd if has_rstd else x2, dx2, dwp if need_dw else x2, M, sdy, sx, sdx, D, eps,
                inv_d(D), offset)
        if looped:
            launch(_bwd_looped_kernel, grid, args, (block_d, has_rstd, need_dw), num_warps, x.device)
        else:
            launch(_bwd_kernel, grid, args, (block_m, block_d, has_rstd, need_dw), num_warps, x.device)
        dw = None
        if need_dw:
            dw = torch.empty(D, dtype=w.dtype, device=w.device)
            launch(_dw_kernel, (triton.cdiv(D, DW_BLOCK_C),), (dwp, dw, G, D), (DW_BLOCK_G, DW_BLOCK_C), 4, x.device)
    if tmp is not None:
        dx.copy_(tmp.view(x.shape))
    return dx, dw


# The build (kerneltools.build.aot) compiles these launches ahead of time; others run Triton's JIT. Keep in step
# with fwd_plan / bwd_plan.
PREBUILD_MIN_ARCH = 80


def prebuild_launches() -> list:
    """The plans' default (block_m, block_d) for block_d 128 to ``MAX_FUSED_D``, the looped kernels and the dw
    reduction, for each dtype, with and without width hints (D and the row strides divisible by 16, or not)."""
    out = []
    flags = [(r, w) for r in (True, False) for w in (True, False)]
    for dt in ("bf16", "fp16", "fp32"):
        for width_hint in (True, False):
            hinted = ("D", "stride_x", "stride_y", "stride_dy", "stride_dx") if width_hint else ()

            def entry(fn, consts, warps, rstd=False, dw=False):  # no rstd / dw partial: the launcher passes a tensor
                types = dict(EPS="fp32", INV_D="fp32", OFFSET="fp32", rstd_ptr="*fp32" if rstd else None,
                             dwp_ptr="*fp32" if dw else None)
                return prebuild(fn, consts, warps, dtype=dt, hinted=hinted, types=types)

            block_d = 128
            while block_d <= MAX_FUSED_D:
                for block_m in pow2_up_to(max(1, 4096 // block_d)):
                    warps = max(1, min(16, block_m * block_d // 512))
                    out += [entry(_fwd_kernel, (block_m, block_d, s), warps, rstd=s) for s in (True, False)]
                for block_m in pow2_up_to(max(1, 2048 // block_d)):
                    warps = max(1, min(32, block_m * block_d // 256))
                    out += [entry(_bwd_kernel, (block_m, block_d, r, w), warps, r, w) for r, w in flags]
                block_d *= 2
            out += [entry(_fwd_looped_kernel, (CHUNK, s), 8, rstd=s) for s in (True, False)]
            out += [entry(_bwd_looped_kernel, (CHUNK, r, w), 8, r, w) for r, w in flags]
            out.append(entry(_dw_kernel, (DW_BLOCK_G, DW_BLOCK_C), 4, dw=True))
    return out
