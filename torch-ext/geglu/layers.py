"""Hub layers for ``kernels.kernelize``.

They follow the kernels layer rules: no ``__init__``, no members besides ``forward``, ``has_backward`` and
``can_torch_compile``; state comes from the host module (value-less annotations say what is expected), and
``forward`` has the host's signature.
"""

from typing import Callable

import torch
from torch import nn

from ._activations import gelu_approximation
from ._rope import ROPE_OP_MIN_ROWS, rope_cos_sin as _rope_cos_sin
from .experts.layers import GeGLUExperts, GeGLUExpertsGate
from .functional import gated_packed, gated_proj
from .mlp import ops as _mlp
from .rmsnorm.layers import Gemma3nRMSNorm, GemmaRMSNorm


_is_compiling = torch.compiler.is_compiling


_GELU_ERF, _GELU_TANH = nn.GELU(), nn.GELU(approximate="tanh")


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]`` (exact GELU), the name kernels-community/activation uses; with backward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_packed(_GELU_ERF, x, act_first=True, inplace_backward=False)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]``, the name kernels-community/activation uses; with backward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_packed(_GELU_TANH, x, act_first=True, inplace_backward=False)


_PLAIN = (torch.Tensor, nn.Parameter)


def _plain_linear(m) -> bool:
    """An nn.Linear without bias or hooks (not a quantized or adapter subclass), whose weight is a plain tensor (not
    a DTensor of tensor parallelism) and whose forward is its class's (transformers' tensor parallelism and
    accelerate replace ``module.forward``): its weight is the whole story."""
    return (type(m) is nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and type(m.weight) in _PLAIN and "forward" not in m.__dict__)


class GeGLUMLP(nn.Module):
    """Replaces a transformers gated MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Gemma, Gemma 2/3/4, ...).

    Shapes: x ``[..., D]`` -> ``[..., D_out]``; gate_proj, up_proj ``D -> H``, down_proj ``H -> D_out``.

    The GELU flavour (erf or tanh) comes from the host's ``act_fn``; an activation that is not a GELU runs the
    host's own computation. With plain bias-free ``nn.Linear`` projections the MLP runs as one computation
    (``mlp.ops.geglu_mlp``): a training step is one autograd node with eager's output and gradients bit for bit and at
    most three [M, H] activation buffers in its backward (eager: four); inference at prefill sizes takes the fused
    gate/up GEMM (the GeGLU in its epilogue: more accurate than eager, not its bits) where it measures faster on the
    device (setting ``fused_mlp``, ``GEGLU_FUSED_MLP=0`` turns it off). Under torch.compile inference is the fused op
    where the shipped rule lets the fused GEMM run for the rows (one guard on the symbolic row count) and the host's
    ops elsewhere, and a training step traces the host's ops: Inductor compiles those as for the unkernelized
    model.
    """

    can_torch_compile = True
    has_backward = True

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj, act = self.gate_proj, self.up_proj, self.down_proj, self.act_fn
        approximate = gelu_approximation(act)
        if approximate is not None and _plain_linear(gate_proj) and _plain_linear(up_proj) and _plain_linear(down_proj):
            # plain projections: F.linear on their weights is what their forward runs; the MLP as one computation
            return _mlp.geglu_mlp(x, gate_proj.weight, up_proj.weight, down_proj.weight, approximate, act)
        # projections that are modules of their own (quantized, adapted, with hooks or a bias, sharded): their
        # forward, then our GeGLU (or the host's activation when it is not a GELU the kernel computes)
        return down_proj(gated_proj(act, gate_proj(x), up_proj, x))


class GeGLUMLPWithDropout(nn.Module):
    """Replaces ``down_proj(dropout(act_fn(gate_proj(x)) * up_proj(x)))`` (T5Gemma, T5Gemma 2, Gte).

    Dropout sits between the product and ``down_proj`` as in the host and is the host's own module, so it draws
    the same random mask from the same generator state.
    """

    can_torch_compile = True
    has_backward = True

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module
    dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(gated_proj(self.act_fn, self.gate_proj(x), self.up_proj, x)))


