"""The GeGLU torch.library ops (each with a fake implementation) and their autograd.

:class:`GeGLUFunction` / :class:`GeGLUPackedFunction` hold the one autograd formula: plain eager calls apply them,
the ops register the same context (``_setup_split`` / ``_setup_packed``) and backward. The backward runs the
implementation for plain tensors, the backward ops when traced or for tensor subclasses. ``runtime.backend`` picks
CUDA library, Triton or CPU per call."""

from typing import Tuple

import torch
from torch import Tensor

from ..runtime import backend as _backend
from ..runtime import config as _config
from ..runtime import direct as _direct
from ..runtime.checks import check_backward, check_packed, check_split, is_tanh
from ..runtime.library import fast_apply, op
from .._ops import add_op_namespace_prefix, ops
from . import cpu as _cpu

_triton = _backend.lazy_module(".kernels", __package__)


def _row_view(t: Tensor, n: int):
    """``t[..., n]`` as a 2-D ``[M, n]`` view with one row stride, or None where the leading dims do not flatten."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, n)
    except RuntimeError:
        return None


def _rows(t: Tensor, n: int) -> Tensor:
    """:func:`_row_view`, else a copy."""
    v = _row_view(t, n)
    return v if v is not None else t.reshape(-1, n)


_CUDA_FWD = ops.geglu_fwd.default if _backend.HAS_CUDA_LIB else None
_CUDA_BWD = ops.geglu_bwd.default if _backend.HAS_CUDA_LIB else None
_DIRECT = _direct.AVAILABLE
_LIB_BELOW, _TANH, _LIB_DTYPES = _backend.CUDA_LIB_BELOW, {"none": False, "tanh": True}, _direct.DTYPES


def _flat_lib(t: Tensor, approximate: str, *others: Tensor) -> bool:
    """Whether a call on ``t`` and ``others`` runs the compiled library on the flat elements: contiguous CUDA tensors
    of ``t``'s dtype, shape and device, at least one dim, 0 < numel < ``CUDA_LIB_BELOW``, a valid ``approximate``, the C entry points
    loaded and the backend not 'triton'. Such a call needs no other check."""
    if not (_DIRECT and t.is_cuda and t.dim() and 0 < t.numel() < _LIB_BELOW and t.dtype in _LIB_DTYPES and approximate in _TANH
            and t.is_contiguous() and _config.current.backend != "triton"):
        return False
    shape, dtype, device = t.shape, t.dtype, t.get_device()
    for o in others:
        if o.shape != shape or o.dtype != dtype or not o.is_contiguous() or o.get_device() != device:
            return False
    return True


def _run_fwd(out2: Tensor, g2: Tensor, u2: Tensor, approximate: str, fresh_out: bool = False) -> None:
    impl = _backend.impl_for(g2.device.type, g2.numel())
    if impl == "cuda":
        tanh = is_tanh(approximate)
        if not (_DIRECT and _direct.fwd(out2, g2, u2, tanh, fresh_out)):
            _CUDA_FWD(out2, g2, u2, tanh)
    elif impl == "triton":
        _check_triton_device(g2)
        _triton().geglu_fwd(out2, g2, u2, is_tanh(approximate))
    else:
        _cpu.geglu_fwd(out2, g2, u2, approximate)


def _run_bwd(dg2: Tensor, du2: Tensor, dy2: Tensor, g2: Tensor, u2: Tensor, approximate: str) -> None:
    impl = _backend.impl_for(g2.device.type, g2.numel())
    if impl == "cuda":
        tanh = is_tanh(approximate)
        if not (_DIRECT and _direct.bwd(dg2, du2, dy2, g2, u2, tanh)):
            _CUDA_BWD(dg2, du2, dy2, g2, u2, tanh)
    elif impl == "triton":
        _check_triton_device(g2)
        _triton().geglu_bwd(dg2, du2, dy2, g2, u2, is_tanh(approximate))
    else:
        _cpu.geglu_bwd(dg2, du2, dy2, g2, u2, approximate)


def _check_triton_device(t: Tensor) -> None:
    if t.device.type != "cuda" and not _triton().INTERPRET:
        raise RuntimeError(
            "geglu: the 'triton' backend got CPU tensors; Triton runs them only under its interpreter "
            "(TRITON_INTERPRET=1 set before importing triton). Use set_backend('auto') for the CPU implementation."
        )


def packed_halves(x: Tensor, act_first: bool) -> Tuple[Tensor, Tensor]:
    """(gate, up) views of a packed ``x[..., 2d]``, split with ``chunk`` as the hosts do (one SplitBackward node)."""
    a, b = x.chunk(2, dim=-1)
    return (a, b) if act_first else (b, a)


def forward_into(out: Tensor, gate: Tensor, up: Tensor, approximate: str, fresh_out: bool = False) -> None:
    """``out = gelu(gate) * up`` for validated inputs; ``fresh_out``: the caller allocated ``out`` (no overlap)."""
    if out.numel() == 0:
        return
    d = gate.shape[-1]
    g2, u2 = _rows(gate, d), _rows(up, d)
    out2 = _row_view(out, d)
    if out2 is not None:
        _run_fwd(out2, g2, u2, approximate, fresh_out)
    else:  # out's leading dims do not flatten: compute, then copy
        tmp = torch.empty(g2.shape, dtype=out.dtype, device=out.device)
        _run_fwd(tmp, g2, u2, approximate, True)
        out.copy_(tmp.view(out.shape))


def backward_into(d_gate: Tensor, d_up: Tensor, grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    """Gradients into d_gate/d_up, which must view as rows (fresh tensors, gate/up themselves or packed halves)."""
    if gate.numel() == 0:
        return
    d = gate.shape[-1]
    _run_bwd(d_gate.view(-1, d), d_up.view(-1, d), _rows(grad, d), _rows(gate, d), _rows(up, d), approximate)


def _viewable(t: Tensor, d: int) -> bool:
    return t.numel() == 0 or _row_view(t, d) is not None


_empty_like, _contiguous = torch.empty_like, torch.contiguous_format


def new_packed_output(x: Tensor, approximate: str, act_first: bool, d: int) -> Tensor:
    """``gelu(gate) * up`` of x's halves in a new tensor, for a validated ``x`` (``d = check_packed(x, approximate)``)."""
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    gate, up = packed_halves(x, act_first)
    forward_into(out, gate, up, approximate, True)
    return out


