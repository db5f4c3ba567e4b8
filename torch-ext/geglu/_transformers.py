"""The transformers integration, shipped with the kernel: which transformers classes this kernel's layers replace,
and the call that maps them for ``kernels.kernelize``.

transformers marks none of its GeGLU MLP classes for kernel replacement, so kernelize alone does nothing to them.
After ``geglu = kernels.get_kernel("geglu-kernels/geglu", version=1)``, one call makes the connection::

    geglu.register_transformers()                # every supported class -> this kernel's layers, cuda and cpu
    model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b").cuda()
    kernels.kernelize(model, mode=Mode.INFERENCE)   # or Mode.TRAINING, optionally | Mode.TORCH_COMPILE

transformers' own switch, ``from_pretrained(..., use_kernels=True)`` (the default from transformers 5.25), then
kernelizes with this mapping on any device; its KernelConfig route (GPU models; transformers refuses KernelConfig
on CPU) takes::

    model.set_use_kernels(True, geglu.transformers_kernel_config(model))

This module imports torch and the package's own ``_activations`` when loaded; ``kernels`` and ``transformers`` only
when one of its functions runs, so the kernel still loads where they are not installed. It works with kernels
0.17.2-0.19.x and transformers 5.22.2-5.25.x (the range the repository's CI runs).

What :func:`register_transformers` does:

1. ``kernels.replace_kernel_forward_from_hub(cls, key)`` for every supported class of :data:`GEGLU_CLASSES` that
   the installed transformers has (others are skipped), with a condition that leaves a module alone when its
   activation is not a GELU the kernel computes (a Gemma configured with ``hidden_act="relu"``, a gated-ReLU T5):
   such a module keeps its own forward.
2. A kernel mapping from each key to a repository of the layer for Mode.INFERENCE, Mode.TRAINING and both with
   Mode.TORCH_COMPILE, on each requested device: by default ``LocalLayerRepository`` on this loaded kernel's own
   folder (the very build that ``get_kernel`` or ``get_locked_kernel`` returned: same commit, no second download),
   or, with ``repo_id=``, ``LayerRepository(repo_id, version=|revision=)`` / ``LockedLayerRepository(lockfile=)``.
   It is registered globally with ``kernels.register_kernel_mapping`` (``register=False`` only returns it, for
   ``kernels.use_kernel_mapping``).
3. :data:`GEGLU_CLASSES`, :data:`NORM_CLASSES` and :data:`ROPE_CLASSES`: every GeGLU class, Gemma RMSNorm and Gemma
   rotary embedding of transformers with its status (the repository's docs and tests read them).

MoE experts (``Gemma4TextExperts``, ``DiffusionGemmaTextExperts``) keep transformers' ``@use_experts_implementation``
dispatch. Their ``_apply_gate``, which the grouped_mm and batched_mm implementations call between the two grouped
GEMMs, becomes a call of a gate layer (:class:`ExpertsGate`, around :func:`experts_gate`), one per experts module,
mapped to the layer ``GeGLUExpertsGate``; the class itself gets the layer ``GeGLUExperts``, which runs the eager
implementation's loop with the packed gate and calls the class's own forward (the dispatch) for every other
implementation. Register before building a MoE model.

The keys are ``"geglu.<Layer>"``, not the bare layer names: transformers' own default mapping, which
``from_pretrained(use_kernels=True)`` and ``set_use_kernels`` register again on every call, has a ``"GeGLUMLP"``
entry for cuda pointing at Liger's tanh-only GEGLU kernels, which would replace ours under that key.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from . import _activations as _ACTIVATIONS

KEY_PREFIX = "geglu."

SUPPORTED = "supported"  # bit-exact with eager for the model's default activation (gelu / gelu_pytorch_tanh)
SUPPORTED_APPROX = "supported-approx"  # default activation is gelu_new: within a stated tolerance, not bit-exact
NOT_SUPPORTED = "not-supported"





@dataclass(frozen=True)
class HostClass:
    """One GeGLU class of transformers and how the kernel handles it."""

    model: str  # transformers model folder, e.g. "gemma"
    name: str  # class name in transformers.models.<model>.modeling_<model>
    layer: str | None  # layer of the kernel's ``layers`` module that replaces its forward; None: not supported
    status: str  # SUPPORTED, SUPPORTED_APPROX or NOT_SUPPORTED
    activation: str  # the activation the class gets from a default config
    note: str = ""
    act_attr: str | None = None  # attribute of the host that holds its activation module
    gate_layer: str | None = None  # MoE experts: the function layer for their _apply_gate (see _attach_experts_gate)

    @property
    def module(self) -> str:
        return f"transformers.models.{self.model}.modeling_{self.model}"

    @property
    def key(self) -> str | None:
        """The kernelize key (``kernel_layer_name``) the class gets."""
        return KEY_PREFIX + self.layer if self.layer else None

    @property
    def gate_key(self) -> str | None:
        """The kernelize key of the experts' gate function layer (MoE experts only)."""
        return KEY_PREFIX + self.gate_layer if self.gate_layer else None

    def load(self) -> type | None:
        """The class from the installed transformers, or None when it has no such module or class."""
        try:
            mod = importlib.import_module(self.module)
        except ImportError:
            return None
        return getattr(mod, self.name, None)