class GeGLUSelfConditioning(nn.Module):
    """Replaces DiffusionGemma's self-conditioning block, ``forward(inputs_embeds, self_conditioning_signal)``:
    ``post_norm(inputs_embeds + down_proj(act_fn(gate_proj(n)) * up_proj(n)))`` with ``n = pre_norm(signal)``.

    The norms are the host's own modules (kernelized norms run their layer); the MLP in between is
    :class:`GeGLUMLP`'s computation on the host's projections.
    """

    can_torch_compile = True
    has_backward = True

    pre_norm: nn.Module
    post_norm: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def forward(self, inputs_embeds: torch.Tensor, self_conditioning_signal: torch.Tensor) -> torch.Tensor:
        normed = self.pre_norm(self_conditioning_signal)
        return self.post_norm(inputs_embeds + GeGLUMLP.forward(self, normed))


class Gemma3nGeGLUMLP(nn.Module):
    """Replaces Gemma 3n's text MLP: like :class:`GeGLUMLP`, but layers with ``activation_sparsity > 0`` first
    pass the gate through the host's ``_gaussian_topk`` (a ReLU of the gate minus a per-row cutoff).

    The in-place backward is used only where there is no top-k: ReLU keeps its output for its own backward, and that
    output is the gate our backward would overwrite.
    """

    can_torch_compile = True
    has_backward = True

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module
    activation_sparsity: float
    _gaussian_topk: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(hidden_states)
        sparse = self.activation_sparsity > 0.0
        if sparse:
            gate = self._gaussian_topk(gate)
        return self.down_proj(gated_proj(self.act_fn, gate, self.up_proj, hidden_states, inplace_backward=not sparse))


class T5GeGLUDense(nn.Module):
    """Replaces T5's gated feed-forward ``wo(dropout(act(wi_0(h)) * wi_1(h)))`` (T5 v1.1 / flan-T5 with
    ``feed_forward_proj="gated-gelu"``, mT5, UMT5, UDOP, Pix2Struct, Kosmos-2.5).

    Like T5, the product is cast to ``wo.weight.dtype`` when they differ and the weight is not int8 (T5 keeps ``wo``
    in fp32). LongT5, which has no such cast, has :class:`LongT5GeGLUDense`.
    """

    can_torch_compile = True
    has_backward = True

    wi_0: nn.Module
    wi_1: nn.Module
    wo: nn.Module
    dropout: nn.Module
    act: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(gated_proj(self.act, self.wi_0(hidden_states), self.wi_1, hidden_states))
        weight = self.wo.weight
        if isinstance(weight, torch.Tensor) and hidden_states.dtype != weight.dtype and weight.dtype != torch.int8:
            hidden_states = hidden_states.to(weight.dtype)
        return self.wo(hidden_states)


class LongT5GeGLUDense(nn.Module):
    """Replaces LongT5's gated feed-forward: :class:`T5GeGLUDense` without the cast to ``wo.weight.dtype`` (LongT5
    does not cast; with a quantized ``wo`` the cast would be wrong)."""

    can_torch_compile = True
    has_backward = True

    wi_0: nn.Module
    wi_1: nn.Module
    wo: nn.Module
    dropout: nn.Module
    act: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(gated_proj(self.act, self.wi_0(hidden_states), self.wi_1, hidden_states)))


class ModernBertGeGLUMLP(nn.Module):
    """Replaces ModernBERT's MLP ``Wo(drop(act(input) * gate))`` with ``input, gate = Wi(x).chunk(2, -1)``: the
    packed form with the activated half first, read straight from ``Wi``'s output (no chunk copies)."""

    can_torch_compile = True
    has_backward = True

    Wi: nn.Module
    act: nn.Module
    drop: nn.Module
    Wo: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.drop(gated_packed(self.act, self.Wi(hidden_states), act_first=True)))


