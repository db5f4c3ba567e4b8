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
    activation: str  # activation of a default config (the notes on each class: docs/transformers.md)
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


def _a(model, name, activation="gelu_pytorch_tanh", layer="GeGLUMLP", status=SUPPORTED, act_attr="act_fn",
       gate_layer=None):
    return HostClass(model, name, layer, status, activation, act_attr, gate_layer)


def _t5(model, name, activation="gelu_new", layer="T5GeGLUDense", status=SUPPORTED_APPROX):
    return _a(model, name, activation, layer, status, act_attr="act")


GEGLU_CLASSES: tuple[HostClass, ...] = (
    # down_proj(act_fn(gate_proj(x)) * up_proj(x))
    _a("gemma", "GemmaMLP"),
    _a("gemma2", "Gemma2MLP"),
    _a("gemma3", "Gemma3MLP"),
    _a("gemma4", "Gemma4TextMLP"),
    _a("gemma4", "Gemma4VisionMLP"),
    _a("gemma4_unified", "Gemma4UnifiedTextMLP"),
    _a("embedding_gemma2", "EmbeddingGemma2MLP"),
    _a("vaultgemma", "VaultGemmaMLP"),
    _a("diffusion_gemma", "DiffusionGemmaText4MLP"),
    _a("recurrent_gemma", "RecurrentGemmaMlp"),
    _a("zamba", "ZambaMLP", activation="gelu"),
    _a("pixtral", "PixtralMLP", activation="gelu"),
    _a("dinov3_vit", "DINOv3ViTGatedMLP", activation="gelu"),
    _a("eomt_dinov3", "EomtDinov3GatedMLP", activation="gelu"),
    # DiffusionGemma's self-conditioning: post_norm(inputs_embeds + MLP(pre_norm(signal)))
    _a("diffusion_gemma", "DiffusionGemmaSelfConditioning", layer="GeGLUSelfConditioning"),
    # ... with dropout between the product and down_proj
    _a("t5gemma", "T5GemmaMLP", layer="GeGLUMLPWithDropout"),
    _a("t5gemma2", "T5Gemma2MLP", layer="GeGLUMLPWithDropout"),
    _a("gte", "GteMLP", activation="gelu", layer="GeGLUMLPWithDropout"),
    # Gemma 3n: Gaussian top-k on the gate of the first layers (activation_sparsity > 0)
    _a("gemma3n", "Gemma3nTextMLP", layer="Gemma3nGeGLUMLP"),
    # T5 style: wo(dropout(act(wi_0(h)) * wi_1(h)))
    _t5("t5", "T5DenseGatedActDense"),
    _t5("mt5", "MT5DenseGatedActDense"),
    _t5("umt5", "UMT5DenseGatedActDense"),
    _t5("longt5", "LongT5DenseGatedActDense", layer="LongT5GeGLUDense"),
    _t5("udop", "UdopDenseGatedActDense", activation="gelu", status=SUPPORTED),
    _t5("pix2struct", "Pix2StructTextDenseGatedActDense"),
    _t5("pix2struct", "Pix2StructVisionMlp"),
    _t5("kosmos2_5", "Kosmos2_5VisionMlp"),
    # packed: input, gate = Wi(x).chunk(2, -1)
    _a("modernbert", "ModernBertMLP", activation="gelu", layer="ModernBertGeGLUMLP", act_attr="act"),
    _a("modernbert_decoder", "ModernBertDecoderMLP", activation="gelu", layer="ModernBertGeGLUMLP", act_attr="act"),
    _a("zamba2", "Zamba2MLP", activation="gelu", layer="Zamba2GeGLUMLP"),
    _a("clvp", "ClvpGatedLinearUnit", activation="gelu", layer="ClvpGeGLU", act_attr="activation_fn"),
    _a("cpmant", "CpmAntDenseGatedACT", activation="gelu (fixed nn.GELU())", layer="CpmAntGeGLU", act_attr="act"),
    # MoE experts: the gate between the grouped GEMMs is a function layer, the eager loop the class layer
    _a("gemma4", "Gemma4TextExperts", layer="GeGLUExperts", gate_layer="GeGLUExpertsGate"),
    _a("diffusion_gemma", "DiffusionGemmaTextExperts", layer="GeGLUExperts", gate_layer="GeGLUExpertsGate"),
    # not supported
    _a("pop2piano", "Pop2PianoDenseGatedActDense", activation="relu", layer=None, status=NOT_SUPPORTED, act_attr="act"),
    _a("moshi", "MoshiGatingMLP", activation="silu", layer=None, status=NOT_SUPPORTED, act_attr="activation_fn"),
    _a("kyutai_speech_to_text", "KyutaiSpeechToTextGatingMLP", activation="silu", layer=None,
       status=NOT_SUPPORTED, act_attr="activation_fn"),
)


