"""The MoE experts' hub layers (exported by ``layers``): transformers' ``@use_experts_implementation`` classes
(Gemma 4, DiffusionGemma). The host side (``register_transformers``) routes the experts' ``_apply_gate`` through a
function layer, :class:`GeGLUExpertsGate`, and puts :class:`GeGLUExperts` on the experts class for the eager
implementation.
"""

import torch
from torch import nn

from .._activations import gelu_approximation
from ..functional import gated_packed
from . import ops as _experts

_is_compiling = torch.compiler.is_compiling


class GeGLUExpertsGate(nn.Module):
    """Replaces the experts' gate function ``experts_gate(act_fn, gate_up)``: ``act_fn(gate) * up`` of
    ``gate, up = gate_up.chunk(2, -1)``, the step between the two grouped GEMMs of transformers' grouped_mm and
    batched_mm experts implementations (their ``_apply_gate``). A GELU ``act_fn`` runs the packed kernel on the
    GEMM's output in place of the chunk, GELU and product (bit-exact with them on the GPU); any other activation
    runs the host's own math. The backward writes its gradient over ``gate_up``, which nothing else reads."""

    can_torch_compile = True
    has_backward = True

    def forward(self, act_fn, gate_up: torch.Tensor) -> torch.Tensor:
        return gated_packed(act_fn, gate_up, act_first=True)


def _experts_gate(act_fn, gate_up: torch.Tensor) -> torch.Tensor:
    return gated_packed(act_fn, gate_up, act_first=True)


class GeGLUExperts(nn.Module):
    """Replaces the forward of a transformers experts class (``Gemma4TextExperts``, ``DiffusionGemmaTextExperts``)
    and keeps transformers' dispatch: with ``config._experts_implementation`` "eager" (or unset) it runs the eager
    per-expert loop with the packed kernel as the gate (the host inlines ``act_fn(gate) * up`` there, out of reach
    of ``_apply_gate``); with any other implementation it calls the class's own forward, which dispatches to the
    configured one (whose gate is :class:`GeGLUExpertsGate`). In inference at prefill sizes under the ``fused_mlp``
    setting, grouped_mm's block takes the fused gate/up grouped GEMM (the GeGLU in its epilogue) where the shipped
    rule says it is faster (``experts.ops.fused_forward``)."""

    can_torch_compile = True
    has_backward = True

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    num_experts: int
    act_fn: nn.Module
    config: object

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if _experts.runs_eager(self):
            return _experts.eager_forward(self, _experts_gate, hidden_states, top_k_index, top_k_weights)
        if not _is_compiling():
            y = _experts.fused_forward(self, hidden_states, top_k_index, top_k_weights,
                                       gelu_approximation(self.act_fn))
            if y is not None:
                return y
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
