"""``GeGLUMLP``'s training step: the eager autograd node :class:`GeGLUMLPFunction` and the ops ``geglu_mlp_train`` /
``geglu_mlp_train_backward``, with eager's bits (its GEMM calls, one add for dx, eager's rounding). The node holds
g, u, h [M, H] (through ``save_for_backward`` only under saved-tensor hooks); its backward overwrites them (at most
3 [M, H] buffers live), so it runs once: ``retain_graph=True`` raises.
"""

import math
from typing import Tuple

import torch
from torch import Tensor

from ..pointwise import ops as _pw
from ..runtime import backend as _backend
from ..runtime import library as _library
from .._ops import add_op_namespace_prefix
from .inference import _FLOATS, _check


def host_bound(x: Tensor, w_gate: Tensor) -> bool:
    """A CUDA step under the 'auto' backend of fewer than ``NODE_EAGER_BELOW`` [M, H] elements: the host's ops run."""
    return x.is_cuda and _backend.eager_autograd(x.numel() // max(x.shape[-1], 1) * w_gate.shape[0],
                                                 _backend.NODE_EAGER_BELOW)


def node_applies(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> bool:
    """Whether the node takes an AUTOGRAD-mode call: CUDA/CPU, one float dtype and device, x [..., D] (2+ dims),
    weights [H, D], [H, D], [D_out, H] with H, D > 0, no autocast."""
    if x.dim() < 2 or w_gate.dim() != 2:
        return False
    dev = x.device
    if dev.type not in ("cuda", "cpu") or x.dtype not in _FLOATS or torch.is_autocast_enabled(dev.type):
        return False
    for w in (w_gate, w_up, w_down):
        if w.dtype != x.dtype or w.device != dev or w.dim() != 2:
            return False
    H, D = w_gate.shape
    return w_up.shape == w_gate.shape and D == x.shape[-1] and w_down.shape[1] == H and H > 0 and D > 0


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_active() -> bool:
    """Saved-tensor hooks (checkpointing, offloading) in force: they must see the activations."""
    return _top_hooks is None or _top_hooks(False) is not None


def _forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str):
    """(y [..., D_out], g, u, h [M, H]) with eager's GEMM calls (F.linear's matmul of [..., D] as [M, D])."""
    x2 = x.reshape(-1, x.shape[-1])
    g = torch.mm(x2, w_gate.t())
    u = torch.mm(x2, w_up.t())
    h = torch.empty_like(g)
    _pw.forward_into(h, g, u, approximate, True)
    return torch.mm(h, w_down.t()).view(x.shape[:-1] + (w_down.shape[0],)), g, u, h


class GeGLUMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, approximate):
        y, g, u, h = _forward(x, w_gate, w_up, w_down, approximate)
        ctx.approximate = approximate
        ctx.ran = False
        if _hooks_active():
            ctx.save_for_backward(x, w_gate, w_up, w_down, g, u, h)
            ctx.held = None
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
            ctx.held = [g, u, h]
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        if ctx.ran:
            raise RuntimeError(
                "GeGLUMLP: this training step's backward already ran, and it reuses the saved activations' memory "
                "for the gradients, so it cannot run twice (retain_graph=True). Run the forward again, or compute "
                "both gradients in one backward call.")
        ctx.ran = True
        if ctx.held is None:
            x, w_gate, w_up, w_down, g, u, h = ctx.saved_tensors
        else:
            x, w_gate, w_up, w_down = ctx.saved_tensors
            g, u, h = ctx.held
            ctx.held = None  # the locals are now the only references: `del` frees each buffer
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dwd = torch.mm(dy2.t(), h) if need_wd else None  # h's last reader
        x2 = x.reshape(-1, x.shape[-1])
        d_h = torch.mm(dy2, w_down, out=h)  # written over h
        del h
        _pw.backward_into(g, u, d_h, g, u, ctx.approximate)  # [d_g, d_u] written over g and u
        del d_h
        d_g, d_u = g, u
        del g, u
        dx = dwg = dwu = None
        if need_x:
            dx = torch.mm(d_g, w_gate)
        if need_wg:
            dwg = torch.mm(d_g.t(), x2)
        del d_g
        if need_x:
            dx = dx.add_(torch.mm(d_u, w_up)).view(x.shape)  # one add in the storage dtype, as autograd sums
        if need_wu:
            dwu = torch.mm(d_u.t(), x2)
        return dx, dwg, dwu, dwd, None


_apply = _library.fast_apply(GeGLUMLPFunction)  # positional args; `call_mode` has excluded functorch transforms


@_library.op(add_op_namespace_prefix("geglu_mlp_train"))
def geglu_mlp_train(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                    approximate: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The training forward: (y [..., D_out], g, u, h [M, H]), the activations the backward needs."""
    _check(x, w_gate, w_up, w_down, approximate)
    return _forward(x, w_gate, w_up, w_down, approximate)


@geglu_mlp_train.register_fake
def _(x, w_gate, w_up, w_down, approximate):
    _check(x, w_gate, w_up, w_down, approximate)
    M, H = math.prod(x.shape[:-1]), w_gate.shape[0]
    return (x.new_empty(x.shape[:-1] + (w_down.shape[0],)), x.new_empty((M, H)), x.new_empty((M, H)),
            x.new_empty((M, H)))


_EMPTY = (0,)


@_library.op(add_op_namespace_prefix("geglu_mlp_train_backward"))
def geglu_mlp_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, g: Tensor,
                             u: Tensor, h: Tensor, approximate: str, need_x: bool, need_wg: bool, need_wu: bool,
                             need_wd: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW_gate, dW_up, dW_down), a 0-element tensor for each gradient not needed; g, u, h unmodified."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dwd = torch.mm(dy2.t(), h) if need_wd else x.new_empty(_EMPTY)
    d_h = torch.mm(dy2, w_down)
    d_u = torch.empty_like(d_h)
    _pw.backward_into(d_h, d_u, d_h, g, u, approximate)  # d_g over d_h: each element read before it is written
    d_g = d_h
    dx = torch.mm(d_g, w_gate).add_(torch.mm(d_u, w_up)).view(x.shape) if need_x else x.new_empty(_EMPTY)
    dwg = torch.mm(d_g.t(), x2) if need_wg else x.new_empty(_EMPTY)
    dwu = torch.mm(d_u.t(), x2) if need_wu else x.new_empty(_EMPTY)
    return dx, dwg, dwu, dwd


@geglu_mlp_train_backward.register_fake
def _(dy, x, w_gate, w_up, w_down, g, u, h, approximate, *need):
    """Each gradient asked for shaped like its input, a 0-element tensor for the others."""
    return tuple(t.new_empty(t.shape if n else _EMPTY) for t, n in zip((x, w_gate, w_up, w_down), need))


def _train_setup(ctx, inputs, output):
    """output is (y, g, u, h): the activations are saved after the inputs, non-differentiable."""
    x, w_gate, w_up, w_down, approximate = inputs
    acts = output[1:]
    ctx.mark_non_differentiable(*acts)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w_gate, w_up, w_down, *acts)
    ctx.approximate = approximate


def _train_backward(ctx, dy, *_activation_grads):
    if dy is None:
        return None, None, None, None, None
    need = ctx.needs_input_grad[:4]
    grads = geglu_mlp_train_backward(dy.contiguous(), *ctx.saved_tensors, ctx.approximate, *need)
    return tuple(gr if n else None for gr, n in zip(grads, need)) + (None,)


geglu_mlp_train.register_autograd(_train_backward, setup_context=_train_setup)
