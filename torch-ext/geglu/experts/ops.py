"""transformers' MoE experts: their ``eager`` per-expert loop with a given gate, and grouped_mm's block with the fused
gate/up grouped GEMM. Host state: ``gate_up_proj`` [E, 2I, D] (gate rows first), ``down_proj`` [E, D, I],
``num_experts``, ``act_fn``, ``config._experts_implementation``.
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
    """The eager implementation op for op (experts ascending, rows in (slot, token) order), with ``gate(act_fn,
    gate_up)`` as the gate; ids outside ``[0, num_experts)`` skipped. hidden_states [T, D]; top_k_* [T, k] -> [T, D]."""
    out = torch.zeros_like(hidden_states)
    num_experts = experts.num_experts
    with torch.no_grad():
        slots_by_token = top_k_index.t()  # [top_k, tokens]: where() walks it slot-major, as transformers does
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


# per capability major, measured ahead of time: the least routed rows (tokens x top-k) of the fused block
FUSED_RULES = {9: dict(min_rows=2048)}


def fused_rule(rows: int, device: torch.device) -> bool:
    """Whether the fused block runs for ``rows`` routed rows: the shipped rule (False where none; True off CUDA)."""
    from ..runtime import backend
    return backend.shipped_rule(FUSED_RULES, device, min_rows=rows)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """transformers' grouped GEMM call: ``x @ w[e]`` over each expert's rows."""
    fn = getattr(F, "grouped_mm", None)
    return fn(x, w, offs=offsets) if fn is not None else torch._grouped_mm(x, w, offs=offsets)


def sorted_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """``(perm, rows, offsets)`` as transformers' grouped_mm makes them; offsets [E] cumulative counts (int32)."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    ids = expert_ids.int() if hidden_states.is_cuda else expert_ids.float()  # histc's dtypes per device
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return perm, hidden_states[perm // top_k_index.size(-1)], torch.cumsum(counts, dim=0, dtype=torch.int32)


def _plain_grouped(experts) -> bool:
    """Whether the grouped_mm path is the plain one fused_block reproduces: gated, concatenated, untransposed, no
    biases, no post-expert norm, no expert parallelism, plain Parameters (custom gates are refused at registration)."""
    return (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and type(experts.gate_up_proj) is torch.nn.Parameter and type(experts.down_proj) is torch.nn.Parameter)


def fused_block(experts, hidden_states, top_k_index, top_k_weights, tanh: bool) -> torch.Tensor:
    """transformers' grouped_mm experts forward op for op, the first GEMM and the gate as one kernel."""
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
    """:func:`fused_block`, or None unless: a GELU (``approximate`` not None), ``fused_mlp``, 2-D hidden_states,
    grouped_mm, no gradient recorded, CUDA (or CPU, 'triton' backend), :func:`fused_rule`, :func:`_plain_grouped`,
    down_proj of hidden_states' dtype, and ``kernels.applies``. Not eager's bits: the fp32 GeGLU, rounded once."""
    from ..runtime import config as _config
    if approximate is None or not _config.current.fused_mlp or hidden_states.dim() != 2:
        return None
    if getattr(getattr(experts, "config", None), "_experts_implementation", None) != "grouped_mm":
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, top_k_weights, experts.gate_up_proj,
                                                                   experts.down_proj)):
        return None
    dev = hidden_states.device
    if dev.type != "cuda" and (dev.type != "cpu" or _config.current.backend != "triton"):
        return None
    if (not fused_rule(top_k_index.numel(), dev) or not _plain_grouped(experts)
            or experts.down_proj.dtype != hidden_states.dtype):
        return None
    try:
        from . import kernels as _experts_triton
    except ImportError:  # no triton
        return None
    if not _experts_triton.applies(hidden_states, experts.gate_up_proj):
        return None
    return fused_block(experts, hidden_states, top_k_index, top_k_weights, approximate == "tanh")
