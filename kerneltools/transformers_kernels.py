"""The kernel's transformers integration (``torch-ext/geglu/_transformers.py``) for the tooling, the benchmarks and
the tests, with Hub repositories as the layers' source.

Users do not need this module: the kernel ships the integration, so after
``geglu = kernels.get_kernel("geglu-kernels/geglu", version=1)`` the call ``geglu.register_transformers()`` maps
every supported class (docs/transformers.md). Here the same code is loaded from this checkout's sources, without
building or loading the kernel, and :func:`register_geglu_kernels` maps the classes to
``LayerRepository(repo_id, version=N)`` (or ``revision=``, or ``LockedLayerRepository(lockfile=)``): kernelize
then downloads the kernel when it first needs a layer, as the tests of the published repository want::

    from kernels import Mode, kernelize
    from kerneltools.transformers_kernels import register_geglu_kernels

    register_geglu_kernels()                    # geglu-kernels/geglu, version 1, cuda and cpu, every mode
    kernelize(model, mode=Mode.INFERENCE)

Everything the kernel's module defines (:data:`GEGLU_CLASSES`, :data:`NORM_CLASSES`, :data:`ROPE_CLASSES`,
:class:`ExpertsGate`, ...) is re-exported; :func:`classes_markdown` renders the tables for docs/transformers.md.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Sequence

from .build.config import hub_repo_id

DEFAULT_REPO_ID = hub_repo_id()  # build.toml's [general.hub] repo-id
_PACKAGE = "kerneltools._geglu_sources"


def _load_kernel_module(name: str):
    """``torch-ext/geglu/<name>.py`` as ``kerneltools._geglu_sources.<name>``: a package object whose path is the
    kernel's source folder, so that the module's relative imports (``_activations``) resolve there, without running
    the kernel package's ``__init__`` (which needs a build's generated ``_ops.py``)."""
    src = Path(__file__).resolve().parents[1] / "torch-ext" / "geglu"
    if not (src / f"{name}.py").is_file():
        raise ImportError(f"kerneltools.transformers_kernels needs the kernel's sources beside it ({src / name}.py "
                          "is missing): install kerneltools from a checkout of the repository (pip install -e .). "
                          "Without a checkout use the kernel's own geglu.register_transformers().")
    if _PACKAGE not in sys.modules:
        pkg = types.ModuleType(_PACKAGE)
        pkg.__path__ = [str(src)]
        sys.modules[_PACKAGE] = pkg
    full = f"{_PACKAGE}.{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, src / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


_src = _load_kernel_module("_transformers")

KEY_PREFIX = _src.KEY_PREFIX
SUPPORTED, SUPPORTED_APPROX, NOT_SUPPORTED = _src.SUPPORTED, _src.SUPPORTED_APPROX, _src.NOT_SUPPORTED
HostClass = _src.HostClass
GeGLURegistration = _src.GeGLURegistration
GEGLU_CLASSES, NORM_CLASSES, ROPE_CLASSES = _src.GEGLU_CLASSES, _src.NORM_CLASSES, _src.ROPE_CLASSES
COMPILE_LAYERS = _src.COMPILE_LAYERS
ExpertsGate, experts_gate = _src.ExpertsGate, _src.experts_gate
ExpertsGate.__module__ = __name__  # models pickle it as kerneltools.transformers_kernels.ExpertsGate
is_kernel_gelu = _src.is_kernel_gelu
_forward_taken, _attach_experts_gate = _src._forward_taken, _src._attach_experts_gate


# The notes column of docs/transformers.md's class tables, by class name
_STRIDED = ("CPU: not bit-exact (about 1e-7 relative: eager's CPU erf-GELU rounds differently on the strided chunk "
            "views), GPU: bit-exact")
_T5 = "{} with its cast to wo.weight.dtype (T5 keeps wo in fp32)"
NOTES = {
    'Gemma3MLP': 'Gemma 3 text and the text part of Gemma 3 multimodal',
    'Gemma4VisionMLP': 'clippable linears: the clamps stay inside gate/up/down_proj',
    'RecurrentGemmaMlp': 'projections with biases',
    'PixtralMLP': "vision encoder; a checkpoint with hidden_act='silu' keeps its own forward",
    'DINOv3ViTGatedMLP': 'used only with use_gated_mlp=True',
    'EomtDinov3GatedMLP': 'used only with use_gated_mlp=True',
    'DiffusionGemmaSelfConditioning': ("forward(inputs_embeds, self_conditioning_signal): the host's pre_norm, the "
                                       "GeGLU MLP, the sum and the host's post_norm"),
    'GteMLP': 'down_proj with bias',
    'Gemma3nTextMLP': "the host's _gaussian_topk runs on the gate first where activation_sparsity > 0",
    'T5DenseGatedActDense': _T5.format("T5 v1.1 / flan-T5 (feed_forward_proj='gated-gelu')"),
    'MT5DenseGatedActDense': _T5.format('mT5'),
    'UMT5DenseGatedActDense': _T5.format('UMT5'),
    'LongT5DenseGatedActDense': ("with feed_forward_proj='gated-gelu' (the config default is relu: not gated); no "
                                 'cast, as LongT5'),
    'UdopDenseGatedActDense': ("with feed_forward_proj='gated-gelu', which gives UDOP dense_act_fn='gelu' (the "
                               'config default is relu: not gated)'),
    'ModernBertMLP': 'packed Wi read in place; ' + _STRIDED,
    'ModernBertDecoderMLP': 'as ModernBertMLP; ' + _STRIDED,
    'Zamba2MLP': 'packed gate_up_proj plus the per-block LoRA adapter; forward(hidden_state, layer_idx); ' + _STRIDED,
    'ClvpGatedLinearUnit': 'activation on the second half: h * act(gate); ' + _STRIDED,
    'CpmAntDenseGatedACT': 'the gated activation only; w_out is applied by the caller',
    'Gemma4TextExperts': ('MoE experts, every experts implementation (grouped_mm, batched_mm: their _apply_gate '
                          'runs the function layer GeGLUExpertsGate; eager: GeGLUExperts runs its per-expert loop '
                          'with the packed gate); CPU: bit-exact with gelu_pytorch_tanh and moe_intermediate_size '
                          'a multiple of 32 (704 in Gemma 4 26B-A4B), else about 1e-7 relative (strided chunk '
                          'views), GPU: bit-exact; grouped_mm inference from 2048 routed rows on sm_90: the fused '
                          'gate/up grouped GEMM (fused_mlp, as GeGLUMLP)'),
    'DiffusionGemmaTextExperts': 'MoE experts, as Gemma4TextExperts',
    'Pop2PianoDenseGatedActDense': ('gated ReLU: dense_act_fn defaults to relu even with '
                                    "feed_forward_proj='gated-gelu'"),
    'MoshiGatingMLP': "SwiGLU by default (hidden_act='silu'); also per-codebook FlexibleLinear projections",
    'KyutaiSpeechToTextGatingMLP': 'as MoshiGatingMLP',
    'Gemma3RMSNorm': 'also q_norm / k_norm (rows of head_dim) and the multimodal projector',
    'Qwen3NextRMSNorm': "Gemma's form in a SwiGLU model",
    'Qwen3_5RMSNorm': 'as Qwen3NextRMSNorm',
    'Qwen3_5MoeRMSNorm': 'as Qwen3NextRMSNorm',
    'Qwen4ExpTextRMSNorm': 'instances with group_size=None; grouped ones keep their forward',
    'Gemma3nRMSNorm': 'scale w (not 1 + w), torch.pow(ms, -0.5); instances with with_scale=False have no weight',
    'Gemma4RMSNorm': "as Gemma3nRMSNorm; also q/k/v_norm and the router's",
    'Gemma4UnifiedRMSNorm': 'as Gemma3nRMSNorm',
    'EmbeddingGemma2RMSNorm': 'as Gemma3nRMSNorm',
    'DiffusionGemmaRMSNorm': 'as Gemma3nRMSNorm',
    'NeoMMERMSNorm': 'as Gemma3nRMSNorm (its norms have no weight)',
    'MuseSparkTextCenteredRMSNorm': "(1.0 + weight).float(): the scale is rounded in the weight's dtype",
    'MuseSparkTextInputScaledRMSNorm': "scales before normalizing, through a round trip to x's dtype",
    'Gemma3RotaryEmbedding': 'a table per attention type (sliding, full)',
}


def classes_markdown() -> str:
    """The three class tables as the Markdown of docs/transformers.md, with :data:`NOTES`."""
    lines = ["| model | class | status | default activation | hub layer | notes |", "|---|---|---|---|---|---|"]
    for h in GEGLU_CLASSES:
        layer = f"`{h.layer}`" if h.layer else "–"
        if h.gate_layer:
            layer += f" + `{h.gate_layer}`"
        lines.append(f"| {h.model} | `{h.name}` | {h.status} | {h.activation} | {layer} | {NOTES.get(h.name, '')} |")
    lines += ["", "Gemma RMSNorm classes (mapped unless `norms=False`; docs/rmsnorm.md):", "",
              "| model | class | status | hub layer | notes |", "|---|---|---|---|---|"]
    for h in NORM_CLASSES:
        layer = f"`{h.layer}`" if h.layer else "–"
        lines.append(f"| {h.model} | `{h.name}` | {h.status} | {layer} | {NOTES.get(h.name, '')} |")
    lines += ["", "Gemma rotary embeddings (mapped unless `rope=False`; eager keeps their forward, "
              "torch.compile gets cos and sin from one op):", "", "| model | class | hub layer | notes |", "|---|---|---|---|"]
    for h in ROPE_CLASSES:
        lines.append(f"| {h.model} | `{h.name}` | `{h.layer}` | {NOTES.get(h.name, '')} |")
    return "\n".join(lines) + "\n"


def register_geglu_kernels(repo_id: str = DEFAULT_REPO_ID, *, version: int | None = 1, revision: str | None = None,
                           lockfile: str | Path | None = None, trust_remote_code: bool = False,
                           devices: Sequence[str] = ("cuda", "cpu"), register: bool = True,
                           norms: bool = True, rope: bool = True) -> GeGLURegistration:
    """The kernel's ``register_transformers`` with the layers of the Hub repository ``repo_id`` at ``version``
    (the default, 1), ``revision`` or the commit ``lockfile`` pins: kernelize downloads the kernel when it first
    needs a layer. See ``register_transformers`` for ``devices``, ``register``, ``norms`` and ``rope``."""
    if lockfile is None and revision is None and version is None:
        raise ValueError("register_geglu_kernels: pass version=N, revision=... or lockfile=... .")
    if lockfile is not None or revision is not None:
        version = None
    return _src.register_transformers(devices=devices, register=register, norms=norms, rope=rope, repo_id=repo_id,
                                      version=version, revision=revision, lockfile=lockfile,
                                      trust_remote_code=trust_remote_code)


def geglu_kernel_config(model: Any, repo_id: str = DEFAULT_REPO_ID, *, version: int | None = 1,
                        revision: str | None = None, trust_remote_code: bool = False, inherit_mapping: bool = False):
    """The kernel's ``transformers_kernel_config`` for the Hub repository ``repo_id`` at ``version`` or
    ``revision``: a transformers ``KernelConfig`` with the keys of the supported classes in ``model`` (an instance or
    a model class). GPU models only: transformers refuses KernelConfig on CPU."""
    return _src.transformers_kernel_config(model, repo_id=repo_id, version=None if revision else version,
                                           revision=revision, trust_remote_code=trust_remote_code,
                                           inherit_mapping=inherit_mapping)


__all__ = ["register_geglu_kernels", "geglu_kernel_config", "GEGLU_CLASSES", "NORM_CLASSES", "ROPE_CLASSES",
           "HostClass", "GeGLURegistration", "is_kernel_gelu", "classes_markdown", "experts_gate", "ExpertsGate",
           "DEFAULT_REPO_ID", "KEY_PREFIX", "COMPILE_LAYERS"]
