"""Hub layers for ``kernels.kernelize`` (:class:`runtime.library.HubLayer`): only ``forward``, with the host's
signature; state comes from the host module (the annotations name it, with those of the layer a layer extends)."""

from typing import Callable

import torch
from torch import nn

from ._activations import gelu_approximation
from ._rope import ROPE_OP_MIN_ROWS, rope_cos_sin as _rope_cos_sin
from .experts.layers import GeGLUExperts, GeGLUExpertsGate
from .functional import gated_packed, gated_proj
from .mlp import ops as _mlp
from .rmsnorm.layers import Gemma3nRMSNorm, GemmaRMSNorm
from .runtime.library import HubLayer


_is_compiling = torch.compiler.is_compiling
_GELU_ERF, _GELU_TANH = nn.GELU(), nn.GELU(approximate="tanh")


class GeluAndMul(HubLayer):
    """The layer computes ``x -> gelu(x[..., :d]) * x[..., d:]`` (erf GELU). Shapes: ``[..., 2d] -> [..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_packed(_GELU_ERF, x, act_first=True, inplace_backward=False)


class GeluTanhAndMul(HubLayer):
    """The layer computes ``x -> gelu_tanh(x[..., :d]) * x[..., d:]``. Shapes: ``[..., 2d] -> [..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_packed(_GELU_TANH, x, act_first=True, inplace_backward=False)


_PLAIN = (torch.Tensor, nn.Parameter)


def _plain_linear(m) -> bool:
    """An exact ``nn.Linear`` without bias or hooks, with a plain-tensor weight and its class's forward."""
    return (type(m) is nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and type(m.weight) in _PLAIN and "forward" not in m.__dict__)


class GeGLUMLP(HubLayer):
    """The layer computes ``x -> down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Gemma, Gemma 2/3/4, ...).

    Shapes: x ``[..., D]`` -> ``[..., D_out]``; gate_proj, up_proj ``D -> H``, down_proj ``H -> D_out``.

    GELU form (erf or tanh) from ``act_fn``; a non-GELU activation runs the host's computation. Plain bias-free
    ``nn.Linear`` projections run ``mlp.ops.geglu_mlp``: training gives eager's output and gradients bit for bit;
    inference at prefill sizes may take the fused gate/up GEMM (not eager's bits; off with ``fused_mlp`` /
    ``GEGLU_FUSED_MLP=0``), under torch.compile where the shipped rule allows it for the rows (one guard), else the
    host's ops; compiled training traces the host's ops. Other projections run their own forward.
    """

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj, act = self.gate_proj, self.up_proj, self.down_proj, self.act_fn
        approximate = gelu_approximation(act)
        if approximate is not None and _plain_linear(gate_proj) and _plain_linear(up_proj) and _plain_linear(down_proj):
            return _mlp.geglu_mlp(x, gate_proj.weight, up_proj.weight, down_proj.weight, approximate, act)
        # quantized, adapted, hooked, biased or sharded projections: their own forward
        return down_proj(gated_proj(act, gate_proj(x), up_proj, x))


class GeGLUMLPWithDropout(GeGLUMLP):
    """``x -> down_proj(dropout(act_fn(gate_proj(x)) * up_proj(x)))``, the host's dropout (T5Gemma, T5Gemma 2, Gte)."""

    dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(gated_proj(self.act_fn, self.gate_proj(x), self.up_proj, x)))


class GeGLUSelfConditioning(GeGLUMLP):
    """DiffusionGemma's self-conditioning: ``(e, signal) -> post_norm(e + mlp(pre_norm(signal)))``, with the host's
    norms and :class:`GeGLUMLP`'s computation as ``mlp``."""

    pre_norm: nn.Module
    post_norm: nn.Module

    def forward(self, inputs_embeds: torch.Tensor, self_conditioning_signal: torch.Tensor) -> torch.Tensor:
        normed = self.pre_norm(self_conditioning_signal)
        return self.post_norm(inputs_embeds + GeGLUMLP.forward(self, normed))


class Gemma3nGeGLUMLP(GeGLUMLP):
    """Gemma 3n's text MLP: :class:`GeGLUMLP`'s formula, the gate first through the host's ``_gaussian_topk`` where
    ``activation_sparsity > 0`` (then no in-place backward: the top-k's ReLU saves the gate it would overwrite)."""

    activation_sparsity: float
    _gaussian_topk: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(hidden_states)
        sparse = self.activation_sparsity > 0.0
        if sparse:
            gate = self._gaussian_topk(gate)
        return self.down_proj(gated_proj(self.act_fn, gate, self.up_proj, hidden_states, inplace_backward=not sparse))