class Zamba2GeGLUMLP(nn.Module):
    """Replaces Zamba2's MLP: packed ``gate_up_proj`` plus the per-block LoRA adapter selected by ``layer_idx``,
    then ``down_proj(act_fn(gate) * up)`` on the packed sum."""

    can_torch_compile = True
    has_backward = True

    gate_up_proj: nn.Module
    gate_up_proj_adapter_list: nn.ModuleList
    layer_dic: dict
    down_proj: nn.Module
    act_fn: nn.Module

    def forward(self, hidden_state: torch.Tensor, layer_idx=None) -> torch.Tensor:
        gate_up_state = self.gate_up_proj(hidden_state)
        layer_idx = self.layer_dic[layer_idx]
        gate_up_state = gate_up_state + self.gate_up_proj_adapter_list[layer_idx](hidden_state)
        return self.down_proj(gated_packed(self.act_fn, gate_up_state, act_first=True))


class ClvpGeGLU(nn.Module):
    """Replaces CLVP's gated linear unit ``h * act(gate)`` with ``h, gate = proj(x).chunk(2, -1)``: the packed form
    with the activated half second (the product is commutative, so the result is the same)."""

    can_torch_compile = True
    has_backward = True

    proj: nn.Module
    activation_fn: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_packed(self.activation_fn, self.proj(hidden_states), act_first=False)


class CpmAntGeGLU(nn.Module):
    """Replaces CPM-Ant's gated activation ``act(w_0(h)) * w_1(h)`` (no output projection; the caller applies it)."""

    can_torch_compile = True
    has_backward = True

    w_0: nn.Module
    w_1: nn.Module
    act: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_proj(self.act, self.w_0(hidden_states), self.w_1, hidden_states)




# MoE experts and Gemma's RMSNorm: their layers live with the features (experts.layers, rmsnorm.layers)


def _rotary(module, x: torch.Tensor, position_ids: torch.Tensor, prefix: str):
    """Under torch.compile: the rotary embedding's cos and sin from one op (``_rope.rope_cos_sin``)."""
    inv_freq = getattr(module, prefix + "inv_freq")
    scaling = getattr(module, prefix + "attention_scaling")
    return _rope_cos_sin(position_ids.to(x.device), inv_freq, float(scaling), x.dtype)


class RotaryEmbedding(nn.Module):
    """Replaces the Gemma models' rotary embedding ``forward(x, position_ids)`` returning ``cos, sin`` of the
    positions times ``inv_freq`` (the classes of transformers_kernels.ROPE_CLASSES). Eager runs the host's own
    forward. Under torch.compile, from ``_rope.ROPE_OP_MIN_ROWS`` positions (batch x sequence) on, one op
    (``_rope.rope_cos_sin``: the host's formula, eager's bits) computes them, and Inductor reads them from memory
    instead of recomputing them inside every attention layer's q/k norm + RoPE kernel; fewer positions trace the
    host's forward (one guard on the symbolic position count). Positions need no gradient."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if not _is_compiling() or position_ids.numel() < ROPE_OP_MIN_ROWS:
            return type(self).forward(self, x, position_ids)  # the host's forward
        return _rotary(self, x, position_ids, "")


class LayerTypeRotaryEmbedding(nn.Module):
    """:class:`RotaryEmbedding` for the hosts with one frequency table per attention type (Gemma 3, 3n, 4:
    ``forward(x, position_ids, layer_type)``, buffers ``<layer_type>_inv_freq``)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type):
        if not _is_compiling() or position_ids.numel() < ROPE_OP_MIN_ROWS:
            return type(self).forward(self, x, position_ids, layer_type)  # the host's forward
        return _rotary(self, x, position_ids, f"{layer_type}_")


__all__ = [
    "GeluAndMul",
    "GeluTanhAndMul",
    "GeGLUMLP",
    "GeGLUMLPWithDropout",
    "GeGLUSelfConditioning",
    "Gemma3nGeGLUMLP",
    "T5GeGLUDense",
    "LongT5GeGLUDense",
    "ModernBertGeGLUMLP",
    "Zamba2GeGLUMLP",
    "ClvpGeGLU",
    "CpmAntGeGLU",
    "GeGLUExpertsGate",
    "GeGLUExperts",
    "GemmaRMSNorm",
    "Gemma3nRMSNorm",
    "RotaryEmbedding",
    "LayerTypeRotaryEmbedding",
]
