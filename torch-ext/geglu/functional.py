"""The public GeGLU functions. Each validates its input and works under torch.compile(fullgraph=True), in eager
mode and with autograd, on CUDA (compiled library or Triton) and CPU.

Two routes per op: traced calls and tensor subclasses run the torch.library op; plain eager calls run the op's
implementation directly, through the op's ``autograd.Function`` when a gradient is recorded
(``runtime.backend.call_mode`` decides)."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .runtime import backend as _backend
from .runtime import config as _config
from .pointwise import ops as _impl
from ._activations import APPROXIMATIONS, gelu_approximation
from .runtime.checks import check_packed, check_split
from ._ops import ops

_grad_enabled = torch.is_grad_enabled
_mode = _backend.call_mode
_OP, _PLAIN, _AUTOGRAD = _backend.OP, _backend.PLAIN, _backend.AUTOGRAD
_EAGER_BELOW = _backend.AUTOGRAD_EAGER_BELOW


def _no_autograd_with_out(*tensors: Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "geglu: out= is for inference and does not record a gradient, but an input requires grad. "
            "Call it without out= (or under torch.no_grad())."
        )


def geglu(gate: Tensor, up: Tensor, approximate: str = "none", *, out: Optional[Tensor] = None,
          inplace_backward: bool = False) -> Tensor:
    """Computes ``gelu(gate, approximate) * up``, bit-identical to eager ``F.gelu(gate, approximate=...) * up``.

    Shapes: gate, up ``[..., d]`` (same shape, dtype float32/float16/bfloat16 and device; rows may be strided, the
    last dim must be unit-stride) -> ``[..., d]``. ``approximate``: ``"none"`` (erf) or ``"tanh"``.
    ``out``: a Tensor written with the result (inference only: RuntimeError if an input requires grad).
    ``inplace_backward=True``: the backward writes the gradients over ``gate`` and ``up`` (only when nothing
    else reads them afterwards).
    """
    if out is None:
        if (gate.requires_grad and type(gate) is Tensor and gate.is_cuda and gate.dim() and up.shape == gate.shape
                and up.dtype == gate.dtype and gate.numel() < _EAGER_BELOW and _config.current.backend == "auto"
                and approximate in APPROXIMATIONS and _grad_enabled() and not _backend.traced()):
            # small CUDA call with a gradient (_backend.AUTOGRAD_EAGER_BELOW): eager's own ops
            return F.gelu(gate, approximate=approximate) * up
        mode = _mode(gate, up)
        if mode == _PLAIN:
            return _impl.geglu_impl(gate, up, approximate)
        if mode == _OP:
            return ops.geglu.default(gate, up, approximate, inplace_backward)
        check_split(gate, up, approximate)
        if gate.is_cuda and _backend.eager_autograd(gate.numel()):
            return F.gelu(gate, approximate=approximate) * up
        return _impl.apply_geglu(gate, up, approximate, inplace_backward)
    if not isinstance(out, Tensor):
        raise TypeError(f"geglu: out must be a torch.Tensor (or None), got {type(out).__name__}.")
    if _mode(gate, up, out) == _PLAIN:
        check_split(gate, up, approximate, out)
        _impl.forward_into(out, gate, up, approximate)
        return out
    _no_autograd_with_out(gate, up)
    ops.geglu_out.default(out, gate, up, approximate)
    return out


def geglu_packed(x: Tensor, approximate: str = "none", *, act_first: bool = True, out: Optional[Tensor] = None,
                 inplace_backward: bool = False) -> Tensor:
    """GeGLU of a packed ``x``: ``gelu(x[..., :d]) * x[..., d:]`` (``act_first=True``, vLLM / ModernBERT layout) or
    ``x[..., :d] * gelu(x[..., d:])`` (``act_first=False``, diffusers' GEGLU).

    Shapes: x ``[..., 2d]`` -> ``[..., d]``; the gradient is one ``[..., 2d]`` tensor (written over ``x`` with
    ``inplace_backward=True``). ``approximate`` and ``out`` as in :func:`geglu`.
    """
    if out is not None:
        _no_autograd_with_out(x)
        check_packed(x, approximate, out)
        gate, up = _impl.packed_halves(x, act_first)
        return geglu(gate, up, approximate, out=out)
    mode = _mode(x)
    if mode == _OP:
        return ops.geglu_packed.default(x, approximate, act_first, inplace_backward)
    d = check_packed(x, approximate)
    if mode == _PLAIN:
        return _impl.new_packed_output(x, approximate, act_first, d)
    if x.is_cuda and _backend.eager_autograd(x.numel() // 2):
        gate, up = _impl.packed_halves(x, act_first)
        return F.gelu(gate, approximate=approximate) * up
    return _impl.apply_geglu_packed(x, approximate, act_first, inplace_backward)


def gelu_and_mul(out: Tensor, x: Tensor) -> Tensor:
    """kernels-community/activation's ``gelu_and_mul(out, x)``: exact GELU of the first half times the second."""
    return geglu_packed(x, "none", out=out)


def gelu_tanh_and_mul(out: Tensor, x: Tensor) -> Tensor:
    """kernels-community/activation's ``gelu_tanh_and_mul(out, x)``: tanh GELU of the first half times the second."""
    return geglu_packed(x, "tanh", out=out)


def gated_proj(act, gate: torch.Tensor, up_proj, x: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``act(gate) * up_proj(x)``: the kernel when ``act`` is a GELU it computes, else the host's own math; under
    torch.compile always the host's math, in the host's order (activation first), for Inductor to fuse. The
    kernel's backward writes the gradients over ``gate`` and ``up_proj(x)`` unless ``inplace_backward=False``."""
    if torch.compiler.is_compiling():
        activated = act(gate)
        return activated * up_proj(x)
    up = up_proj(x)
    approximate = gelu_approximation(act)
    if approximate is None:
        return act(gate) * up
    return geglu(gate, up, approximate, inplace_backward=inplace_backward)


def gated_packed(act, x: torch.Tensor, act_first: bool, inplace_backward: bool = True) -> torch.Tensor:
    """``act(a) * b`` (``act_first``) or ``a * act(b)`` of ``a, b = x.chunk(2, -1)``, routed as :func:`gated_proj`
    (the backward writes over ``x`` unless ``inplace_backward=False``)."""
    approximate = None if torch.compiler.is_compiling() else gelu_approximation(act)
    if approximate is None:
        a, b = x.chunk(2, dim=-1)
        return act(a) * b if act_first else a * act(b)
    return geglu_packed(x, approximate, act_first=act_first, inplace_backward=inplace_backward)


def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str = "none"):
    """Gradients ``(d_gate, d_up)`` of :func:`geglu`, with eager autograd's rounding."""
    if _mode(grad, gate, up) == _PLAIN:
        return _impl.backward_new(grad, gate, up, approximate)
    return ops.geglu_backward.default(grad, gate, up, approximate)
