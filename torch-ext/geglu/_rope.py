"""Rotary position embedding's cos and sin as one operator, for the Gemma models under torch.compile.

The Gemma models compute ``cos, sin`` of ``position * inv_freq`` once per forward (their ``RotaryEmbedding``
module) and every attention layer reads them. Compiled, Inductor inlines that pointwise computation into each
consumer: every layer's q/k norm + RoPE kernel recomputes the positions' cos and sin for every head of every row
(docs/transformers.md gives the measurement); with cos and sin from this op, those kernels read a buffer. The op
computes the hosts' own formula with PyTorch's
ops, so its outputs are eager's bits (the compiled host's inlined cos and sin are Inductor's, not eager's).
"""

from typing import Tuple

import torch
from torch import Tensor

from ._ops import add_op_namespace_prefix
from .runtime import library as _library

# The rotary layers call the op under torch.compile from this many positions (batch x sequence) on. Below it a
# forward is host-bound: the op's call costs the host more than the recomputation it saves costs the GPU, so the
# graph traces the host's forward (benchmarks/results/h200/serve.md).
ROPE_OP_MIN_ROWS = 2048


@_library.op(add_op_namespace_prefix("rope_cos_sin"))
def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor, attention_scaling: float,
                 dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``cos(emb) * attention_scaling`` and ``sin(emb) * attention_scaling`` in ``dtype``, with ``emb`` the
    position ids times ``inv_freq`` (fp32), twice over the last dimension: the Gemma ``RotaryEmbedding`` forward op
    for op. Shapes: position_ids ``[..., S]``, inv_freq ``[D / 2]`` -> two ``[..., S, D]``, on position_ids' device."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


@rope_cos_sin.register_fake
def _(position_ids, inv_freq, attention_scaling, dtype):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype)


__all__ = ["rope_cos_sin", "ROPE_OP_MIN_ROWS"]
