"""transformers' MoE experts (classes decorated with ``@use_experts_implementation``, e.g. Gemma 4's
``Gemma4TextExperts``): the per-expert loop of their ``eager`` implementation, with the gate computed by a given
function. The other implementations (grouped_mm, batched_mm, ...) stay transformers' own; they reach the kernel
through the experts' ``_apply_gate`` (layers.GeGLUExpertsGate).

Expected host state: ``gate_up_proj`` [experts, 2 * I, hidden] (gate rows first), ``down_proj`` [experts, hidden,
I], ``num_experts``, ``act_fn``, and ``config._experts_implementation``.
"""

from typing import Callable

import torch
import torch.nn.functional as F

_EAGER = (None, "eager")  # transformers runs the class's own forward for both


def runs_eager(experts) -> bool:
    """Whether the host's configured experts implementation is its own per-expert loop ("eager", or unset)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) in _EAGER


def eager_forward(experts, gate: Callable, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The eager implementation's result, op for op, with ``gate(act_fn, gate_up)`` between the two projections.

    Experts are visited in increasing order and each one's tokens in (top-k slot, token) order, as transformers
    does, so that the per-expert GEMMs see the same rows and ``index_add_`` sums the same values in the same
    order: with a gate that is bit-exact with ``act_fn(gate) * up``, so is the result. Expert ids outside
    ``[0, num_experts)`` (expert parallelism's sentinels for experts held by another rank) are skipped.
    """
    out = torch.zeros_like(hidden_states)
    num_experts = experts.num_experts
    with torch.no_grad():
        slots_by_token = top_k_index.t()  # [top_k, tokens]: where() walks it slot-major, as transformers' mask does
        hit = torch.unique(top_k_index).tolist()  # sorted
    for e in hit:
        if e < 0 or e >= num_experts:
            continue
        slot, token = torch.where(slots_by_token == e)
        gate_up = F.linear(hidden_states[token], experts.gate_up_proj[e])
        h = F.linear(gate(experts.act_fn, gate_up), experts.down_proj[e])
        h = h * top_k_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out
