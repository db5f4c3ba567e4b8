"""torch.library custom ops (namespace from `_ops.add_op_namespace_prefix`), each with a fake implementation and,
for the functional forms, autograd; so `torch.compile(fullgraph=True)` sees them as opaque ops and
`torch.library.opcheck` passes. The real implementations pick the compiled CUDA library, Triton or the CPU
implementation per call (see `runtime.backend`)."""

from typing import Tuple

import torch
from torch import Tensor

from ..runtime import backend as _backend
from . import cpu as _cpu
from ..runtime import direct as _direct
from ..runtime.checks import check_backward, check_packed, check_split, is_tanh
from .._ops import add_op_namespace_prefix, ops

_triton_mod = None


def _triton():
    global _triton_mod
    if _triton_mod is None:
        from . import kernels as mod

        _triton_mod = mod
    return _triton_mod


# --- 2-D row views --------------------------------------------------------------------------------------------


def _rows(t: Tensor, n: int) -> Tensor:
    """``t[..., n]`` as a 2-D ``[M, n]`` tensor with one row stride, without a copy when the leading dims allow it
    (contiguous tensors, packed halves, chunk views); a copy otherwise (inputs only)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


_CUDA_FWD = ops.geglu_fwd.default if _backend.HAS_CUDA_LIB else None
_CUDA_BWD = ops.geglu_bwd.default if _backend.HAS_CUDA_LIB else None
_DIRECT = _direct.AVAILABLE


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
    """(gate, up) of a packed ``x[..., 2d]``: views split as the hosts split it (``chunk``), so that where autograd
    records them the backward is one SplitBackward node concatenating the two gradients; two slices would each
    scatter into a zero-filled [..., 2d] gradient and add them (more GPU time: copies and fills)."""
    a, b = x.chunk(2, dim=-1)
    return (a, b) if act_first else (b, a)


def forward_into(out: Tensor, gate: Tensor, up: Tensor, approximate: str, fresh_out: bool = False) -> None:
    """``fresh_out``: the caller allocated ``out`` (so it overlaps no input)."""
    if out.numel() == 0:
        return
    d = gate.shape[-1]
    g2, u2 = _rows(gate, d), _rows(up, d)
    if out.dim() == 2:
        out2 = out
    else:
        try:
            out2 = out.view(-1, d)
        except RuntimeError:
            out2 = None
    if out2 is not None:
        _run_fwd(out2, g2, u2, approximate, fresh_out)
    else:  # an out= tensor whose leading dims cannot be flattened: compute, then copy into it
        tmp = torch.empty(g2.shape, dtype=out.dtype, device=out.device)
        _run_fwd(tmp, g2, u2, approximate, True)
        out.copy_(tmp.view(out.shape))


def backward_into(d_gate: Tensor, d_up: Tensor, grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    """d_gate/d_up are tensors we allocated (or gate/up themselves, or halves of a packed gradient or input):
    always viewable as rows."""
    if gate.numel() == 0:
        return
    d = gate.shape[-1]
    _run_bwd(d_gate.view(-1, d), d_up.view(-1, d), _rows(grad, d), _rows(gate, d), _rows(up, d), approximate)


def _viewable(t: Tensor, d: int) -> bool:
    if t.numel() == 0:
        return True
    try:
        t.view(-1, d)
        return True
    except RuntimeError:
        return False


# --- forward ops ------------------------------------------------------------------------------------------------


@torch.library.custom_op(add_op_namespace_prefix("geglu"), mutates_args=())
def geglu(gate: Tensor, up: Tensor, approximate: str, inplace_backward: bool) -> Tensor:
    check_split(gate, up, approximate)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    forward_into(out, gate, up, approximate, True)
    return out


@geglu.register_fake
def _(gate, up, approximate, inplace_backward):
    check_split(gate, up, approximate)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op(add_op_namespace_prefix("geglu_packed"), mutates_args=())
def geglu_packed(x: Tensor, approximate: str, act_first: bool, inplace_backward: bool) -> Tensor:
    d = check_packed(x, approximate)
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    gate, up = packed_halves(x, act_first)
    forward_into(out, gate, up, approximate, True)
    return out


@geglu_packed.register_fake
def _(x, approximate, act_first, inplace_backward):
    d = check_packed(x, approximate)
    return torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)


@torch.library.custom_op(add_op_namespace_prefix("geglu_out"), mutates_args=("out",))
def geglu_out(out: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    check_split(gate, up, approximate, out)
    forward_into(out, gate, up, approximate)


@geglu_out.register_fake
def _(out, gate, up, approximate):
    check_split(gate, up, approximate, out)


# --- backward ops -----------------------------------------------------------------------------------------------


def backward_new(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    check_backward(grad, gate, up, approximate)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    backward_into(d_gate, d_up, grad, gate, up, approximate)
    return d_gate, d_up


def backward_inplace(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    check_backward(grad, gate, up, approximate)
    d = gate.shape[-1]
    if not (_viewable(gate, d) and _viewable(up, d)):
        raise ValueError("geglu: in-place backward needs gate and up whose leading dims flatten to rows without a copy.")
    backward_into(gate, up, grad, gate, up, approximate)


def packed_backward_new(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> Tensor:
    check_packed(x, approximate)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    gate, up = packed_halves(x, act_first)
    d_gate, d_up = packed_halves(dx, act_first)
    check_backward(grad, gate, up, approximate)
    backward_into(d_gate, d_up, grad, gate, up, approximate)
    return dx


def packed_backward_inplace(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> None:
    d = check_packed(x, approximate)
    gate, up = packed_halves(x, act_first)
    check_backward(grad, gate, up, approximate)
    if not _viewable(gate, d):
        raise ValueError("geglu: in-place backward needs an x whose leading dims flatten to rows without a copy.")
    backward_into(gate, up, grad, gate, up, approximate)


@torch.library.custom_op(add_op_namespace_prefix("geglu_backward"), mutates_args=())
def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    return backward_new(grad, gate, up, approximate)


@geglu_backward.register_fake
def _(grad, gate, up, approximate):
    check_backward(grad, gate, up, approximate)
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


@torch.library.custom_op(add_op_namespace_prefix("geglu_backward_"), mutates_args=("gate", "up"))
def geglu_backward_(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> None:
    """In-place backward: d_gate is written over gate and d_up over up."""
    backward_inplace(grad, gate, up, approximate)


@geglu_backward_.register_fake
def _(grad, gate, up, approximate):
    check_backward(grad, gate, up, approximate)


@torch.library.custom_op(add_op_namespace_prefix("geglu_packed_backward"), mutates_args=())
def geglu_packed_backward(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> Tensor:
    return packed_backward_new(grad, x, approximate, act_first)


@geglu_packed_backward.register_fake
def _(grad, x, approximate, act_first):
    check_packed(x, approximate)
    gate, up = packed_halves(x, act_first)
    check_backward(grad, gate, up, approximate)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op(add_op_namespace_prefix("geglu_packed_backward_"), mutates_args=("x",))
def geglu_packed_backward_(grad: Tensor, x: Tensor, approximate: str, act_first: bool) -> None:
    """In-place packed backward: the gradient w.r.t. x is written over x."""
    packed_backward_inplace(grad, x, approximate, act_first)


@geglu_packed_backward_.register_fake
def _(grad, x, approximate, act_first):
    check_packed(x, approximate)
    gate, up = packed_halves(x, act_first)
    check_backward(grad, gate, up, approximate)


# --- autograd ---------------------------------------------------------------------------------------------------


def _setup_split(ctx, inputs, output):
    gate, up, approximate, inplace_backward = inputs
    ctx.save_for_backward(gate, up)
    ctx.approximate = approximate
    ctx.inplace_backward = inplace_backward


def _contiguous_last_dim(grad: Tensor) -> Tensor:
    # Gradients from autograd can be expanded (stride 0, e.g. after .sum()) or transposed.
    if grad.dim() and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


def _inplace_ok(*tensors: Tensor, packed: bool = False) -> bool:
    """Whether the in-place backward may write over the saved tensors: always for plain (and fake) tensors; for
    DTensors only where all share one placement, the same along every mesh dim, and (``packed``) not a shard of the
    packed last dim (DTensor cannot redistribute the tensors an op writes into: `_sharding`). Elsewhere the
    out-of-place backward runs."""
    placements = getattr(tensors[0], "placements", None)
    if placements is None:
        return True
    if packed and any(p.is_shard(tensors[-1].dim() - 1) for p in placements):
        return False
    return len(set(placements)) == 1 and all(getattr(t, "placements", None) == placements for t in tensors[1:])


def _backward_split(ctx, grad):
    grad = _contiguous_last_dim(grad)
    gate, up = ctx.saved_tensors
    if ctx.inplace_backward and _inplace_ok(grad, gate, up):
        geglu_backward_(grad, gate, up, ctx.approximate)
        return gate, up, None, None
    d_gate, d_up = geglu_backward(grad, gate, up, ctx.approximate)
    return d_gate, d_up, None, None


geglu.register_autograd(_backward_split, setup_context=_setup_split)


def _setup_packed(ctx, inputs, output):
    x, approximate, act_first, inplace_backward = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate
    ctx.act_first = act_first
    ctx.inplace_backward = inplace_backward


def _backward_packed(ctx, grad):
    grad = _contiguous_last_dim(grad)
    (x,) = ctx.saved_tensors
    if ctx.inplace_backward and _inplace_ok(grad, x, packed=True):
        geglu_packed_backward_(grad, x, ctx.approximate, ctx.act_first)
        return x, None, None, None
    return geglu_packed_backward(grad, x, ctx.approximate, ctx.act_first), None, None, None


geglu_packed.register_autograd(_backward_packed, setup_context=_setup_packed)


# --- eager autograd -----------------------------------------------------------------------------------------------
# The same forward and backward as the ops' registered autograd, as plain autograd.Functions calling the
# implementations directly. Eager calls that record a gradient use these (functional.py): the custom op's Python
# autograd layer costs the host far more per forward+backward than the kernels take at decode and small-batch
# sizes. torch.compile, tracing and functorch transforms keep the ops.


class EagerGeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, approximate, inplace_backward):
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        forward_into(out, gate, up, approximate, True)
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if _DIRECT:
            grads = _direct.lean_bwd(grad, gate, up, is_tanh(ctx.approximate), ctx.inplace_backward)
            if grads is not None:
                return grads[0], grads[1], None, None
        grad = _contiguous_last_dim(grad)
        if ctx.inplace_backward:
            backward_inplace(grad, gate, up, ctx.approximate)
            return gate, up, None, None
        d_gate, d_up = backward_new(grad, gate, up, ctx.approximate)
        return d_gate, d_up, None, None


class EagerGeGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate, act_first, inplace_backward):
        d = check_packed(x, approximate)
        out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
        gate, up = packed_halves(x, act_first)
        forward_into(out, gate, up, approximate, True)
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        ctx.act_first = act_first
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = _contiguous_last_dim(grad)
        (x,) = ctx.saved_tensors
        if ctx.inplace_backward:
            packed_backward_inplace(grad, x, ctx.approximate, ctx.act_first)
            return x, None, None, None
        return packed_backward_new(grad, x, ctx.approximate, ctx.act_first), None, None, None


# autograd.Function.apply's Python wrapper (default-argument binding, functorch checks: several µs a call) is
# skipped: callers use these only outside functorch transforms, with positional arguments.
eager_geglu = super(torch.autograd.Function, EagerGeGLU).apply
eager_geglu_packed = super(torch.autograd.Function, EagerGeGLUPacked).apply
