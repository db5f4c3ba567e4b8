"""``GeGLUMLP``'s training step: one autograd node in eager mode (:class:`GeGLUMLPFunction`) and, for torch.compile,
tracing and tensor subclasses, the operators ``geglu_mlp_train`` / ``geglu_mlp_train_backward`` (the node's
computation) and ``geglu_mlp_train_fused`` / ``geglu_mlp_train_fused_backward`` (the ``fused_training`` setting).

The node:

* **Same bits as eager.** The forward calls ``torch.mm`` exactly as ``F.linear`` does (2-D rows, ``W.t()``), the
  GeGLU kernel equals ``F.gelu(g) * u`` bit for bit, and the backward makes the GEMM calls autograd's ``MmBackward``
  makes (``dy @ W`` for the input, ``dy^T @ input`` for the weight) and sums x's two gradients with one add, as
  autograd does; our dGeGLU kernel has eager's rounding.
* **Less memory.** Eager holds g, gelu(g), u and h until the backward, and its down projection's backward allocates
  d_h while they are alive (4 [M, H] buffers). Here the forward holds g, u and h; the backward computes dW_down
  first, writes d_h over h, then d_g, d_u over g, u, and frees each buffer after its last GEMM: at most 3 live.
* The activations are attributes of the node (so that the backward can free them one by one) unless saved-tensor
  hooks are active (activation checkpointing, CPU offloading): then they go through ``save_for_backward`` and the
  hooks see them. The backward overwrites what it unpacks, so it cannot run twice (``retain_graph=True`` raises).
* With the ``fused_training`` setting, where the Gluon backward runs (sm_90, a Triton with Gluon): the forward is
  the fused gate/up GEMM saving ``gelu(g)`` and ``u * gelu'(g)`` from its fp32 accumulators, the backward's
  ``dY @ Wd`` is the Gluon kernel whose epilogue multiplies d_h by them, and dx is summed inside the second GEMM
  (``addmm_``), dW_gate and dW_up as one GEMM of N = 2H. Not eager's bits; more accurate against fp32.

Under torch.compile a training step calls ``geglu_mlp_train`` (the default node's computation: eager's bits) or,
with the ``fused_training`` setting, an fp16/bf16 x on sm_90 (or CPU tensors under the interpreter), the fused
ops ``geglu_mlp_train_fused`` / ``geglu_mlp_train_fused_backward``: the fused node's kernels, the backward writing
d_g, d_u to a new buffer (an op that wrote over its saved input would make Inductor copy it first).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..pointwise import ops as _pw
from ..runtime import backend as _backend
from ..runtime import config as _config
from ..runtime import library as _library
from .._ops import add_op_namespace_prefix
from ..runtime.checks import is_tanh
from .inference import _FLOATS, _LOW, _check, _gluon_backward, _kernels, _rows, _unit_last, fused_kernel_applies

def host_bound(x: Tensor, w_gate: Tensor) -> bool:
    """A small CUDA step under the 'auto' backend (fewer than ``runtime.backend.NODE_EAGER_BELOW`` [M, H] elements):
    host-bound, and a Python autograd node costs the host more than eager's C++ ones."""
    return x.is_cuda and _backend.eager_autograd(x.numel() // max(x.shape[-1], 1) * w_gate.shape[0],
                                                 _backend.NODE_EAGER_BELOW)