def _a(model, name, activation="gelu_pytorch_tanh", note="", layer="GeGLUMLP", status=SUPPORTED, act_attr="act_fn",
       gate_layer=None):
    return HostClass(model, name, layer, status, activation, note, act_attr, gate_layer)


_T5_NOTE = "{} with its cast to wo.weight.dtype (T5 keeps wo in fp32)"
_STRIDED_NOTE = ("CPU: not bit-exact (about 1e-7 relative: eager's CPU erf-GELU rounds differently on the strided "
                 "chunk views), GPU: bit-exact")

_EXPERTS_NOTE = ("MoE experts, every experts implementation (grouped_mm, batched_mm: their _apply_gate runs the "
                 "function layer GeGLUExpertsGate; eager: GeGLUExperts runs its per-expert loop with the packed "
                 "gate); CPU: bit-exact with gelu_pytorch_tanh and moe_intermediate_size a multiple of 32 (704 in "
                 "Gemma 4 26B-A4B), else about 1e-7 relative (strided chunk views), GPU: bit-exact; grouped_mm "
                 "inference from 2048 routed rows on sm_90: the fused gate/up grouped GEMM (fused_mlp, as GeGLUMLP)")

GEGLU_CLASSES: tuple[HostClass, ...] = (
    # down_proj(act_fn(gate_proj(x)) * up_proj(x))
    _a("gemma", "GemmaMLP"),
    _a("gemma2", "Gemma2MLP"),
    _a("gemma3", "Gemma3MLP", note="Gemma 3 text and the text part of Gemma 3 multimodal"),
    _a("gemma4", "Gemma4TextMLP"),
    _a("gemma4", "Gemma4VisionMLP", note="clippable linears: the clamps stay inside gate/up/down_proj"),
    _a("gemma4_unified", "Gemma4UnifiedTextMLP"),
    _a("embedding_gemma2", "EmbeddingGemma2MLP"),
    _a("vaultgemma", "VaultGemmaMLP"),
    _a("diffusion_gemma", "DiffusionGemmaText4MLP"),
    _a("recurrent_gemma", "RecurrentGemmaMlp", note="projections with biases"),
    _a("zamba", "ZambaMLP", activation="gelu"),
    _a("pixtral", "PixtralMLP", activation="gelu",
       note="vision encoder; a checkpoint with hidden_act='silu' keeps its own forward"),
    _a("dinov3_vit", "DINOv3ViTGatedMLP", activation="gelu", note="used only with use_gated_mlp=True"),
    _a("eomt_dinov3", "EomtDinov3GatedMLP", activation="gelu",
       note="used only with use_gated_mlp=True"),
    # DiffusionGemma's self-conditioning: post_norm(inputs_embeds + MLP(pre_norm(signal)))
    _a("diffusion_gemma", "DiffusionGemmaSelfConditioning", layer="GeGLUSelfConditioning",
       note="forward(inputs_embeds, self_conditioning_signal): the host's pre_norm, the GeGLU MLP, the sum and the "
            "host's post_norm"),
    # ... with dropout between the product and down_proj
    _a("t5gemma", "T5GemmaMLP", layer="GeGLUMLPWithDropout"),
    _a("t5gemma2", "T5Gemma2MLP", layer="GeGLUMLPWithDropout"),
    _a("gte", "GteMLP", activation="gelu", layer="GeGLUMLPWithDropout", note="down_proj with bias"),
    # Gemma 3n: Gaussian top-k on the gate of the first layers (activation_sparsity > 0)
    _a("gemma3n", "Gemma3nTextMLP", layer="Gemma3nGeGLUMLP",
       note="the host's _gaussian_topk runs on the gate first where activation_sparsity > 0"),
    # T5 style: wo(dropout(act(wi_0(h)) * wi_1(h)))
    _a("t5", "T5DenseGatedActDense", activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX,
       act_attr="act", note=_T5_NOTE.format("T5 v1.1 / flan-T5 (feed_forward_proj='gated-gelu')")),
    _a("mt5", "MT5DenseGatedActDense", activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX,
       act_attr="act", note=_T5_NOTE.format("mT5")),
    _a("umt5", "UMT5DenseGatedActDense", activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX,
       act_attr="act", note=_T5_NOTE.format("UMT5")),
    _a("longt5", "LongT5DenseGatedActDense", activation="gelu_new", layer="LongT5GeGLUDense",
       status=SUPPORTED_APPROX, act_attr="act",
       note="with feed_forward_proj='gated-gelu' (the config default is relu: not gated); no cast, as LongT5"),
    _a("udop", "UdopDenseGatedActDense", activation="gelu", layer="T5GeGLUDense", act_attr="act",
       note="with feed_forward_proj='gated-gelu', which gives UDOP dense_act_fn='gelu' (the config default is relu: "
            "not gated)"),
    _a("pix2struct", "Pix2StructTextDenseGatedActDense", activation="gelu_new", layer="T5GeGLUDense",
       status=SUPPORTED_APPROX, act_attr="act"),
    _a("pix2struct", "Pix2StructVisionMlp", activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX,
       act_attr="act"),
    _a("kosmos2_5", "Kosmos2_5VisionMlp", activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX,
       act_attr="act"),
    # packed: input, gate = Wi(x).chunk(2, -1)
    _a("modernbert", "ModernBertMLP", activation="gelu", layer="ModernBertGeGLUMLP", act_attr="act",
       note="packed Wi read in place; " + _STRIDED_NOTE),
    _a("modernbert_decoder", "ModernBertDecoderMLP", activation="gelu", layer="ModernBertGeGLUMLP", act_attr="act",
       note="as ModernBertMLP; " + _STRIDED_NOTE),
    _a("zamba2", "Zamba2MLP", activation="gelu", layer="Zamba2GeGLUMLP",
       note="packed gate_up_proj plus the per-block LoRA adapter; forward(hidden_state, layer_idx); "
            + _STRIDED_NOTE),
    _a("clvp", "ClvpGatedLinearUnit", activation="gelu", layer="ClvpGeGLU", act_attr="activation_fn",
       note="activation on the second half: h * act(gate); " + _STRIDED_NOTE),
    _a("cpmant", "CpmAntDenseGatedACT", activation="gelu (fixed nn.GELU())", layer="CpmAntGeGLU", act_attr="act",
       note="the gated activation only; w_out is applied by the caller"),
    # MoE experts: transformers' @use_experts_implementation dispatch stays; the gate between the grouped GEMMs
    # is a function layer (GeGLUExpertsGate), the eager loop the class layer (GeGLUExperts)
    _a("gemma4", "Gemma4TextExperts", layer="GeGLUExperts", gate_layer="GeGLUExpertsGate", note=_EXPERTS_NOTE),
    _a("diffusion_gemma", "DiffusionGemmaTextExperts", layer="GeGLUExperts", gate_layer="GeGLUExpertsGate",
       note="MoE experts, as Gemma4TextExperts"),
    # not supported
    _a("pop2piano", "Pop2PianoDenseGatedActDense", activation="relu", layer=None, status=NOT_SUPPORTED,
       act_attr="act", note="gated ReLU: dense_act_fn defaults to relu even with feed_forward_proj='gated-gelu'"),
    _a("moshi", "MoshiGatingMLP", activation="silu", layer=None, status=NOT_SUPPORTED, act_attr="activation_fn",
       note="SwiGLU by default (hidden_act='silu'); also per-codebook FlexibleLinear projections"),
    _a("kyutai_speech_to_text", "KyutaiSpeechToTextGatingMLP", activation="silu", layer=None,
       status=NOT_SUPPORTED, act_attr="activation_fn", note="as MoshiGatingMLP"),
)


