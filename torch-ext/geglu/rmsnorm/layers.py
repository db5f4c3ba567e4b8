"""Gemma's RMSNorm hub layers (exported by ``layers``)."""

import torch
from torch import nn

from .ops import host_forward as _gemma_norm_host, layer_forward as _gemma_norm
from .ops import scaled_host_forward as _scaled_norm_host, scaled_layer_forward as _scaled_norm

_is_compiling = torch.compiler.is_compiling


def _norm_eps(module) -> float:
    """The host norm's epsilon: ``eps`` (transformers 5.22 everywhere; GemmaRMSNorm's family in 5.25) or
    ``variance_epsilon`` (Gemma3nRMSNorm's family from transformers 5.25)."""
    eps = getattr(module, "eps", None)
    return module.variance_epsilon if eps is None else eps


class GemmaRMSNorm(nn.Module):
    """Replaces transformers' ``GemmaRMSNorm`` and the classes with its forward (Gemma 2, Gemma 3, T5Gemma, ...):
    ``(x.float() * rsqrt(mean(x.float()^2, -1) + eps) * (1.0 + weight.float())).type_as(x)``, one fused kernel
    forward and one backward (dx and a deterministic dw) on CUDA, the host's own ops on CPU.

    Shapes: x ``[..., D]`` (q_norm / k_norm rows of head_dim included), weight ``[D]``; output like x.

    Under torch.compile the layer runs the host's own math (a constant branch: no guard, no graph break), so that
    Inductor fuses the norm with its neighbours (residual adds, casts) as it does for the unkernelized model; the
    opaque op would keep them apart. Tensor subclasses (DTensor) and functorch transforms also get the host's math.
    """

    can_torch_compile = True
    has_backward = True

    weight: torch.Tensor
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = _norm_eps(self)
        if _is_compiling():
            return _gemma_norm_host(x, self.weight, eps)
        return _gemma_norm(x, self.weight, eps)


class Gemma3nRMSNorm(nn.Module):
    """Replaces transformers' ``Gemma3nRMSNorm`` and the classes with its forward (Gemma 4, Gemma 4 unified,
    EmbeddingGemma 2, DiffusionGemma, NeoMME): ``(x.float() * pow(mean(x.float()^2, -1) + eps, -0.5) * weight.float())
    .type_as(x)``, the scale being the weight itself, and no scale at all when ``with_scale`` is False (v_norm, the
    router's norm). On CUDA the fused kernels (as :class:`GemmaRMSNorm`'s, with offset 0); on CPU and under
    torch.compile the host's own math."""

    can_torch_compile = True
    has_backward = True

    eps: float  # or variance_epsilon (transformers >= 5.25)
    with_scale: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.with_scale else None
        eps = _norm_eps(self)
        if _is_compiling():
            return _scaled_norm_host(x, weight, eps)
        return _scaled_norm(x, weight, eps)
