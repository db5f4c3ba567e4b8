"""Gemma's RMSNorm, fused: ``rms_norm(x, weight, eps, offset=1.0)`` (transformers' ``GemmaRMSNorm``), and Gemma 3n /
Gemma 4's form (``scaled_layer_forward``: offset 0, optional weight).

CUDA tensors run the Triton kernels (not bit-exact: the row sum is taken in another order, bound in
docs/rmsnorm.md; dw is deterministic). CPU tensors run eager's ops in the host's order (bit-exact, forward and
backward), or the Triton kernels with ``set_backend("triton")`` and ``TRITON_INTERPRET=1``. Traced calls and
tensor subclasses run the torch.library op; plain eager calls run the implementation directly.
"""

from typing import Tuple

import torch
from torch import Tensor

from ..runtime import backend as _backend
from ..runtime.checks import SUPPORTED_DTYPES
from ..runtime.library import fast_apply, op
from .._ops import add_op_namespace_prefix

_grad_enabled = torch.is_grad_enabled
_OK_DTYPES = frozenset(SUPPORTED_DTYPES)

_triton = _backend.lazy_module(".kernels", __package__)


def _ok(x: Tensor, weight: Tensor) -> bool:
    """The common valid call, checked in one pass."""
    return (x.dtype in _OK_DTYPES and weight.dtype in _OK_DTYPES and weight.dim() == 1 and x.dim() > 0
            and weight.shape[0] == x.shape[-1] and weight.device == x.device)


def check_rms_norm(x: Tensor, weight: Tensor) -> None:
    """x [..., D] and weight [D], each float32/float16/bfloat16, on one device; else TypeError/ValueError."""
    if isinstance(x, Tensor) and isinstance(weight, Tensor) and _ok(x, weight):
        return
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"geglu.rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype not in _OK_DTYPES:
            raise TypeError(f"geglu.rms_norm: {name} has dtype {t.dtype}; expected torch.float32, torch.float16 or "
                            f"torch.bfloat16. Cast it first, e.g. {name}.to(torch.bfloat16).")
    if x.dim() == 0:
        raise ValueError("geglu.rms_norm: x is a 0-dim tensor; expected at least one dimension (the normalized "
                         "last dimension).")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"geglu.rms_norm: weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},), "
                         f"one scale per element of x's last dimension (x has shape {tuple(x.shape)}).")
    if weight.device != x.device:
        raise ValueError(f"geglu.rms_norm: x is on {x.device} but weight is on {weight.device}; expected one device. "
                         "Move them with .to(device).")


def _check_grad(grad: Tensor, x: Tensor) -> None:
    if not isinstance(grad, Tensor) or grad.dtype not in _OK_DTYPES:
        what = grad.dtype if isinstance(grad, Tensor) else type(grad).__name__
        raise TypeError(f"geglu.rms_norm_backward: grad must be a float32/float16/bfloat16 tensor, got {what}.")
    if grad.shape != x.shape or grad.device != x.device:
        raise ValueError(f"geglu.rms_norm_backward: grad has shape {tuple(grad.shape)} on {grad.device}; expected "
                         f"x's shape {tuple(x.shape)} on {x.device}.")


def _as_float(v, name: str) -> float:
    if type(v) is float:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"geglu.rms_norm: {name} must be a float, got {type(v).__name__}.")
    return float(v)