# --- Gemma's RMSNorm ----------------------------------------------------------------------------------------------
# Classes whose forward is GemmaRMSNorm's, ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1.0 +
# w.float())).type_as(x)``, op for op (a test compares their source); those whose forward is Gemma3nRMSNorm's,
# ``(x.float() * pow(mean(x.float()^2) + eps, -0.5) [* w.float()]).type_as(x)`` (layer Gemma3nRMSNorm); and the
# Gemma-family norms that differ from both.
# "supported-approx": on CUDA within one ulp of the output dtype against fp64, not bit-exact (the row sum is taken
# in another order; docs/rmsnorm.md); on CPU bit-exact.


def _n(model, name, note="", layer="GemmaRMSNorm", status=SUPPORTED_APPROX):
    return HostClass(model, name, layer, status, "", note)


_SCALED = "scale w (not 1 + w), torch.pow(ms, -0.5); instances with with_scale=False have no weight"

NORM_CLASSES: tuple[HostClass, ...] = (
    _n("gemma", "GemmaRMSNorm"),
    _n("gemma2", "Gemma2RMSNorm"),
    _n("gemma3", "Gemma3RMSNorm", note="also q_norm / k_norm (rows of head_dim) and the multimodal projector"),
    _n("recurrent_gemma", "RecurrentGemmaRMSNorm"),
    _n("t5gemma", "T5GemmaRMSNorm"),
    _n("t5gemma2", "T5Gemma2RMSNorm"),
    _n("vaultgemma", "VaultGemmaRMSNorm"),
    _n("qwen3_next", "Qwen3NextRMSNorm", note="Gemma's form in a SwiGLU model"),
    _n("qwen3_5", "Qwen3_5RMSNorm", note="as Qwen3NextRMSNorm"),
    _n("qwen3_5_moe", "Qwen3_5MoeRMSNorm", note="as Qwen3NextRMSNorm"),
    _n("qwen4_exp", "Qwen4ExpTextRMSNorm", note="instances with group_size=None; grouped ones keep their forward"),
    _n("step3p7", "Step3p7RMSNorm"),
    _n("minimax_m3_vl", "MiniMaxM3VLRMSNorm"),
    _n("muse_glimmer", "MuseGlimmerTextCenteredRMSNorm"),
    _n("gemma3n", "Gemma3nRMSNorm", layer="Gemma3nRMSNorm", note=_SCALED),
    _n("gemma4", "Gemma4RMSNorm", layer="Gemma3nRMSNorm", note="as Gemma3nRMSNorm; also q/k/v_norm and the router's"),
    _n("gemma4_unified", "Gemma4UnifiedRMSNorm", layer="Gemma3nRMSNorm", note="as Gemma3nRMSNorm"),
    _n("embedding_gemma2", "EmbeddingGemma2RMSNorm", layer="Gemma3nRMSNorm", note="as Gemma3nRMSNorm"),
    _n("diffusion_gemma", "DiffusionGemmaRMSNorm", layer="Gemma3nRMSNorm", note="as Gemma3nRMSNorm"),
    _n("neomme", "NeoMMERMSNorm", layer="Gemma3nRMSNorm", note="as Gemma3nRMSNorm (its norms have no weight)"),
    _n("muse_spark", "MuseSparkTextCenteredRMSNorm", layer=None, status=NOT_SUPPORTED,
       note="(1.0 + weight).float(): the scale is rounded in the weight's dtype"),
    _n("muse_spark", "MuseSparkTextInputScaledRMSNorm", layer=None, status=NOT_SUPPORTED,
       note="scales before normalizing, through a round trip to x's dtype"),
)