# --- Gemma's RMSNorm: layer GemmaRMSNorm where the forward is, op for op,
# ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1.0 + w.float())).type_as(x)``; Gemma3nRMSNorm where it is
# ``(x.float() * pow(mean(x.float()^2) + eps, -0.5) [* w.float()]).type_as(x)``. "supported-approx": within one ulp
# against fp64 on CUDA, bit-exact on CPU.
def _n(model, name, layer="GemmaRMSNorm", status=SUPPORTED_APPROX):
    return HostClass(model, name, layer, status, "")


NORM_CLASSES: tuple[HostClass, ...] = (
    _n("gemma", "GemmaRMSNorm"),
    _n("gemma2", "Gemma2RMSNorm"),
    _n("gemma3", "Gemma3RMSNorm"),
    _n("recurrent_gemma", "RecurrentGemmaRMSNorm"),
    _n("t5gemma", "T5GemmaRMSNorm"),
    _n("t5gemma2", "T5Gemma2RMSNorm"),
    _n("vaultgemma", "VaultGemmaRMSNorm"),
    _n("qwen3_next", "Qwen3NextRMSNorm"),
    _n("qwen3_5", "Qwen3_5RMSNorm"),
    _n("qwen3_5_moe", "Qwen3_5MoeRMSNorm"),
    _n("qwen4_exp", "Qwen4ExpTextRMSNorm"),
    _n("step3p7", "Step3p7RMSNorm"),
    _n("minimax_m3_vl", "MiniMaxM3VLRMSNorm"),
    _n("muse_glimmer", "MuseGlimmerTextCenteredRMSNorm"),
    _n("gemma3n", "Gemma3nRMSNorm", layer="Gemma3nRMSNorm"),
    _n("gemma4", "Gemma4RMSNorm", layer="Gemma3nRMSNorm"),
    _n("gemma4_unified", "Gemma4UnifiedRMSNorm", layer="Gemma3nRMSNorm"),
    _n("embedding_gemma2", "EmbeddingGemma2RMSNorm", layer="Gemma3nRMSNorm"),
    _n("diffusion_gemma", "DiffusionGemmaRMSNorm", layer="Gemma3nRMSNorm"),
    _n("neomme", "NeoMMERMSNorm", layer="Gemma3nRMSNorm"),
    _n("muse_spark", "MuseSparkTextCenteredRMSNorm", layer=None, status=NOT_SUPPORTED),
    _n("muse_spark", "MuseSparkTextInputScaledRMSNorm", layer=None, status=NOT_SUPPORTED),
)


# --- rotary embeddings: forward ``cos, sin`` of ``position_ids[..., None].float() * inv_freq`` (twice over the last
# dim) times ``attention_scaling``, op for op; LayerTypeRotaryEmbedding for ``forward(x, position_ids, layer_type)``.
def _r(model, name, layer="RotaryEmbedding"):
    return HostClass(model, name, layer, SUPPORTED, "")


_TYPED = "LayerTypeRotaryEmbedding"
ROPE_CLASSES: tuple[HostClass, ...] = (
    _r("gemma", "GemmaRotaryEmbedding"),
    _r("gemma2", "Gemma2RotaryEmbedding"),
    _r("gemma3", "Gemma3RotaryEmbedding", _TYPED),
    _r("gemma3n", "Gemma3nRotaryEmbedding", _TYPED),
    _r("gemma4", "Gemma4TextRotaryEmbedding", _TYPED),
    _r("gemma4_unified", "Gemma4UnifiedTextRotaryEmbedding", _TYPED),
    _r("t5gemma", "T5GemmaRotaryEmbedding"),
    _r("t5gemma2", "T5Gemma2RotaryEmbedding", _TYPED),
    _r("vaultgemma", "VaultGemmaRotaryEmbedding"),
    _r("embedding_gemma2", "EmbeddingGemma2RotaryEmbedding", _TYPED),
    _r("diffusion_gemma", "DiffusionGemmaTextRotaryEmbedding", _TYPED),
)

