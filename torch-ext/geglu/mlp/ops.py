"""``GeGLUMLP``'s computation, ``y = down(gelu(x @ Wg^T, approximate) * (x @ Wu^T))``, in every mode.

:func:`geglu_mlp` is the one entry point (the layer calls it for plain bias-free projections):

* **Eager inference** (no gradient): ``F.linear`` for the projections and our pointwise kernel, eager's bits; with
  the ``fused_mlp`` setting (default), fp16/bf16 CUDA inputs of more than ``DECODE_MAX_M`` rows take the fused gate/up
  GEMM (the GeGLU in its epilogue, ``mlp.kernels``) where the shipped rule for the GPU's architecture says it is
  faster (``fused_rule``: rows and width, measured ahead of time; nothing is timed at run time).
* **Eager training**: one autograd node, :class:`GeGLUMLPFunction` (below). Small CUDA steps (under
  ``runtime.backend.NODE_EAGER_BELOW`` [M, H] elements) are host-bound and run PyTorch's own ops with the host's
  activation instead: a Python node costs the host more than eager's C++ nodes.
* **torch.compile**: inference calls the op ``geglu_mlp`` where the fused path may run for the rows
  (``inference.traced_op``: the shipped rule, one guard on the symbolic row count), and the host's ops elsewhere,
  which Inductor compiles as it compiles the unkernelized model; a training step traces the host's ops.
* **Tracing, functorch transforms, tensor subclasses**: the custom ops ``geglu_mlp`` (inference) and
  ``geglu_mlp_train`` / ``geglu_mlp_train_backward`` (training), with fake implementations; the op makes every
  shape-dependent choice (decode size, fused or not) when it runs.

The training step's node and operators are in ``mlp.training``, the inference path and its operator in
``mlp.inference``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..runtime import backend as _backend
from .inference import geglu_mlp_op, inference, traced_op
from .training import _apply, geglu_mlp_train, host_bound, node_applies

# --- the entry point ---------------------------------------------------------------------------------------------


def geglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str, act=None) -> Tensor:
    """``F.linear(gelu(F.linear(x, w_gate), approximate) * F.linear(x, w_up), w_down)`` (see the module docstring
    for which path runs). x [..., D]; w_gate, w_up [H, D]; w_down [D_out, H] (nn.Linear weights, no bias); one
    dtype and device. ``act``, the host's activation module, runs in the small eager training steps that take
    PyTorch's own ops (None: ``F.gelu``)."""
    mode = _backend.call_mode(x, w_gate, w_up, w_down)
    if mode == _backend.PLAIN:
        return inference(x, w_gate, w_up, w_down, approximate)
    if mode == _backend.AUTOGRAD:
        if not host_bound(x, w_gate) and node_applies(x, w_gate, w_up, w_down):
            return _apply(x, w_gate, w_up, w_down, approximate)
        return _host(x, w_gate, w_up, w_down, approximate, act)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate, w_up, w_down)):
        if torch.compiler.is_compiling():
            # A compiled training step gets the host's ops, which Inductor compiles as it compiles the unkernelized
            # model: the training op's GEMMs cost the step more GPU time than its GeGLU kernels save against
            # Inductor's fused pointwise pass (docs/fused-mlp.md).
            return _host(x, w_gate, w_up, w_down, approximate, act)
        return geglu_mlp_train(x, w_gate, w_up, w_down, approximate)[0]
    if torch.compiler.is_compiling() and not traced_op(x, w_gate):
        return _host(x, w_gate, w_up, w_down, approximate, act)
    return geglu_mlp_op(x, w_gate, w_up, w_down, approximate)


def _host(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str, act=None) -> Tensor:
    """The hosts' MLP op for op: ``down(act(gate(x)) * up(x))``, the activation before the up projection."""
    gate = F.linear(x, w_gate)
    h = (act(gate) if act is not None else F.gelu(gate, approximate=approximate)) * F.linear(x, w_up)
    return F.linear(h, w_down)


__all__ = ["geglu_mlp"]