# --- the rotary embedding ----------------------------------------------------------------------------------------
# Gemma-family classes whose forward computes ``cos, sin`` of ``position_ids[..., None].float() * inv_freq`` (twice
# over the last dimension) times ``attention_scaling``, op for op (a test compares their source): layer
# RotaryEmbedding for ``forward(x, position_ids)``, LayerTypeRotaryEmbedding for ``forward(x, position_ids,
# layer_type)``. The layers change nothing in eager mode; under torch.compile their cos and sin come from one op,
# which Inductor reads instead of recomputing them in every attention layer (torch-ext/geglu/_rope.py).


def _r(model, name, layer="RotaryEmbedding", note=""):
    return HostClass(model, name, layer, SUPPORTED, "", note)


_TYPED = "LayerTypeRotaryEmbedding"
ROPE_CLASSES: tuple[HostClass, ...] = (
    _r("gemma", "GemmaRotaryEmbedding"),
    _r("gemma2", "Gemma2RotaryEmbedding"),
    _r("gemma3", "Gemma3RotaryEmbedding", _TYPED, note="a table per attention type (sliding, full)"),
    _r("gemma3n", "Gemma3nRotaryEmbedding", _TYPED),
    _r("gemma4", "Gemma4TextRotaryEmbedding", _TYPED),
    _r("gemma4_unified", "Gemma4UnifiedTextRotaryEmbedding", _TYPED),
    _r("t5gemma", "T5GemmaRotaryEmbedding"),
    _r("t5gemma2", "T5Gemma2RotaryEmbedding", _TYPED),
    _r("vaultgemma", "VaultGemmaRotaryEmbedding"),
    _r("embedding_gemma2", "EmbeddingGemma2RotaryEmbedding", _TYPED),
    _r("diffusion_gemma", "DiffusionGemmaTextRotaryEmbedding", _TYPED),
)
# rope types whose inv_freq the host's forward changes as it runs (transformers' dynamic_rope_update): those
# modules keep their own forward
_DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


