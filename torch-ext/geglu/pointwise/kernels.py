"""Triton GeGLU kernels (forward and backward, exact and tanh GELU, fp32/fp16/bf16).

The forward is bit-identical to eager ``F.gelu(gate, approximate=...) * up`` on CUDA: the GELU rounded to the
storage dtype, then the product in fp32, rounded. Tensors are 2-D ``[M, N]`` with any row stride and a unit-stride
last dim (packed halves and chunk views need no copy); offsets are 64-bit. Contiguous operands take the flat kernels.
"""

import functools

import torch
import triton
import triton.language as tl

from ..runtime.gelu_math import (INTERPRET, K_3KAPPA, K_ALPHA, K_BETA_ERF, K_BETA_TANH, K_KAPPA,  # noqa: F401
                                 gelu, gelu_grad, round_to)
from ..runtime.launch import device_guard, launch, next_pow2, pow2_up_to, prebuild, sm_count


@triton.jit
def _geglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, M, N, stride_g, stride_u, stride_o,
                      TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    h = gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
    # as eager: gelu rounded to the storage dtype, then mul in fp32, rounded
    T = out_ptr.dtype.element_ty
    h = round_to(h, T).to(tl.float32)
    out = h * u.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], round_to(out, T), mask=mask)


@triton.jit
def _geglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, M, N, stride_dy, stride_g, stride_u, stride_dg,
                      stride_du, TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
                      K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(grad_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    T = dg_ptr.dtype.element_ty
    # mul's backward: d_h = dy * up, d_up = dy * h (h rounded, as saved), each rounded to the storage dtype
    h = round_to(gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    d_up = dy * h
    d_h = round_to(dy * u, T).to(tl.float32)
    # gelu_backward(d_h, x): fp32, rounded once
    d_gate = d_h * gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA)
    tl.store(dg_ptr + rows[:, None] * stride_dg + cols[None, :], round_to(d_gate, T), mask=mask)
    tl.store(du_ptr + rows[:, None] * stride_du + cols[None, :], round_to(d_up, T), mask=mask)


@triton.jit
def _geglu_fwd_flat_kernel(gate_ptr, up_ptr, out_ptr, n,
                           TANH: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
                           K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """Forward on contiguous tensors as one flat row of n; EVEN: BLOCK divides n (no masks); WIDE: 64-bit offsets."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(gate_ptr + offs)
        u = tl.load(up_ptr + offs)
    else:
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0)
    T = out_ptr.dtype.element_ty
    h = round_to(gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    out = round_to(h * u.to(tl.float32), T)
    if EVEN:
        tl.store(out_ptr + offs, out)
    else:
        tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _geglu_bwd_flat_kernel(grad_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, n,
                           TANH: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
                           K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
                           K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    """The backward on contiguous tensors as one flat row (as _geglu_fwd_flat_kernel)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        dy = tl.load(grad_ptr + offs).to(tl.float32)
        x = tl.load(gate_ptr + offs).to(tl.float32)
        u = tl.load(up_ptr + offs).to(tl.float32)
    else:
        mask = offs < n
        dy = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    T = dg_ptr.dtype.element_ty
    h = round_to(gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    d_up = round_to(dy * h, T)
    d_h = round_to(dy * u, T).to(tl.float32)
    d_gate = round_to(d_h * gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA), T)
    if EVEN:
        tl.store(dg_ptr + offs, d_gate)
        tl.store(du_ptr + offs, d_up)
    else:
        tl.store(dg_ptr + offs, d_gate, mask=mask)
        tl.store(du_ptr + offs, d_up, mask=mask)


def _tiles(M: int, N: int, element_size: int, device: torch.device, tensors: int):
    """(block_m, block_n, num_warps): tiles of up to 2048 elements for 2-byte dtypes, 1024 for fp32; block_n halves
    (not below 128) while the grid would not cover the SMs twice."""
    per_program = 2048 if element_size <= 2 else 1024
    block_n = min(next_pow2(N), 1024)
    block_m = max(1, min(next_pow2(M), per_program // block_n))
    waves = 2 * sm_count(device)
    while block_n > 128 and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < waves:
        block_n //= 2
    num_warps = 4 if block_m * block_n >= 1024 else 2 if block_m * block_n >= 256 else 1
    return block_m, block_n, num_warps


@functools.lru_cache(maxsize=4096)
def _plan(M: int, N: int, element_size: int, device: torch.device, tensors: int):
    """(grid, block_m, block_n, num_warps), cached per shape."""
    block_m, block_n, num_warps = _tiles(M, N, element_size, device, tensors)
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n, num_warps


# Flat kernels: (elements per program, warps) for 2-byte and 4-byte dtypes.
FLAT_TILES = {2: (2048, 4), 4: (1024, 4)}


@functools.lru_cache(maxsize=4096)
def _flat_plan(n: int, element_size: int, device: torch.device):
    """(grid, block, num_warps, even, wide) of the flat kernels for ``n`` elements, cached."""
    block, num_warps = FLAT_TILES[2 if element_size <= 2 else 4]
    sms = sm_count(device)
    while block > 256 and triton.cdiv(n, block) < 2 * sms:
        block //= 2
        num_warps = max(1, min(num_warps, block // 256))
    return (triton.cdiv(n, block),), block, num_warps, n % block == 0, n >= 2**31 - block


def _flat(M: int, N: int, *tensors: torch.Tensor) -> bool:
    """All tensors are one contiguous block of M*N elements."""
    if M == 1:
        return True
    for t in tensors:
        if t.stride(0) != N:
            return False
    return True


def geglu_fwd(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, tanh: bool) -> None:
    """out[M, N] = gelu(gate) * up on validated 2-D row-strided tensors."""
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    consts_tail = (K_BETA_TANH, K_KAPPA, K_ALPHA)
    with device_guard(gate):
        if _flat(M, N, out, gate, up):
            grid, block, num_warps, even, wide = _flat_plan(M * N, gate.element_size(), gate.device)
            launch(_geglu_fwd_flat_kernel, grid, (gate, up, out, M * N), (tanh, block, even, wide) + consts_tail,
                    num_warps, gate.device)
            return
        grid, block_m, block_n, num_warps = _plan(M, N, gate.element_size(), gate.device, 3)
        launch(_geglu_fwd_kernel, grid, (gate, up, out, M, N, gate.stride(0), up.stride(0), out.stride(0)),
                (tanh, block_m, block_n) + consts_tail, num_warps, gate.device)


def geglu_bwd(d_gate: torch.Tensor, d_up: torch.Tensor, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              tanh: bool) -> None:
    """d_gate, d_up from grad, gate, up (2-D row-strided; d_gate may alias gate and d_up alias up)."""
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    consts_tail = (K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA)
    with device_guard(gate):
        if _flat(M, N, d_gate, d_up, grad, gate, up):
            grid, block, num_warps, even, wide = _flat_plan(M * N, gate.element_size(), gate.device)
            launch(_geglu_bwd_flat_kernel, grid, (grad, gate, up, d_gate, d_up, M * N),
                    (tanh, block, even, wide) + consts_tail, num_warps, gate.device)
            return
        grid, block_m, block_n, num_warps = _plan(M, N, gate.element_size(), gate.device, 5)
        launch(_geglu_bwd_kernel, grid,
                (grad, gate, up, d_gate, d_up, M, N, grad.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0),
                 d_up.stride(0)), (tanh, block_m, block_n) + consts_tail, num_warps, gate.device)


# The build (kerneltools.build.aot) compiles these launches ahead of time; others run Triton's JIT. Keep in step
# with the plans above.
PREBUILD_MIN_ARCH = 80


def prebuild_launches() -> list:
    """The flat kernels at every ``_flat_plan`` tile, the row kernels at ``_tiles``' tiles with block_n >= 128, for
    each dtype and GELU flavour."""
    out = []
    kf = (K_BETA_TANH, K_KAPPA, K_ALPHA)
    kb = kf + (K_BETA_ERF, K_3KAPPA)
    row_hints = ("N", "stride_g", "stride_u", "stride_o", "stride_dy", "stride_dg", "stride_du")
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        largest, warps = FLAT_TILES[es]  # `_flat_plan` halves the block down to 256 elements
        flat_plans = [(b, max(1, min(warps, b // 256))) for b in reversed(pow2_up_to(largest)) if b >= 256]
        per_program = 2048 if es <= 2 else 1024
        for tanh in (False, True):
            for block, warps in flat_plans:
                for even in (True, False):
                    for hinted in ((("n",),) if even else (("n",), ())):  # n divisible by 16, or not
                        out.append(prebuild(_geglu_fwd_flat_kernel, (tanh, block, even, False) + kf, warps, dtype=dt,
                                            hinted=hinted))
                        out.append(prebuild(_geglu_bwd_flat_kernel, (tanh, block, even, False) + kb, warps, dtype=dt,
                                            hinted=hinted))
            for block_n in (128, 256, 512, 1024):
                for block_m in pow2_up_to(per_program // block_n):
                    warps = 4 if block_m * block_n >= 1024 else 2 if block_m * block_n >= 256 else 1
                    for fn, k in ((_geglu_fwd_kernel, kf), (_geglu_bwd_kernel, kb)):
                        out.append(prebuild(fn, (tanh, block_m, block_n) + k, warps, dtype=dt, hinted=row_hints))
    return out