def node_applies(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> bool:
    """For a plain eager call that records a gradient (``runtime.backend.call_mode`` said AUTOGRAD: plain tensors, no
    tracing, grad enabled, an input requiring grad), whether the step can run as one node: CUDA/CPU tensors of one
    float dtype and device, nn.Linear-shaped weights ([H, D], [H, D], [D_out, H]), no autocast."""
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


def _fused_training(x2: Tensor, setting: Optional[bool] = None):
    """(fused-MLP kernel module, Gluon backward module) where the fused training step applies to these rows (the
    ``fused_training`` setting, or ``setting`` where the caller decided it; the fused gate/up kernel; on CUDA the
    Gluon backward and TMA), else None. CPU tensors under the Triton interpreter (tests) get (module, None): the
    fused forward, and the backward's products after cuBLAS's d_h."""
    if not (_config.current.fused_training if setting is None else setting) or not fused_kernel_applies(x2):
        return None
    if x2.device.type != "cuda":
        return _kernels(), None
    ws = _gluon_backward(x2.device)
    if ws is None or not _kernels().tma_supported(x2.device):
        return None
    return _kernels(), ws


def traced_fused_training(x: Tensor) -> bool:
    """Under torch.compile (and tracing), whether a training step calls the fused training ops: the
    ``fused_training`` setting, an fp16/bf16 x, and a device the fused kernels are written for (sm_90; CPU tensors
    with the backend 'triton', for the interpreter). Decided from the dtype and device only (no shape guard); the
    op then checks the rows when it runs (`_fused_training`)."""
    if not _config.current.fused_training or x.dtype not in _LOW:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_properties(x.device).major == 9
    return x.device.type == "cpu" and _config.current.backend == "triton"


class GeGLUMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, approximate):
        x2 = x.reshape(-1, x.shape[-1])  # what F.linear's matmul does with [..., D]
        fused = _fused_training(x2)
        if fused is not None:
            kt, ws = fused
            H = w_gate.shape[0]
            # g, u hold gelu(g) and u * gelu'(g): the backward's dGeGLU is two products
            h, gu = kt.gate_up_geglu(x2.contiguous(), w_gate.contiguous(), w_up.contiguous(), is_tanh(approximate),
                                     True, deriv=True)
            g, u = gu[:, :H], gu[:, H:]
        else:
            g = torch.mm(x2, w_gate.t())
            u = torch.mm(x2, w_up.t())
            h = torch.empty_like(g)
            _pw.forward_into(h, g, u, approximate, True)
        y = torch.mm(h, w_down.t())
        ctx.fused = fused
        ctx.approximate = approximate
        ctx.ran = False
        if _hooks_active():
            ctx.save_for_backward(x, w_gate, w_up, w_down, g, u, h)
            ctx.held = None
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
            ctx.held = [g, u, h]
        return y.view(x.shape[:-1] + (w_down.shape[0],))

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
            ctx.held = None  # from here on the locals are the only references: `del` frees each buffer
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dwd = torch.mm(dy2.t(), h) if need_wd else None  # h's last reader
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.fused is not None:
            del h
            d_g, d_u = _fused_backward_dgeglu(ctx.fused[0], ctx.fused[1], dy2, w_down, g, u, ctx.approximate)
            del g, u
            held = [d_g, d_u]  # the helper's list is then the only reference: it frees d_g after its last GEMM
            del d_g, d_u
            return _grads_accumulated(held, x, x2, w_gate, w_up, need_x, need_wg, need_wu) + (dwd, None)
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


def _fused_backward_dgeglu(kt, ws, dy2: Tensor, w_down: Tensor, g: Tensor, u: Tensor, approximate: str,
                           out: Optional[Tuple[Tensor, Tensor]] = None):
    """(d_g, d_u) from g, u holding gelu(g) and u * gelu'(g): the Gluon kernel's ``dY @ Wd`` with the two products
    in its epilogue, written over them (d_g over g, d_u over u) or into ``out`` = (d_g, d_u), laid out as g, u are;
    where TMA cannot read dY (unaligned) or there is no Gluon kernel (``ws`` None), cuBLAS's d_h and two products
    (in place, d_g then lives in u's buffer and d_u in g's; or into ``out``)."""
    dy2 = dy2.contiguous()
    w_down = w_down.contiguous()
    if ws is not None and dy2.shape[0] and all(kt.tma_aligned(t) for t in (dy2, w_down, g, u, *(out or ()))):
        with torch.cuda.device(dy2.device):
            ws.down_dgeglu_ws(dy2, w_down, g, u, is_tanh(approximate), deriv=True, out=out)
        return out if out is not None else (g, u)
    d_h = torch.mm(dy2, w_down)
    if out is not None:
        return torch.mul(d_h, u, out=out[0]), torch.mul(d_h, g, out=out[1])
    u.mul_(d_h)  # d_gate = d_h * (u * gelu'(g))
    g.mul_(d_h)  # d_up = d_h * gelu(g)
    return u, g


def _packed(d_g: Tensor, d_u: Tensor) -> Optional[Tensor]:
    """[d_g | d_u] as one [M, 2H] tensor when the two are its column halves (the fused forward's buffer), else None."""
    M, H = d_g.shape
    if (d_u.shape == d_g.shape and d_g.stride() == d_u.stride() == (2 * H, 1)
            and d_u.data_ptr() == d_g.data_ptr() + H * d_g.element_size()):
        return d_g.as_strided((M, 2 * H), (2 * H, 1))
    return None