def _rope_condition(module) -> bool:
    """A rotary embedding the layer computes: static rope types only (dynamic and longrope tables change with the
    positions, inside the host's forward), and a forward nobody else has replaced."""
    rope_type = getattr(module, "rope_type", None)
    types_ = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return all(isinstance(t, str) and t not in _DYNAMIC_ROPE for t in types_) and not _forward_taken(module)


# the hub layers' class names: a forward that kernelize put there (any mode) is ours to replace again
_OUR_LAYERS = frozenset({h.layer for h in GEGLU_CLASSES + NORM_CLASSES + ROPE_CLASSES if h.layer}
                        | {h.gate_layer for h in GEGLU_CLASSES if h.gate_layer})


def _forward_taken(module) -> bool:
    """Whether something other than kernelize replaced this module's forward (transformers' tensor parallelism and
    accelerate wrap ``module.forward`` to move activations or reduce gradients): kernelize must not overwrite it."""
    fwd = module.__dict__.get("forward")
    if fwd is None:
        return False
    qualname = getattr(getattr(fwd, "__func__", None), "__qualname__", "")
    return qualname.rpartition(".")[0] not in _OUR_LAYERS


def _norm_eps(module):
    """The norm's epsilon: ``eps``, or ``variance_epsilon`` (Gemma3nRMSNorm's family from transformers 5.25)."""
    eps = getattr(module, "eps", None)
    return getattr(module, "variance_epsilon", None) if eps is None else eps


def _norm_condition(module) -> bool:
    """A norm the layer computes: a 1-D weight, a float eps and no grouping (Qwen4ExpTextRMSNorm's group_size), whose
    forward nobody else has replaced."""
    import torch

    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(_norm_eps(module), float)
            and getattr(module, "group_size", None) is None and not _forward_taken(module))


def _scaled_norm_condition(module) -> bool:
    """A Gemma 3n-form norm the layer computes: a float eps and either a 1-D weight (with_scale) or none."""
    import torch

    with_scale = getattr(module, "with_scale", None)
    weight = getattr(module, "weight", None)
    scale_ok = (isinstance(weight, torch.Tensor) and weight.dim() == 1) if with_scale else with_scale is False
    return scale_ok and isinstance(_norm_eps(module), float) and not _forward_taken(module)


def is_kernel_gelu(act: Any) -> bool:
    """Whether ``act`` (a host's activation) computes a GELU the kernel computes (erf or tanh form)."""
    return _ACTIVATIONS.gelu_approximation(act) is not None


def _gelu_condition(act_attr: str):
    def condition(module) -> bool:
        return is_kernel_gelu(getattr(module, act_attr, None)) and not _forward_taken(module)

    condition.__qualname__ = f"geglu_condition[{act_attr}]"
    return condition


