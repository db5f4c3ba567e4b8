"""Gemma's RMSNorm hub layers (exported by ``layers``)."""

import torch

from .ops import host_forward as _gemma_norm_host, layer_forward as _gemma_norm
from .ops import scaled_host_forward as _scaled_norm_host, scaled_layer_forward as _scaled_norm
from ..runtime.library import HubLayer

_is_compiling = torch.compiler.is_compiling


def _norm_eps(module) -> float:
    """The host norm's epsilon: ``eps``, or ``variance_epsilon`` where the module has no ``eps``."""
    eps = getattr(module, "eps", None)
    return module.variance_epsilon if eps is None else eps


class GemmaRMSNorm(HubLayer):
    """Replaces transformers' ``GemmaRMSNorm`` and classes with its forward (Gemma 2, Gemma 3, T5Gemma, ...):
    ``(x.float() * rsqrt(mean(x.float()^2, -1) + eps) * (1.0 + weight.float())).type_as(x)``; on CUDA one fused
    kernel forward and one backward (dx and a deterministic dw), on CPU the host's own ops. Under torch.compile,
    and for tensor subclasses (DTensor) and functorch transforms, the host's own math.

    Shapes: x ``[..., D]``, weight ``[D]``; output like x.
    """

    weight: torch.Tensor
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = _norm_eps(self)
        if _is_compiling():
            return _gemma_norm_host(x, self.weight, eps)
        return _gemma_norm(x, self.weight, eps)


class Gemma3nRMSNorm(HubLayer):
    """Replaces transformers' ``Gemma3nRMSNorm`` and classes with its forward (Gemma 4, EmbeddingGemma 2, ...):
    ``(x.float() * pow(mean(x.float()^2, -1) + eps, -0.5) * weight.float()).type_as(x)``, with no scale when
    ``with_scale`` is False. On CUDA the fused kernels (offset 0); on CPU and under torch.compile the host's math."""

    eps: float  # or variance_epsilon
    with_scale: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.with_scale else None
        eps = _norm_eps(self)
        if _is_compiling():
            return _scaled_norm_host(x, weight, eps)
        return _scaled_norm(x, weight, eps)
