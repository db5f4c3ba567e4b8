"""Hub layers for ``kernels.kernelize``.

They follow the kernels layer rules: no ``__init__``, no members besides ``forward``, ``has_backward`` and
``can_torch_compile``; state comes from the host module (value-less annotations say what is expected), and
``forward`` has the host's signature.
"""

from typing import Optional

import torch
from torch import nn

from .functional import geglu, geglu_packed

# transformers' activation classes by the GELU they compute. Exact matches of F.gelu first; the tanh-formula
# variants (gelu_new, gelu_fast, gelu_accurate) compute the same function in the input dtype, so our fp32 result
# differs from theirs by their rounding (closer to the true value).
_TANH_CLASSES = {"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "NewGELUActivation", "FastGELUActivation",
                 "AccurateGELUActivation"}
_ERF_CLASSES = {"GELUActivation"}


def gelu_approximation(act) -> Optional[str]:
    """'none' or 'tanh' when ``act`` is a GELU our kernel computes, else None (the host's own code runs)."""
    if isinstance(act, nn.GELU):
        return act.approximate
    if act is torch.nn.functional.gelu:
        return "none"
    name = type(act).__name__
    if name in _TANH_CLASSES:
        return "tanh"
    if name in _ERF_CLASSES:
        return "none"
    return None


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]`` (exact GELU), the name kernels-community/activation uses; with backward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu_packed(x, "none")


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]``, the name kernels-community/activation uses; with backward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu_packed(x, "tanh")


class GeGLUMLP(nn.Module):
    """Replaces a transformers gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Gemma, Gemma 2/3, …).

    The GELU flavour (erf or tanh) comes from the host's ``act_fn``; an activation that is not a GELU runs the
    host's own computation. The backward writes the GeGLU gradients over the gate/up projections' outputs, which
    nothing else reads, so training keeps two fewer activation-sized buffers than eager.
    """

    can_torch_compile = True
    has_backward = True

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        approximate = gelu_approximation(self.act_fn)
        if approximate is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate, inplace_backward=True))


__all__ = ["GeluAndMul", "GeluTanhAndMul", "GeGLUMLP"]