def experts_gate(act_fn, gate_up):
    """The gate of transformers' experts classes as transformers computes it (its default ``_apply_gate``):
    ``act_fn(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)``. Registered experts classes call it through their
    :class:`ExpertsGate` layer, whose forward kernelize replaces with the hub layer ``GeGLUExpertsGate``;
    unkernelized, it runs these ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


class ExpertsGate(torch.nn.Module):
    """:func:`experts_gate` as a layer, one per experts module: what ``kernels.use_kernel_forward_from_hub`` makes
    of a function (an ``nn.Module`` whose forward calls it), as a named class so that models still pickle (kernels'
    own wrapper is a local class). :func:`register_transformers` gives it the key ``geglu.GeGLUExpertsGate``."""

    def forward(self, act_fn, gate_up):
        return experts_gate(act_fn, gate_up)


def _apply_gate_through(key: str):
    def _apply_gate(self, gate_up):
        funcs = getattr(self, "_kernel_funcs", None)
        gate = funcs.get(key) if funcs is not None else None
        if gate is None:  # a module built before register_transformers: it has no gate layer, and kernelize skips it
            return experts_gate(self.act_fn, gate_up)
        return gate(self.act_fn, gate_up)

    _apply_gate.__qualname__ = f"geglu_apply_gate[{key}]"
    return _apply_gate


def _attach_experts_gate(cls: type, key: str) -> None:
    """Route ``cls._apply_gate`` (transformers' grouped_mm / batched_mm experts call it between the two grouped
    GEMMs) through an :class:`ExpertsGate` layer under ``key``, one per experts module.

    kernels' ``use_kernelized_func`` would attach a single function-layer instance to every module of the class,
    so kernelize of one model would switch the gate of every model in the process (and a deep copy would get its
    own unswapped instance). Here each module gets its own gate layer at construction, in ``_kernel_funcs`` (where
    ``use_kernelized_func`` puts function layers and kernelize looks for them): kernelize swaps the gates of the
    model it is given, as it does for the class layers. Modules built before this call have none and keep
    transformers' gate. Idempotent."""
    import functools

    from kernels import replace_kernel_forward_from_hub

    replace_kernel_forward_from_hub(ExpertsGate, key)
    if getattr(cls.__init__, "_geglu_gate", None) == key:
        return
    moe = importlib.import_module("transformers.integrations.moe")
    if getattr(cls, "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        raise TypeError(f"register_transformers: {cls.__module__}.{cls.__name__}._apply_gate is not transformers' "
                        "default gate (chunk, act_fn(gate) * up), so the GeGLU gate layer cannot stand in for it. "
                        "Remove the class from GEGLU_CLASSES or give it a layer that computes its gate.")
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__.setdefault("_kernel_funcs", {})[key] = ExpertsGate()

    __init__._geglu_gate = key
    cls.__init__ = __init__
    cls._apply_gate = _apply_gate_through(key)


@dataclass
class GeGLURegistration:
    """What :func:`register_transformers` did."""

    mapping: dict  # {key: {device: {Mode: repository}}}, for kernels.use_kernel_mapping / register_kernel_mapping
    classes: dict[str, type] = field(default_factory=dict)  # "module.Class" -> class now carrying a key
    skipped: list[str] = field(default_factory=list)  # supported classes the installed transformers lacks


def _own_dir() -> Path:
    """This loaded variant's folder, as the loader saw it (not resolved: in the Hub cache its files are symlinks
    into the blob store)."""
    return Path(os.path.abspath(os.path.dirname(__file__)))


def _repository_factory(repo_id, *, version, revision, lockfile, trust_remote_code):
    from kernels import LayerRepository, LocalLayerRepository, LockedLayerRepository

    if repo_id is None:
        if version is not None or revision is not None or lockfile is not None:
            raise ValueError("register_transformers: version=, revision= and lockfile= name a Hub repository: pass "
                             "repo_id= with them, or none of them to map this loaded kernel.")
        own = _own_dir()
        return lambda layer: LocalLayerRepository(own, layer_name=layer)
    if lockfile is not None:
        return lambda layer: LockedLayerRepository(repo_id, lockfile=Path(lockfile), layer_name=layer,
                                                   trust_remote_code=trust_remote_code)
    if revision is not None:
        return lambda layer: LayerRepository(repo_id, layer_name=layer, revision=revision,
                                             trust_remote_code=trust_remote_code)
    if version is None:
        raise ValueError(f"register_transformers: repo_id={repo_id!r} needs version=N, revision=... or lockfile=....")
    return lambda layer: LayerRepository(repo_id, layer_name=layer, version=version,
                                         trust_remote_code=trust_remote_code)


