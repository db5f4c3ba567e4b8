"""Hub layers for transformers' ``@use_experts_implementation`` experts: :class:`GeGLUExpertsGate` (their
``_apply_gate``) and :class:`GeGLUExperts` (their forward).
"""

import functools

import torch
from torch import nn

from .._activations import gelu_approximation
from ..functional import gated_packed
from . import ops as _experts
from ..runtime.library import HubLayer

_is_compiling = torch.compiler.is_compiling


class GeGLUExpertsGate(HubLayer):
    """``gate_up [..., 2I] -> act_fn(gate) * up [..., I]`` (``gate, up = gate_up.chunk(2, -1)``): the packed kernel
    for a GELU ``act_fn`` (bit-exact on the GPU), else the host's math. The backward writes its grad over gate_up."""

    def forward(self, act_fn, gate_up: torch.Tensor) -> torch.Tensor:
        return gated_packed(act_fn, gate_up, act_first=True)


_experts_gate = functools.partial(gated_packed, act_first=True)  # gate(act_fn, gate_up), as GeGLUExpertsGate


class GeGLUExperts(HubLayer):
    """The experts forward, ``(hidden_states [T, D], top_k_index, top_k_weights [T, k]) -> [T, D]``: for the "eager"
    (or unset) implementation the per-expert loop with the packed gate; else, outside torch.compile, the fused block
    where ``experts.ops.fused_forward`` takes the call; else the class's own forward."""

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
            y = _experts.fused_forward(self, hidden_states, top_k_index, top_k_weights, gelu_approximation(self.act_fn))
            if y is not None:
                return y
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
