"""``GeGLUMLP``'s computation, ``y = down(gelu(x @ Wg^T, approximate) * (x @ Wu^T))``: :func:`geglu_mlp` runs
eager inference (``mlp.inference``), the eager training node (``mlp.training``), the custom ops under tracing and
subclasses, or the host's ops where those do not apply or lose (small steps, compiled training).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..runtime import backend as _backend
from .inference import geglu_mlp_op, inference, traced_op
from .training import _apply, geglu_mlp_train, host_bound, node_applies


def geglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str, act=None) -> Tensor:
    """Computes ``F.linear(gelu(F.linear(x, w_gate), approximate) * F.linear(x, w_up), w_down)``.
    Shapes: x [..., D]; w_gate, w_up [H, D]; w_down [D_out, H] (no bias); one dtype and device -> [..., D_out].
    ``act``: the host's activation where the host's ops run (None: ``F.gelu``)."""
    mode = _backend.call_mode(x, w_gate, w_up, w_down)
    if mode == _backend.PLAIN:
        return inference(x, w_gate, w_up, w_down, approximate)
    if mode == _backend.AUTOGRAD:
        if not host_bound(x, w_gate) and node_applies(x, w_gate, w_up, w_down):
            return _apply(x, w_gate, w_up, w_down, approximate)
        return _host(x, w_gate, w_up, w_down, approximate, act)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate, w_up, w_down)):
        if torch.compiler.is_compiling():
            # compiled training: Inductor's fused pointwise pass beats the training op (docs/fused-mlp.md)
            return _host(x, w_gate, w_up, w_down, approximate, act)
        return geglu_mlp_train(x, w_gate, w_up, w_down, approximate)[0]
    if torch.compiler.is_compiling() and not traced_op(x, w_gate):
        return _host(x, w_gate, w_up, w_down, approximate, act)
    return geglu_mlp_op(x, w_gate, w_up, w_down, approximate)


def _host(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str, act=None) -> Tensor:
    """The host's ops: ``down(act(gate(x)) * up(x))``."""
    gate = F.linear(x, w_gate)
    h = (act(gate) if act is not None else F.gelu(gate, approximate=approximate)) * F.linear(x, w_up)
    return F.linear(h, w_down)