def register_transformers(*, devices: Sequence[str] = ("cuda", "cpu"), register: bool = True, norms: bool = True,
                          rope: bool = True, repo_id: str | None = None, version: int | None = None,
                          revision: str | None = None, lockfile: str | Path | None = None,
                          trust_remote_code: bool | list[str] = False) -> GeGLURegistration:
    """Make ``kernels.kernelize`` replace the forward of every supported transformers class (GeGLU MLPs, MoE
    experts, Gemma RMSNorms, Gemma rotary embeddings) with this kernel's layers.

    Args:
        devices: device types to map; on ``"cpu"`` the kernel runs its CPU implementation (eager's numerics, no
            speed-up; useful for tests and CPU-only CI).
        register: register the mapping globally (``kernels.register_kernel_mapping``, merged into the current
            one). With False it is only returned, for ``with kernels.use_kernel_mapping(reg.mapping): ...``.
        norms: also map the Gemma RMSNorm classes of :data:`NORM_CLASSES` (the default). On CUDA the fused norm is
            within one ulp of eager's output, not bit-exact; ``norms=False`` keeps the hosts' own norms.
        rope: also map the Gemma rotary embeddings of :data:`ROPE_CLASSES` (the default): the host's forward in
            eager mode; under torch.compile one op computes the positions' cos and sin.
        repo_id: map a Hub repository's layers instead of this loaded kernel's, at ``version=N``, ``revision=``
            or the commit a ``lockfile=`` (``kernels lock``) pins; ``trust_remote_code`` is passed to them.

    Every mode is mapped: Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE and
    Mode.TRAINING | Mode.TORCH_COMPILE. Calling this again re-registers: each key's entry for a device is replaced.

    Returns:
        A :class:`GeGLURegistration` with the mapping, the classes that now carry a key, and the supported classes
        the installed transformers does not have.
    """
    from kernels import Mode, register_kernel_mapping, replace_kernel_forward_from_hub

    _own_origin()  # before kernelize loads this folder again as a local kernel (which records no origin)
    repository = _repository_factory(repo_id, version=version, revision=revision, lockfile=lockfile,
                                     trust_remote_code=trust_remote_code)
    modes = (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)
    reg = GeGLURegistration(mapping={})
    repos: dict[str, Any] = {}  # one repository per layer: kernels loads and validates each once

    def map_key(key: str, layer: str) -> None:
        if layer not in repos:
            repos[layer] = repository(layer)
        reg.mapping[key] = {device: {mode: repos[layer] for mode in modes} for device in devices}

    hosts = [(h, _gelu_condition(h.act_attr) if h.act_attr else None) for h in GEGLU_CLASSES]
    hosts += [(h, _scaled_norm_condition if h.layer == "Gemma3nRMSNorm" else _norm_condition)
              for h in NORM_CLASSES] if norms else []
    hosts += [(h, _rope_condition) for h in ROPE_CLASSES] if rope else []
    for host, condition in hosts:
        if host.layer is None:
            continue
        cls = host.load()
        if cls is None:
            reg.skipped.append(f"{host.module}.{host.name}")
            continue
        replace_kernel_forward_from_hub(cls, host.key, condition)
        reg.classes[f"{host.module}.{host.name}"] = cls
        map_key(host.key, host.layer)
        if host.gate_layer is not None:  # MoE experts: the gate between their grouped GEMMs, a layer per module
            _attach_experts_gate(cls, host.gate_key)
            map_key(host.gate_key, host.gate_layer)
    if register:
        register_kernel_mapping(reg.mapping)
        # kernelize warns "No kernel mapping found for layer X" for every module of a hub layer name that has no
        # entry at all (transformers marks rotary_pos_emb, GeluTanh, RMSNorm, ...). An entry with no device keeps
        # their own forward silently; an entry already registered (transformers' own mapping) is left as it is.
        register_kernel_mapping({name: {} for name in _transformers_layer_names()})
    return reg


def _transformers_layer_names() -> list[str]:
    """The hub layer names of transformers' default kernel mapping (none when transformers lacks it)."""
    try:
        from transformers.integrations.hub_kernels import get_kernel_mapping_transformers
    except ImportError:
        return []
    return sorted(get_kernel_mapping_transformers())


_ORIGIN: list = []  # (repo_id, commit) once found: a later local load of the same folder records no origin


def _own_origin():
    """(repo_id, commit) of the Hub repository this kernel was loaded from (``kernels.get_loaded_kernels``), or None
    (loaded from a folder)."""
    if not _ORIGIN:
        import kernels

        here = __name__.rpartition(".")[0]
        for loaded in kernels.get_loaded_kernels():
            if loaded.module.__name__ == here and loaded.repo_info is not None:
                _ORIGIN.append((loaded.repo_info.repo_id, str(loaded.repo_info.revision)))
                break
    return _ORIGIN[0] if _ORIGIN else None