def geglu_impl(gate: Tensor, up: Tensor, approximate: str, check: bool = True) -> Tensor:
    """The ``geglu`` op's implementation, which plain eager callers call directly: validates (``check_split``; not
    with ``check=False``, for validated inputs), then ``gelu(gate) * up`` in a new contiguous tensor (contiguous
    inputs at library sizes: one C call)."""
    if _flat_lib(gate, approximate, up):
        return _direct.flat_fwd(gate, up, _TANH[approximate])
    if check:
        check_split(gate, up, approximate)
    out = _empty_like(gate, memory_format=_contiguous)
    forward_into(out, gate, up, approximate, True)
    return out


@op(add_op_namespace_prefix("geglu"))
def geglu(gate: Tensor, up: Tensor, approximate: str, inplace_backward: bool) -> Tensor:
    return geglu_impl(gate, up, approximate)


@geglu.register_fake
def _(gate, up, approximate, inplace_backward):
    check_split(gate, up, approximate)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@op(add_op_namespace_prefix("geglu_packed"))
def geglu_packed(x: Tensor, approximate: str, act_first: bool, inplace_backward: bool) -> Tensor:
    return new_packed_output(x, approximate, act_first, check_packed(x, approximate))


@geglu_packed.register_fake
def _(x, approximate, act_first, inplace_backward):
    d = check_packed(x, approximate)
    return torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)


