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


# --- grouped_mm inference with the fused gate/up kernel ----------------------------------------------------------

# Routed rows (tokens x top-k) from which the fused block runs, per compute capability major (none elsewhere): at
# decode sizes most experts get a row or none, a tile is mostly empty and the block is bound by reading the
# experts' weights, which both paths do once. Measured ahead of time (`python -m kerneltools.bench.fused_rule`,
# docs/fused-mlp.md); nothing is timed at run time.
FUSED_RULES = {9: dict(min_rows=2048)}


def fused_rule(rows: int, device: torch.device) -> bool:
    """Whether the fused block runs for ``rows`` routed rows on ``device``: the shipped threshold for the GPU's
    architecture (never on one it has none for); on CPU tensors (the Triton interpreter, tests) always."""
    from ..runtime import backend

    return backend.shipped_rule(FUSED_RULES, device, min_rows=rows)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """transformers' grouped GEMM call: ``x @ w[e]`` over each expert's rows."""
    fn = getattr(F, "grouped_mm", None)
    return fn(x, w, offs=offsets) if fn is not None else torch._grouped_mm(x, w, offs=offsets)


def sorted_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """``(perm, rows, offsets)`` as transformers' grouped_mm implementation makes them: the routed (token, slot)
    pairs sorted by expert (``perm``), their rows of ``hidden_states``, and each expert's cumulative row count (int32,
    from ``histc``, which takes ints on CUDA and floats on CPU)."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    ids = expert_ids.int() if hidden_states.is_cuda else expert_ids.float()
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return perm, hidden_states[perm // top_k_index.size(-1)], torch.cumsum(counts, dim=0, dtype=torch.int32)


def _plain_grouped(experts) -> bool:
    """An experts module whose grouped_mm implementation is the plain one the fused block reproduces: concatenated
    gate/up weights ([E, 2I, D], gate rows first), not transposed, no biases, no post-expert norm, not sharded
    over experts (expert parallelism's sentinel rows). The gate it computes is ``act_fn(gate) * up``, transformers'
    default: ``register_geglu_kernels`` refuses experts classes with a gate of their own."""
    return (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and type(experts.gate_up_proj) is torch.nn.Parameter and type(experts.down_proj) is torch.nn.Parameter)


def fused_block(experts, hidden_states, top_k_index, top_k_weights, tanh: bool) -> torch.Tensor:
    """transformers' grouped_mm experts forward, op for op, with the first grouped GEMM and the gate as one kernel
    (`experts.kernels.grouped_gate_up_geglu`). Each [S, ...] buffer is released once the next one exists: at the
    block's peak transformers holds the sorted rows, the down projection's output and two weighted copies of it
    ([S, hidden] each), this block only the two weighted copies."""
    from . import kernels as _experts_triton

    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    perm, x_g, offsets = sorted_rows(hidden_states, top_k_index, experts.num_experts)
    weights_g = top_k_weights.reshape(-1)[perm]
    h = _experts_triton.grouped_gate_up_geglu(x_g, experts.gate_up_proj, offsets, tanh)
    del x_g
    out = grouped_mm(h, experts.down_proj.transpose(-2, -1), offsets)
    del h
    weighted = out * weights_g.unsqueeze(-1)  # not in place: fp32 routing weights promote the product to fp32
    del out
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def fused_forward(experts, hidden_states, top_k_index, top_k_weights, approximate):
    """The experts block with the fused gate/up kernel, or None where it does not apply: the grouped_mm
    implementation, inference (no gradient), the ``fused_mlp`` setting on, operands the kernel takes, and at least
    ``FUSED_RULES``' ``min_rows`` routed rows for the GPU's architecture (CPU tensors under the interpreter: any).
    Not eager's bits: the GeGLU of the fp32 accumulators, rounded once."""
    from ..runtime import config as _config

    if approximate is None or not _config.current.fused_mlp or hidden_states.dim() != 2:
        return None
    rows = top_k_index.numel()
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation != "grouped_mm":
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, top_k_weights, experts.gate_up_proj,
                                                                   experts.down_proj)):
        return None
    dev = hidden_states.device
    if dev.type != "cuda" and (dev.type != "cpu" or _config.current.backend != "triton"):
        return None
    if not fused_rule(rows, dev):
        return None
    if not _plain_grouped(experts) or experts.down_proj.dtype != hidden_states.dtype:
        return None
    try:
        from . import kernels as _experts_triton
    except ImportError:  # no triton
        return None
    if not _experts_triton.applies(hidden_states, experts.gate_up_proj):
        return None
    return fused_block(experts, hidden_states, top_k_index, top_k_weights, approximate == "tanh")
