"""The transformers classes mapped to the kernel's layers: GeGLU MLPs and MoE experts (:data:`GEGLU_CLASSES`), Gemma
RMSNorms (:data:`NORM_CLASSES`) and rotary embeddings (:data:`ROPE_CLASSES`). Standard library only."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

KEY_PREFIX = "geglu."

SUPPORTED = "supported"  # bit-exact with eager for the model's default activation (gelu / gelu_pytorch_tanh)
SUPPORTED_APPROX = "supported-approx"  # default activation is gelu_new: within a stated tolerance, not bit-exact
NOT_SUPPORTED = "not-supported"


@dataclass(frozen=True)
class HostClass:
    """One GeGLU class of transformers and how the kernel handles it."""

    model: str  # transformers model folder, e.g. "gemma"
    name: str  # class name in transformers.models.<model>.modeling_<model>
    layer: str | None  # the ``layers`` class that replaces its forward; None: not supported
    status: str  # SUPPORTED, SUPPORTED_APPROX or NOT_SUPPORTED
    activation: str  # activation of a default config
    note: str = ""
    act_attr: str | None = None  # host attribute holding its activation module
    gate_layer: str | None = None  # MoE experts: the function layer for their _apply_gate

    @property
    def module(self) -> str:
        return f"transformers.models.{self.model}.modeling_{self.model}"

    @property
    def key(self) -> str | None:
        """The class's kernelize key (``kernel_layer_name``)."""
        return KEY_PREFIX + self.layer if self.layer else None

    @property
    def gate_key(self) -> str | None:
        """The kernelize key of the MoE experts' gate function layer."""
        return KEY_PREFIX + self.gate_layer if self.gate_layer else None

    def load(self) -> type | None:
        """The class from the installed transformers, or None if missing."""
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
    _a("eomt_dinov3", "EomtDinov3GatedMLP", activation="gelu", note="used only with use_gated_mlp=True"),
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
    # MoE experts: the gate between the grouped GEMMs is a function layer, the eager loop the class layer
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


# --- Gemma's RMSNorm: layer GemmaRMSNorm where the forward is, op for op,
# ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1.0 + w.float())).type_as(x)``; Gemma3nRMSNorm where it is
# ``(x.float() * pow(mean(x.float()^2) + eps, -0.5) [* w.float()]).type_as(x)``. "supported-approx": within one ulp
# against fp64 on CUDA, bit-exact on CPU.
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


# --- rotary embeddings: forward ``cos, sin`` of ``position_ids[..., None].float() * inv_freq`` (twice over the last
# dim) times ``attention_scaling``, op for op; LayerTypeRotaryEmbedding for ``forward(x, position_ids, layer_type)``.
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


def classes_markdown() -> str:
    """The three class tables as the Markdown of docs/transformers.md."""
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