@op(add_op_namespace_prefix("geglu_out"), mutates_args=("out",))
def geglu_out(out: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    check_split(gate, up, approximate, out)
    forward_into(out, gate, up, approximate)


@geglu_out.register_fake
def _(out, gate, up, approximate):
    check_split(gate, up, approximate, out)


def backward_new(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    """``geglu_backward``'s implementation: validates, then (d_gate, d_up) in new tensors."""
    if _flat_lib(gate, approximate, up, grad):
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(gate)
        _direct.flat_bwd(d_gate, d_up, grad, gate, up, _TANH[approximate])
        return d_gate, d_up
    check_backward(grad, gate, up, approximate)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    backward_into(d_gate, d_up, grad, gate, up, approximate)
    return d_gate, d_up


def backward_inplace(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    """``geglu_backward_``'s implementation: validates, then d_gate written over gate and d_up over up."""
    if _flat_lib(gate, approximate, up, grad) and abs(gate.data_ptr() - up.data_ptr()) >= gate.nbytes:
        _direct.flat_bwd(gate, up, grad, gate, up, _TANH[approximate])
        return
    check_backward(grad, gate, up, approximate)
    d = gate.shape[-1]
    if not (_viewable(gate, d) and _viewable(up, d)):
        raise ValueError("geglu: in-place backward needs gate and up whose leading dims flatten to rows without a copy.")
    backward_into(gate, up, grad, gate, up, approximate)


def _check_packed_backward(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> None:
    check_packed(x, approximate)
    gate, up = packed_halves(x, act_first)
    check_backward(grad, gate, up, approximate)


def packed_backward_new(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> Tensor:
    """``geglu_packed_backward``'s implementation: validates, then the gradient of x in a new tensor."""
    _check_packed_backward(grad, x, approximate, act_first)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    gate, up = packed_halves(x, act_first)
    d_gate, d_up = packed_halves(dx, act_first)
    backward_into(d_gate, d_up, grad, gate, up, approximate)
    return dx


def packed_backward_inplace(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> None:
    """``geglu_packed_backward_``'s implementation: validates, then the gradient of x written over x."""
    _check_packed_backward(grad, x, approximate, act_first)
    gate, up = packed_halves(x, act_first)
    if not _viewable(gate, gate.shape[-1]):
        raise ValueError("geglu: in-place backward needs an x whose leading dims flatten to rows without a copy.")
    backward_into(gate, up, grad, gate, up, approximate)


# The backward ops are their implementations, registered as they are.
geglu_backward = op(add_op_namespace_prefix("geglu_backward"))(backward_new)
geglu_backward_ = op(add_op_namespace_prefix("geglu_backward_"), mutates_args=("gate", "up"))(backward_inplace)
geglu_packed_backward = op(add_op_namespace_prefix("geglu_packed_backward"))(packed_backward_new)
geglu_packed_backward_ = op(add_op_namespace_prefix("geglu_packed_backward_"), mutates_args=("x",))(
    packed_backward_inplace)
geglu_backward_.register_fake(check_backward)
geglu_packed_backward_.register_fake(_check_packed_backward)


@geglu_backward.register_fake
def _(grad, gate, up, approximate):
    check_backward(grad, gate, up, approximate)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@geglu_packed_backward.register_fake
def _(grad, x, approximate, act_first):
    _check_packed_backward(grad, x, approximate, act_first)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _contiguous_last_dim(grad: Tensor) -> Tensor:
    # autograd's gradients can be expanded (stride 0) or transposed
    if grad.dim() and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


def _inplace_ok(*tensors: Tensor, packed: bool = False) -> bool:
    """Whether the in-place backward may write over the saved tensors: always for plain tensors; for DTensors only
    when all share one placement on every mesh dim and (``packed``) none shards the last dim."""
    placements = getattr(tensors[0], "placements", None)
    if placements is None:
        return True
    if packed and any(p.is_shard(tensors[-1].dim() - 1) for p in placements):
        return False
    return len(set(placements)) == 1 and all(getattr(t, "placements", None) == placements for t in tensors[1:])


def _eager(*tensors: Tensor) -> bool:
    """The backward runs the implementation (plain tensors, not traced), not the backward ops."""
    return _backend.call_mode(*tensors) != _backend.OP


def _backward_split(ctx, grad):
    gate, up = ctx.saved_tensors
    approximate, inplace = ctx.approximate, ctx.inplace_backward
    eager = _eager(grad, gate, up)
    grad = _contiguous_last_dim(grad)
    if inplace and _inplace_ok(grad, gate, up):
        (backward_inplace if eager else geglu_backward_)(grad, gate, up, approximate)
        return gate, up, None, None
    d_gate, d_up = (backward_new if eager else geglu_backward)(grad, gate, up, approximate)
    return d_gate, d_up, None, None


def _backward_packed(ctx, grad):
    (x,) = ctx.saved_tensors
    approximate, act_first = ctx.approximate, ctx.act_first
    eager = _eager(grad, x)
    grad = _contiguous_last_dim(grad)
    if ctx.inplace_backward and _inplace_ok(grad, x, packed=True):
        (packed_backward_inplace if eager else geglu_packed_backward_)(grad, x, approximate, act_first)
        return x, None, None, None
    dx = (packed_backward_new if eager else geglu_packed_backward)(grad, x, approximate, act_first)
    return dx, None, None, None


def _setup_split(ctx, inputs, output):
    gate, up, ctx.approximate, ctx.inplace_backward = inputs
    ctx.save_for_backward(gate, up)


class GeGLUFunction(torch.autograd.Function):
    """``geglu``'s autograd, for validated inputs (``check_split``): the op registers the same context
    (``_setup_split``, which ``forward`` does in place: one Python call fewer a step) and backward."""

    @staticmethod
    def forward(ctx, gate, up, approximate, inplace_backward):
        ctx.approximate, ctx.inplace_backward = approximate, inplace_backward
        ctx.save_for_backward(gate, up)
        return geglu_impl(gate, up, approximate, False)

    backward = staticmethod(torch.autograd.function.once_differentiable(_backward_split))


def _setup_packed(ctx, inputs, output):
    x, ctx.approximate, ctx.act_first, ctx.inplace_backward = inputs
    ctx.save_for_backward(x)


class GeGLUPackedFunction(torch.autograd.Function):
    """``geglu_packed``'s autograd, for a validated ``x`` (``check_packed``), with the op's context
    (``_setup_packed``, done in ``forward``) and backward."""

    @staticmethod
    def forward(ctx, x, approximate, act_first, inplace_backward):
        ctx.approximate, ctx.act_first, ctx.inplace_backward = approximate, act_first, inplace_backward
        ctx.save_for_backward(x)
        return new_packed_output(x, approximate, act_first, x.shape[-1] // 2)

    backward = staticmethod(torch.autograd.function.once_differentiable(_backward_packed))


geglu.register_autograd(_backward_split, setup_context=_setup_split)
geglu_packed.register_autograd(_backward_packed, setup_context=_setup_packed)
apply_geglu = fast_apply(GeGLUFunction)
apply_geglu_packed = fast_apply(GeGLUPackedFunction)