def host_forward(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
    """The host module's own math, op for op."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.float())).type_as(x)


cpu_forward = host_forward  # the CPU implementation; under autograd, eager records these ops itself


def _sum_to(t: Tensor, dims) -> Tensor:
    return t.sum(dims, keepdim=True) if dims else t


def cpu_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tuple[Tensor, Tensor]:
    """(dx, dw) of host_forward as eager autograd computes them (derivatives.yaml formulas and sum_to, in the
    engine's order), for the ops' backward on CPU tensors."""
    xf = x.float()
    wf = weight.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xn = xf * r
    s = offset + wf
    gz = grad.float()  # y = z.type_as(x): _to_copy's backward
    lead = list(range(x.dim() - 1))
    dw = _sum_to(gz * xn, lead).view(weight.shape)  # z = xn * s, other's gradient, summed to s's shape
    g_xn = gz * s  # ... and self's
    b = g_xn * r  # xn = xf * r: self's gradient
    g_r = _sum_to(g_xn * xf, [x.dim() - 1])  # other's, summed to r's [..., 1]
    g_m = -0.5 * g_r * r.pow(3)  # rsqrt: -0.5 * grad * result.pow(3); the + eps passes it on
    g_p = g_m.expand(xf.shape) / x.shape[-1]  # mean: grad.expand(sizes) / n
    c = g_p * (2.0 * xf.pow(1.0))  # pow(2): grad * (exponent * self.pow(exponent - 1))
    return (b + c).to(x.dtype), dw.to(weight.dtype)


def _use_triton(x: Tensor) -> bool:
    """Whether the Triton kernels take x; raises for unsupported devices or CPU 'triton' without the interpreter."""
    if x.is_cuda:
        return True
    if x.device.type != "cpu":
        raise NotImplementedError(f"geglu.rms_norm: tensors on {x.device.type!r} are not supported; expected CUDA "
                                  "or CPU tensors.")
    if _backend.get_backend() != "triton":
        return False
    if not _triton().INTERPRET:
        raise RuntimeError("geglu.rms_norm: the 'triton' backend got CPU tensors; Triton runs them only under its "
                           "interpreter (TRITON_INTERPRET=1 set before importing triton). Use set_backend('auto') "
                           "for the CPU implementation.")
    return True


def _backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float, rstd=None,
              need_dw: bool = True) -> Tuple[Tensor, Tensor]:
    """(dx, dw) for validated inputs; ``rstd``: the forward's [rows] fp32, or None to recompute."""
    if _use_triton(x):
        t = _triton()
        return t.backward(grad, x, weight, rstd, t.f32(eps), t.f32(offset), need_dw)
    return cpu_backward(grad, x, weight, eps, offset)


def _like(result: Tensor, ref: Tensor) -> Tensor:
    """``result`` laid out as ``torch.empty_like(ref)`` (the fake implementations' layout)."""
    out = torch.empty_like(ref)
    if out.stride() == result.stride():
        return result
    out.copy_(result)
    return out


@op(add_op_namespace_prefix("rms_norm"))
def rms_norm_op(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    check_rms_norm(x, weight)
    if _use_triton(x):
        t = _triton()
        return _like(t.forward(x, weight, t.f32(eps), t.f32(offset))[0], x)
    return _like(cpu_forward(x, weight, eps, offset), x)


@rms_norm_op.register_fake
def _(x, weight, eps, offset):
    check_rms_norm(x, weight)
    return torch.empty_like(x)


@op(add_op_namespace_prefix("rms_norm_backward"))
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tuple[Tensor, Tensor]:
    """(dx, dw) of ``rms_norm`` (the rstd recomputed from x)."""
    check_rms_norm(x, weight)
    _check_grad(grad, x)
    dx, dw = _backward(grad, x, weight, eps, offset)
    return _like(dx, x), _like(dw, weight)


@rms_norm_backward.register_fake
def _(grad, x, weight, eps, offset):
    check_rms_norm(x, weight)
    _check_grad(grad, x)
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, ctx.eps, ctx.offset = inputs
    ctx.save_for_backward(x, weight)


def _norm_backward(ctx, grad):
    """Backward of both routes: the implementation for plain tensors (with a saved rstd), else the backward op."""
    x, weight, *rstd = ctx.saved_tensors
    if _backend.call_mode(grad, x, weight) == _backend.OP:
        dx, dw = rms_norm_backward(grad, x, weight, ctx.eps, ctx.offset)
        return dx, dw, None, None
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _backward(grad, x, weight, ctx.eps, ctx.offset, rstd[0] if rstd else None, need_dw)
    return (dx if need_dx else None), dw, None, None


rms_norm_op.register_autograd(_norm_backward, setup_context=_setup)


class RMSNormFunction(torch.autograd.Function):
    """The op's autograd for plain eager Triton calls; the forward also saves rstd ([rows] fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        t = _triton()
        y, rstd = t.forward(x, weight, t.f32(eps), t.f32(offset), True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.offset = eps, offset
        return y

    backward = staticmethod(torch.autograd.function.once_differentiable(_norm_backward))


_apply = fast_apply(RMSNormFunction)


def _plain_eager(x, weight) -> bool:
    """Plain tensors (or Parameters), not traced (``runtime.backend.call_mode``)."""
    return _backend.call_mode(x, weight) != _backend.OP


def _run(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    if not _use_triton(x):
        return cpu_forward(x, weight, eps, offset)
    if _grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _apply(x, weight, eps, offset)
    t = _triton()
    return t.forward(x, weight, t.f32(eps), t.f32(offset))[0]


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 1.0) -> Tensor:
    """Computes ``(x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)).type_as(x)`` in fp32, as transformers'
    ``GemmaRMSNorm`` (``offset=1.0``; ``0.0`` scales by ``weight``).

    Shapes: x ``[..., D]`` (any layout), weight ``[D]``, each float32/float16/bfloat16 -> x's shape and dtype,
    laid out like ``torch.empty_like(x)``. Differentiable in x and weight (dw summed in fp32, deterministic).
    """
    eps, offset = _as_float(eps, "eps"), _as_float(offset, "offset")
    check_rms_norm(x, weight)
    if _plain_eager(x, weight):
        return _run(x, weight, eps, offset)
    return rms_norm_op(x, weight, eps, offset)


def layer_forward(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``GemmaRMSNorm.forward`` outside torch.compile: the implementation for plain eager calls on supported
    tensors, the host's own math otherwise."""
    if _plain_eager(x, weight) and (x.is_cuda or x.is_cpu) and _ok(x, weight):
        return _run(x, weight, eps if type(eps) is float else _as_float(eps, "eps"), 1.0)
    return host_forward(x, weight, eps)


# Gemma3nRMSNorm's form: scale ``w`` (offset 0), r = pow(ms, -0.5) in the host; without a weight the kernels
# scale by ones (exact in fp32).
def scaled_host_forward(x: Tensor, weight, eps: float) -> Tensor:
    """``Gemma3nRMSNorm.forward``, op for op; ``weight`` None for ``with_scale=False``."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


_UNIT_SCALES: dict = {}  # (D, dtype, device) -> ones(D)


def _unit_scale(x: Tensor):
    """Cached ones(D) in x's dtype and device; None if not cached yet during CUDA graph capture."""
    key = (x.shape[-1], x.dtype, x.device)
    w = _UNIT_SCALES.get(key)
    if w is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        w = _UNIT_SCALES[key] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return w


def scaled_layer_forward(x: Tensor, weight, eps: float) -> Tensor:
    """``Gemma3nRMSNorm.forward`` outside torch.compile: the kernels for plain eager calls on CUDA (and CPU under the
    'triton' backend), the host's own math otherwise."""
    if (x.is_cuda or (x.is_cpu and _backend.get_backend() == "triton")) and x.dim() > 0:
        w = weight if weight is not None else _unit_scale(x)
        if w is not None and _plain_eager(x, w) and _ok(x, w):
            return _run(x, w, eps if type(eps) is float else _as_float(eps, "eps"), 0.0)
    return scaled_host_forward(x, weight, eps)
