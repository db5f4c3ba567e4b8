"""Rotary position embedding's cos and sin as one opaque operator, for the Gemma models under torch.compile.

Inductor would otherwise inline the cos/sin computation into every attention layer's consumer; with this op they
read one buffer. It computes the hosts' formula with PyTorch's ops, so its outputs are eager's bits.
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
    """``cos(emb) * attention_scaling`` and ``sin(emb) * attention_scaling`` in ``dtype``, ``emb`` being
    ``position_ids * inv_freq`` in fp32, repeated twice along the last dim (Gemma's ``RotaryEmbedding`` forward).

    Shapes: position_ids ``[..., S]``, inv_freq ``[D / 2]`` -> two ``[..., S, D]`` on position_ids' device."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


@rope_cos_sin.register_fake
def _(position_ids, inv_freq, attention_scaling, dtype):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype)
