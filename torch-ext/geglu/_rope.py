"""Rotary position embedding's cos and sin as one operator, for the Gemma models under torch.compile.

The Gemma models compute ``cos, sin`` of ``position * inv_freq`` once per forward (their ``RotaryEmbedding``
module) and every attention layer reads them. Compiled, Inductor inlines that pointwise computation into each
consumer: every layer's q/k norm + RoPE kernel recomputes the positions' cos and sin for every head of every row.
Measured on an H200 (Gemma 3 4B-shaped compiled prefill, 8 x 2048, 16 layers; ``benchmarks/rope_probe.py``): the
two q/k norm + RoPE kernels take 5.65 ms of a 97.2 ms call, 7x what their traffic needs; with cos and sin from
this op (a buffer Inductor reads) the same work takes 0.4 ms. The op computes the hosts' own formula with PyTorch's
ops, so its outputs are eager's bits (the compiled host's inlined cos and sin are Inductor's, not eager's).
"""

from typing import Tuple

import torch
from torch import Tensor

from . import _library


@_library.op("rope_cos_sin")
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


__all__ = ["rope_cos_sin"]