def _grads_accumulated(held, x, x2, w_gate, w_up, need_x, need_wg, need_wu, one_gemm: bool = True):
    """(dx, dW_gate, dW_up) from held = [d_g, d_u]: x's two gradient terms summed in the second GEMM's fp32
    accumulator (addmm_), and (``one_gemm``) the weight gradients as one GEMM with N = 2H where d_g, d_u are the
    halves of one buffer (the two gradients are then views of one tensor: ops, whose outputs must not alias, pass
    False). Frees d_g after its last GEMM."""
    d_g, d_u = held
    held.clear()
    gu = _packed(d_g, d_u) if one_gemm and need_wg and need_wu else None
    H = d_g.shape[1]
    dx = dwg = dwu = None
    if need_x:
        dx = torch.mm(d_g, w_gate)
    if need_wg and gu is None:
        dwg = torch.mm(d_g.t(), x2)
    del d_g  # its last reader (packed, gu still holds the buffer for the one weight-gradient GEMM)
    if dx is not None:
        dx = dx.addmm_(d_u, w_up).view(x.shape)
    if gu is not None:
        dw = torch.mm(gu.t(), x2)  # [2H, D]: rows [0, H) are dW_gate, [H, 2H) dW_up
        return dx, dw[:H], dw[H:]
    if need_wu:
        dwu = torch.mm(d_u.t(), x2)
    return dx, dwg, dwu


# autograd.Function.apply's Python wrapper (argument binding, functorch checks) is skipped: `call_mode` has already
# excluded functorch transforms, and the arguments are positional.
_apply = super(torch.autograd.Function, GeGLUMLPFunction).apply



# --- operators --------------------------------------------------------------------------------------------------------


@_library.op(add_op_namespace_prefix("geglu_mlp_train"))
def geglu_mlp_train(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                    approximate: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The training forward: (y, g, u, h), with g, u, h [M, H] the activations the backward needs (the default
    node's computation: eager's bits)."""
    _check(x, w_gate, w_up, w_down, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    g = torch.mm(x2, w_gate.t())
    u = torch.mm(x2, w_up.t())
    h = torch.empty_like(g)
    _pw.forward_into(h, g, u, approximate, True)
    y = torch.mm(h, w_down.t())
    return y.view(x.shape[:-1] + (w_down.shape[0],)), g, u, h


@geglu_mlp_train.register_fake
def _(x, w_gate, w_up, w_down, approximate):
    _check(x, w_gate, w_up, w_down, approximate)
    M, H = _rows(x), w_gate.shape[0]
    return (x.new_empty(x.shape[:-1] + (w_down.shape[0],)), x.new_empty((M, H)), x.new_empty((M, H)),
            x.new_empty((M, H)))


_EMPTY = (0,)


@_library.op(add_op_namespace_prefix("geglu_mlp_train_backward"))
def geglu_mlp_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, g: Tensor,
                             u: Tensor, h: Tensor, approximate: str, need_x: bool, need_wg: bool, need_wu: bool,
                             need_wd: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW_gate, dW_up, dW_down) of the training forward, with eager's GEMM calls and rounding (a 0-element
    tensor for each gradient not needed). d_g is written over the d_h buffer it is computed from."""
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


def _fake_grads(x, w_gate, w_up, w_down, need_x, need_wg, need_wu, need_wd):
    """The training backward ops' fake result: each gradient asked for like its input, a 0-element tensor for the
    others."""
    def grad(t, need):
        return t.new_empty(t.shape) if need else t.new_empty(_EMPTY)

    return grad(x, need_x), grad(w_gate, need_wg), grad(w_up, need_wu), grad(w_down, need_wd)


@geglu_mlp_train_backward.register_fake
def _(dy, x, w_gate, w_up, w_down, g, u, h, approximate, *need):
    return _fake_grads(x, w_gate, w_up, w_down, *need)


def _train_setup(ctx, inputs, output):
    """Both training ops' autograd setup: output is (y, *activations), the activations saved after the inputs."""
    x, w_gate, w_up, w_down, approximate = inputs
    acts = output[1:]
    ctx.mark_non_differentiable(*acts)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w_gate, w_up, w_down, *acts)
    ctx.approximate = approximate