class T5GeGLUDense(HubLayer):
    """The layer computes ``h -> wo(dropout(act(wi_0(h)) * wi_1(h)))`` (T5 v1.1 / flan-T5 gated-gelu, mT5, UMT5,
    UDOP, Pix2Struct, Kosmos-2.5); as T5, the product is cast to ``wo.weight.dtype`` if that differs and is not int8."""

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


class LongT5GeGLUDense(T5GeGLUDense):
    """LongT5's gated feed-forward: :class:`T5GeGLUDense` without the cast to ``wo.weight.dtype``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(gated_proj(self.act, self.wi_0(hidden_states), self.wi_1, hidden_states)))


class ModernBertGeGLUMLP(HubLayer):
    """The layer computes ``x -> Wo(drop(act(a) * b))`` with ``a, b = Wi(x).chunk(2, -1)``, read in place."""

    Wi: nn.Module
    act: nn.Module
    drop: nn.Module
    Wo: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.drop(gated_packed(self.act, self.Wi(hidden_states), act_first=True)))


class Zamba2GeGLUMLP(HubLayer):
    """Zamba2's MLP: ``down_proj(act_fn(gate) * up)`` of ``gate, up = (gate_up_proj(x) + adapter(x)).chunk(2, -1)``,
    the LoRA adapter ``gate_up_proj_adapter_list[layer_dic[layer_idx]]``."""

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


class ClvpGeGLU(HubLayer):
    """The layer computes ``x -> h * act(gate)`` with ``h, gate = proj(x).chunk(2, -1)``."""

    proj: nn.Module
    activation_fn: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_packed(self.activation_fn, self.proj(hidden_states), act_first=False)


class CpmAntGeGLU(HubLayer):
    """The layer computes ``h -> act(w_0(h)) * w_1(h)`` (CPM-Ant; the caller applies the output projection)."""

    w_0: nn.Module
    w_1: nn.Module
    act: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_proj(self.act, self.w_0(hidden_states), self.w_1, hidden_states)


def _rotary(module, x: torch.Tensor, position_ids: torch.Tensor, prefix: str):
    """The rotary embedding's ``cos, sin`` from one op (``_rope.rope_cos_sin``)."""
    inv_freq = getattr(module, prefix + "inv_freq")
    scaling = getattr(module, prefix + "attention_scaling")
    return _rope_cos_sin(position_ids.to(x.device), inv_freq, float(scaling), x.dtype)


class RotaryEmbedding(HubLayer):
    """Gemma rotary embedding ``(x, position_ids) -> cos, sin`` of the positions times ``inv_freq``: the host's
    forward in eager; under torch.compile one op (``_rope.rope_cos_sin``, eager's bits) from ``ROPE_OP_MIN_ROWS``
    positions (batch x sequence) on, the host's forward below (one guard on the symbolic count). Positions need no
    gradient."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if not _is_compiling() or position_ids.numel() < ROPE_OP_MIN_ROWS:
            return type(self).forward(self, x, position_ids)  # the host's forward
        return _rotary(self, x, position_ids, "")


class LayerTypeRotaryEmbedding(HubLayer):
    """:class:`RotaryEmbedding` for ``forward(x, position_ids, layer_type)``, buffers ``<layer_type>_inv_freq``."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type):
        if not _is_compiling() or position_ids.numel() < ROPE_OP_MIN_ROWS:
            return type(self).forward(self, x, position_ids, layer_type)  # the host's forward
        return _rotary(self, x, position_ids, f"{layer_type}_")


__all__ = [
    "GeluAndMul", "GeluTanhAndMul", "GeGLUMLP", "GeGLUMLPWithDropout", "GeGLUSelfConditioning", "Gemma3nGeGLUMLP",
    "T5GeGLUDense", "LongT5GeGLUDense", "ModernBertGeGLUMLP", "Zamba2GeGLUMLP", "ClvpGeGLU", "CpmAntGeGLU",
    "GeGLUExpertsGate", "GeGLUExperts", "GemmaRMSNorm", "Gemma3nRMSNorm", "RotaryEmbedding", "LayerTypeRotaryEmbedding",
]
