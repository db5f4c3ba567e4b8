"""Eager PyTorch's GeGLU rounding sequence, emulated step by step in numpy (docs/design.md, "Numerics").

Every fp32 operation of the kernels' formulas (`runtime.gelu_math.gelu`, `gelu_grad`) is one correctly rounded
numpy float32 operation in the same order; `tl.fma` is an exactly rounded fused multiply-add (`fma32`); the
roundings to the storage dtype T are round-to-nearest-even, as eager's. The transcendental functions are the ones
the Triton interpreter evaluates (`pointwise/kernels.py`'s interpreter branch): erf, exp and tanh in fp64 (Python's
`math.erf`, numpy's `exp`, tanh as ``1 - 2 / (exp(2x) + 1)``), rounded to fp32. So on CPU tensors the interpreted
kernels must equal this emulation bit for bit: a missing or an extra rounding, another operation order or an FMA
where eager has none changes bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F32 = np.float32

# eager's constants, as C++ rounds them (the same as pointwise/kernels.py's, recomputed here)
K_BETA_TANH = F32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
K_KAPPA = F32(0.044715)
K_ALPHA = F32(1.0 / math.sqrt(2.0))
K_BETA_ERF = F32((2.0 / math.sqrt(math.pi)) * (1.0 / math.sqrt(2.0)) * 0.5)
K_3KAPPA = F32(F32(3.0) * K_KAPPA)

_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def fma32(a, b, c) -> np.ndarray:
    """round_fp32(a * b + c) with one rounding. The product of two fp32 values is exact in fp64; the sum is
    rounded to fp64 *to odd* (the error term of TwoSum decides the last bit), after which rounding to fp32 is
    correct (round-to-odd at 53 >= 24 + 2 bits is innocuous)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32), np.asarray(c, F32))
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def erf32(x):
    return _erf64(np.asarray(x, F32).astype(np.float64)).astype(F32)


def exp32(x):
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, F32).astype(np.float64)).astype(F32)


def tanh32(x):
    x64 = np.asarray(x, F32).astype(np.float64)
    with np.errstate(over="ignore"):
        return (1.0 - 2.0 / (np.exp(2.0 * x64) + 1.0)).astype(F32)


def gelu32(x, tanh: bool) -> np.ndarray:
    """`runtime.gelu_math.gelu`: eager's GELU in fp32, operation by operation."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        if tanh:
            x_cube = x * x * x
            inner = K_BETA_TANH * fma32(x_cube, K_KAPPA, x)
            return F32(0.5) * x * (F32(1.0) + tanh32(inner))
        return x * F32(0.5) * (F32(1.0) + erf32(x * K_ALPHA))


def gelu_grad32(x, tanh: bool) -> np.ndarray:
    """`runtime.gelu_math.gelu_grad`: d gelu / dx in eager gelu_backward's operation order."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        if tanh:
            x_sq = x * x
            x_cube = x_sq * x
            inner = K_BETA_TANH * fma32(x_cube, K_KAPPA, x)
            t = tanh32(inner)
            left = F32(0.5) * x
            right = F32(1.0) + t
            tanh_derivative = fma32(-t, t, F32(1.0))
            inner_derivative = K_BETA_TANH * fma32(x_sq, K_3KAPPA, F32(1.0))
            right_derivative = left * tanh_derivative * inner_derivative
            return fma32(right, F32(0.5), right_derivative)
        one_plus_erf = F32(1.0) + erf32(x * K_ALPHA)
        pdf = exp32(F32(-0.5) * x * x) * K_BETA_ERF
        return fma32(one_plus_erf, F32(0.5), x * pdf)


def f32(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a float32 numpy array (exact for fp32/fp16/bf16)."""
    return t.detach().float().cpu().numpy()


def round_to(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to ``dtype`` (round to nearest even, as eager), as a tensor."""
    return torch.from_numpy(np.ascontiguousarray(x, F32)).to(dtype)


def rounded(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """T(x) back in fp32: a storage-dtype rounding inside the sequence."""
    return f32(round_to(x, dtype))


def forward(gate: torch.Tensor, up: torch.Tensor, tanh: bool) -> torch.Tensor:
    """out = T(float(T(gelu_fp32(gate))) * float(up)), eager's `F.gelu(gate) * up`."""
    T = gate.dtype
    h = rounded(gelu32(f32(gate), tanh), T)
    return round_to(h * f32(up), T)


def backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, tanh: bool):
    """(d_gate, d_up) as eager autograd computes them: d_h = T(dy * up), d_up = T(dy * T(h)),
    d_gate = T(d_h * gelu'(gate)) (gelu_backward in fp32, rounded once)."""
    T = gate.dtype
    x, u, g = f32(gate), f32(up), f32(dy)
    h = rounded(gelu32(x, tanh), T)
    d_h = rounded(g * u, T)
    return round_to(d_h * gelu_grad32(x, tanh), T), round_to(g * h, T)


_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns (so -0.0 != +0.0), with the first differing element in the message."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}")
    a = actual.detach().cpu().contiguous().view(_INT[actual.dtype])
    e = expected.detach().cpu().contiguous().view(_INT[expected.dtype])
    bad = a != e
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ in their bits; first at {idx}: "
            f"{actual[idx].item()!r}, expected {expected[idx].item()!r}")