def _train_backward_with(backward_op):
    """A training op's autograd formula: ``backward_op(dy, x, w_gate, w_up, w_down, *activations, approximate,
    *needs)`` on what `_train_setup` saved."""
    def backward(ctx, dy, *_activation_grads):
        if dy is None:
            return None, None, None, None, None
        x, w_gate, w_up, w_down, *acts = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        grads = backward_op(dy.contiguous(), x, w_gate, w_up, w_down, *acts, ctx.approximate, *need)
        return tuple(gr if n else None for gr, n in zip(grads, need)) + (None,)

    return backward


geglu_mlp_train.register_autograd(_train_backward_with(geglu_mlp_train_backward), setup_context=_train_setup)


# --- the fused training step under torch.compile (the ``fused_training`` setting) --------------------------------


@_library.op(add_op_namespace_prefix("geglu_mlp_train_fused"))
def geglu_mlp_train_fused(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                          approximate: str) -> Tuple[Tensor, Tensor, Tensor]:
    """The fused training forward: (y, gu, h) with gu [M, 2H]. Where the fused step applies to these rows
    (`_fused_training`), the fused gate/up GEMM saves gu = [gelu(g) | u * gelu'(g)] from its fp32 accumulators (the
    eager node's fused forward); elsewhere gu = [g | u], eager's GEMMs. The backward op makes the same decision
    from the same rows, so it knows which gu holds."""
    _check(x, w_gate, w_up, w_down, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    if _fused_training(x2, True) is not None:
        h, gu = _kernels().gate_up_geglu(x2.contiguous(), _unit_last(w_gate), _unit_last(w_up), is_tanh(approximate),
                                         True, deriv=True)
    else:
        g, u = torch.mm(x2, w_gate.t()), torch.mm(x2, w_up.t())
        h = torch.empty_like(g)
        _pw.forward_into(h, g, u, approximate, True)
        gu = torch.cat((g, u), 1)
    y = torch.mm(h, w_down.t())
    return y.view(x.shape[:-1] + (w_down.shape[0],)), gu, h


@geglu_mlp_train_fused.register_fake
def _(x, w_gate, w_up, w_down, approximate):
    _check(x, w_gate, w_up, w_down, approximate)
    M, H = _rows(x), w_gate.shape[0]
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],)), x.new_empty((M, 2 * H)), x.new_empty((M, H))


@_library.op(add_op_namespace_prefix("geglu_mlp_train_fused_backward"))
def geglu_mlp_train_fused_backward(dy: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, gu: Tensor,
                                   h: Tensor, approximate: str, need_x: bool, need_wg: bool, need_wu: bool,
                                   need_wd: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW_gate, dW_up, dW_down) of the fused training forward (a 0-element tensor for each gradient not
    needed): the eager node's fused backward (the Gluon ``dY @ Wd`` with the dGeGLU's products in its epilogue, dX
    summed in the second GEMM), or eager's where the forward was. d_g, d_u go to a new [M, 2H] buffer: gu is only
    read (an op that wrote over it would make Inductor copy it first)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    H = w_gate.shape[0]
    dwd = torch.mm(dy2.t(), h) if need_wd else x.new_empty(_EMPTY)
    g, u = gu[:, :H], gu[:, H:]
    d_gu = torch.empty_like(gu)
    out = (d_gu[:, :H], d_gu[:, H:])
    fused = _fused_training(x2, True)
    if fused is not None:
        d_g, d_u = _fused_backward_dgeglu(fused[0], fused[1], dy2, w_down, g, u, approximate, out)
    else:
        d_h = torch.mm(dy2, w_down)
        _pw.backward_into(out[0], out[1], d_h, g, u, approximate)
        d_g, d_u = out
    held = [d_g, d_u]
    del d_g, d_u, g, u, out, d_gu
    dx, dwg, dwu = _grads_accumulated(held, x, x2, w_gate, w_up, need_x, need_wg, need_wu, one_gemm=False)
    return tuple(t if need else x.new_empty(_EMPTY)
                 for t, need in ((dx, need_x), (dwg, need_wg), (dwu, need_wu))) + (dwd,)


@geglu_mlp_train_fused_backward.register_fake
def _(dy, x, w_gate, w_up, w_down, gu, h, approximate, *need):
    return _fake_grads(x, w_gate, w_up, w_down, *need)


geglu_mlp_train_fused.register_autograd(_train_backward_with(geglu_mlp_train_fused_backward),
                                       setup_context=_train_setup)


__all__ = ["node_applies", "host_bound", "GeGLUMLPFunction", "geglu_mlp_train", "geglu_mlp_train_backward",
           "geglu_mlp_train_fused", "geglu_mlp_train_fused_backward", "traced_fused_training"]