def transformers_kernel_config(model: Any, *, repo_id: str | None = None, version: int | None = None,
                               revision: str | None = None, trust_remote_code: bool = False,
                               inherit_mapping: bool = False):
    """A transformers ``KernelConfig`` that maps the supported classes found in ``model`` to this kernel, for
    transformers' own route::

        model.set_use_kernels(True, geglu.transformers_kernel_config(model))   # a loaded model: scanned
        model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, device_map="cuda",
                                                     kernel_config=geglu.transformers_kernel_config(GemmaForCausalLM))

    ``model`` is a model instance or a transformers model class (KernelConfig accepts only keys present in the
    model). The layers come from the Hub repository and commit this kernel was loaded from (a kernel loaded from a
    folder: that folder, ``use_local_kernel=True``), or from ``repo_id`` at ``version``/``revision``. The classes get
    their keys first (:func:`register_transformers` with ``register=False``). transformers accepts KernelConfig for
    accelerator models only (``ValueError: Only devices in [...] are supported`` on CPU): there, use
    :func:`register_transformers` and ``kernels.kernelize``. ``inherit_mapping=True`` keeps transformers' own
    default mapping too (its kernels-community repositories must then be reachable).
    """
    from transformers import KernelConfig

    register_transformers(register=False)
    layer_of = {h.key: h.layer for h in GEGLU_CLASSES if h.layer}
    layer_of.update({h.gate_key: h.gate_layer for h in GEGLU_CLASSES if h.gate_layer})  # MoE experts' gate
    if isinstance(model, type):
        keys = {k for h in GEGLU_CLASSES if h.layer and h.module == model.__module__ for k in (h.key, h.gate_key) if k}
    else:
        keys = {getattr(type(m), "kernel_layer_name", None) for m in model.modules()}
        keys |= {k for m in model.modules() for k in (getattr(m, "_kernel_funcs", None) or {})}  # function layers
        keys &= set(layer_of)
    if not keys:
        where = model.__module__ if isinstance(model, type) else type(model).__name__
        raise ValueError(f"transformers_kernel_config: no supported GeGLU class in {where}. For a composite model "
                         "(e.g. PaliGemma) pass the loaded model instead of its class; GEGLU_CLASSES lists them.")
    if repo_id is None and (version is not None or revision is not None):
        raise ValueError("transformers_kernel_config: version= and revision= need repo_id=.")
    if repo_id is None:
        origin = _own_origin()
        if origin is None:
            return KernelConfig({key: f"{_own_dir()}:{layer_of[key]}" for key in sorted(keys)},
                                use_local_kernel=True, inherit_mapping=inherit_mapping)
        repo_id, revision = origin
    meta = {"version": version if version is not None else 1} if revision is None else {"revision": revision}
    meta["trust_remote_code"] = trust_remote_code
    return KernelConfig({key: (f"{repo_id}:{layer_of[key]}", dict(meta)) for key in sorted(keys)},
                        inherit_mapping=inherit_mapping)


def classes_markdown() -> str:
    """:data:`GEGLU_CLASSES`, :data:`NORM_CLASSES` and :data:`ROPE_CLASSES` as Markdown tables (the repository's
    docs/transformers.md holds them; a test keeps them equal)."""
    lines = ["| model | class | status | default activation | hub layer | notes |", "|---|---|---|---|---|---|"]
    for h in GEGLU_CLASSES:
        layer = f"`{h.layer}`" if h.layer else "–"
        if h.gate_layer:
            layer += f" + `{h.gate_layer}`"
        lines.append(f"| {h.model} | `{h.name}` | {h.status} | {h.activation} | {layer} | {h.note} |")
    lines += ["", "Gemma RMSNorm classes (mapped unless `norms=False`; docs/rmsnorm.md):", "",
              "| model | class | status | hub layer | notes |", "|---|---|---|---|---|"]
    for h in NORM_CLASSES:
        layer = f"`{h.layer}`" if h.layer else "–"
        lines.append(f"| {h.model} | `{h.name}` | {h.status} | {layer} | {h.note} |")
    lines += ["", "Gemma rotary embeddings (mapped unless `rope=False`; eager keeps their forward, "
              "torch.compile gets cos and sin from one op):", "", "| model | class | hub layer | notes |", "|---|---|---|---|"]
    for h in ROPE_CLASSES:
        lines.append(f"| {h.model} | `{h.name}` | `{h.layer}` | {h.note} |")
    return "\n".join(lines) + "\n"
