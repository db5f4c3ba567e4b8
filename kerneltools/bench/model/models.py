"""The benchmark's models: their transformers configs (random weights, no downloads), the modes and parts it runs,
and the eager, kernelized and copied models of one run with their compiled forwards (``build_models``)."""

from __future__ import annotations

import copy
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MODES = ("eager", "kernelized", "compile", "kernelized+compile", "copy", "copy+compile")
# "copy" / "copy+compile": a deep copy of the eager model, not kernelized (an A/A control, asked for by name: its
# ratio to eager / compile is what the benchmark reports between two identical models, its bias and noise floor)
DEFAULT_MODES = MODES[:4]
PARTS = ("prefill", "decode", "train", "serve")
# "serve": batch-1 prefill at each of SERVE_LENGTHS prompt lengths and a short batch-1 decode, with the compile modes'
# forward made dynamic first (two prompt lengths before any row, as a server meets them: torch.compile's automatic
# dynamic shapes then serve every length from one graph)
SERVE_LENGTHS = (64, 256, 1024, 2048, 4096)
TINY_SERVE_LENGTHS = (8, 24)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "causal", "seq2seq" or "encoder"
    auto_class: str  # transformers Auto class for from_config
    config: Callable[[bool], Any]  # tiny -> config
    prefill: tuple  # (batch, seq)
    train: tuple  # (batch, seq)
    source: str
    attn: str = "sdpa"


def _gemma3(tiny: bool):
    from transformers import Gemma3TextConfig

    if tiny:
        return Gemma3TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=16)
    return Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=16, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                            query_pre_attn_scalar=256)


def _gemma3_12b(tiny: bool):
    from transformers import Gemma3TextConfig

    if tiny:
        return _gemma3(True)
    return Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=256, vocab_size=262208, sliding_window=1024,
                            query_pre_attn_scalar=256)


def _gemma2(tiny: bool):
    from transformers import Gemma2Config

    if tiny:
        return Gemma2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=16)
    return Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256)


def _t5_v11(d_model: int, d_ff: int, layers: int, heads: int):
    """A T5 v1.1-shaped config of these sizes (gated-GELU feed-forward, d_kv 64, untied embeddings); the tiny
    config for every size."""

    def config(tiny: bool):
        from transformers import T5Config

        if tiny:
            return T5Config(d_model=64, d_ff=160, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=32,
                            vocab_size=256, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                            decoder_start_token_id=0)
        return T5Config(d_model=d_model, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                        d_kv=64, vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                        decoder_start_token_id=0)

    return config


_t5 = _t5_v11(768, 2048, 12, 12)
_t5_large = _t5_v11(1024, 2816, 24, 16)
_flan_t5_xl = _t5_v11(2048, 5120, 24, 32)


def _modernbert(tiny: bool):
    from transformers import ModernBertConfig

    if tiny:
        return ModernBertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                                vocab_size=256, local_attention=16, global_attn_every_n_layers=3, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return ModernBertConfig(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
                            vocab_size=50368, local_attention=128, global_attn_every_n_layers=3)


def _modernbert_large(tiny: bool):
    from transformers import ModernBertConfig

    if tiny:
        return _modernbert(True)
    return ModernBertConfig(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16,
                            vocab_size=50368, local_attention=128, global_attn_every_n_layers=3)


def _gemma4_moe(tiny: bool):
    from transformers import Gemma4TextConfig

    moe = dict(enable_moe_block=True, hidden_size_per_layer_input=0, hidden_activation="gelu_pytorch_tanh")
    if tiny:
        return Gemma4TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=16, num_experts=8,
                                top_k_experts=2, moe_intermediate_size=64, **moe)
    # google/gemma-4-26B-A4B's hidden size and experts (the fields kerneltools.bench.moe takes from its config.json);
    # attention, the dense MLP beside the experts and the vocabulary are Gemma4TextConfig's defaults
    return Gemma4TextConfig(hidden_size=2816, num_hidden_layers=6, num_experts=128, top_k_experts=8,
                            moe_intermediate_size=704, **moe)


MODELS = {
    "gemma3-4b": ModelSpec("gemma3-4b", "causal", "AutoModelForCausalLM", _gemma3, (8, 2048), (2, 2048),
                           "google/gemma-3-4b-pt text config, 16 of 34 layers"),
    "gemma3-12b": ModelSpec("gemma3-12b", "causal", "AutoModelForCausalLM", _gemma3_12b, (8, 2048), (2, 2048),
                            "google/gemma-3-12b-pt text config (hidden 3840), 8 of 48 layers"),
    "gemma2-2b": ModelSpec("gemma2-2b", "causal", "AutoModelForCausalLM", _gemma2, (8, 2048), (2, 2048),
                           "google/gemma-2-2b config (soft-capping: eager attention)", attn="eager"),
    "t5-v1.1-base": ModelSpec("t5-v1.1-base", "seq2seq", "AutoModelForSeq2SeqLM", _t5, (8, 512), (8, 512),
                              "google/t5-v1_1-base config (decoder: 1 token in prefill, 128 in training)"),
    "t5-v1.1-large": ModelSpec("t5-v1.1-large", "seq2seq", "AutoModelForSeq2SeqLM", _t5_large, (8, 512), (8, 512),
                               "google/t5-v1_1-large config (decoder: 1 token in prefill, 128 in training)"),
    "flan-t5-xl": ModelSpec("flan-t5-xl", "seq2seq", "AutoModelForSeq2SeqLM", _flan_t5_xl, (8, 512), (8, 512),
                            "google/flan-t5-xl config (decoder: 1 token in prefill, 128 in training)"),
    "modernbert-base": ModelSpec("modernbert-base", "encoder", "AutoModelForMaskedLM", _modernbert, (8, 1024),
                                 (8, 1024), "answerdotai/ModernBERT-base config"),
    "modernbert-large": ModelSpec("modernbert-large", "encoder", "AutoModelForMaskedLM", _modernbert_large,
                                  (8, 1024), (8, 1024), "answerdotai/ModernBERT-large config"),
    "gemma4-moe": ModelSpec("gemma4-moe", "causal", "AutoModelForCausalLM", _gemma4_moe, (8, 2048), (2, 2048),
                            "google/gemma-4-26B-A4B's hidden size and experts (128, top-8, moe_intermediate_size 704), "
                            "Gemma4TextConfig's defaults otherwise"),
}
TINY_SHAPES = dict(prefill=(2, 24), train=(2, 24))
DECODE_BATCHES = (1, 8)


def with_layers(config, layers: int):
    """``config`` with ``layers`` layers (in each stack of an encoder-decoder); the per-layer settings that follow
    from the count (attention types, Gemma 4's per-layer overrides) are made afresh by the config class."""
    d = config.to_dict()
    for key in ("num_hidden_layers", "num_layers", "num_decoder_layers"):
        if key in d:
            d[key] = layers
    for key in ("layer_types", "per_layer_config"):
        d.pop(key, None)
    return type(config).from_dict(d)


@dataclass
class Setup:
    spec: ModelSpec
    device: str
    dtype: Any
    tiny: bool
    models: dict = field(default_factory=dict)  # "eager" / "kernelized" / "kernelized+compile" / "copy" -> nn.Module
    compiled: dict = field(default_factory=dict)  # same keys -> torch.compile(model.forward)
    optimizers: dict = field(default_factory=dict)
    new_tokens: int = 32
    kernelized_mode: dict = field(default_factory=dict)  # kernelized model -> the Mode it was last kernelized with
    backend: str = "inductor"  # torch.compile backend of the compile modes


def build_models(spec: ModelSpec, build_dir: Path, device: str, dtype, tiny: bool, backend: str,
                 repo_id: str, control: bool = False, layers: int | None = None) -> Setup:
    """The eager model (random weights, seeded), a kernelized deep copy, a second one over the same parameters for
    kernelized+compile (``control``: and a plain deep copy, the copy modes' model); compiled forwards of each.
    ``layers`` overrides the config's number of layers."""
    import torch
    import transformers
    from kernels import Mode, kernelize

    from kerneltools.transformers_kernels import register_geglu_kernels

    # kernels' own loader, pointed at the local build: LOCAL_KERNELS overrides the Hub for this repo id
    os.environ["LOCAL_KERNELS"] = f"{repo_id}={Path(build_dir).resolve()}"
    register_geglu_kernels(repo_id, revision="local", devices=(device,))
    torch.manual_seed(0)
    config = spec.config(tiny)
    if layers:
        config = with_layers(config, layers)
    config._attn_implementation = spec.attn
    auto = getattr(transformers, spec.auto_class)
    with torch.device(device):
        eager = auto.from_config(config, dtype=dtype, attn_implementation=spec.attn)
    eager.eval()
    kern = copy.deepcopy(eager)
    # the compile modes' kernelized model: its own modules over the same tensors, kernelized for compile only (as a
    # user kernelizes a model once for the mode they run), so that the eager mode's kernelize never rebinds forwards
    # of the model a compiled graph has traced
    kern_c = copy.deepcopy(kern, memo={id(t): t for t in (*kern.parameters(), *kern.buffers())})
    models = {"eager": eager, "kernelized": kern, "kernelized+compile": kern_c}
    kernelized_mode = {"kernelized": Mode.INFERENCE, "kernelized+compile": Mode.INFERENCE | Mode.TORCH_COMPILE}
    for name, mode in kernelized_mode.items():
        kernelize(models[name], mode=mode, device=device)
    if control:
        models["copy"] = copy.deepcopy(eager)
    s = Setup(spec, device, dtype, tiny, models=models, kernelized_mode=kernelized_mode, backend=backend)
    for name, m in s.models.items():
        s.compiled[name] = torch.compile(own_code(m.forward, name), backend=backend)
    return s


def own_code(method, tag: str = ""):
    """``method`` (a bound method) as a function with a code object of its own. Dynamo keeps compiled frames per
    code object, so two models of one class compiled in one process share their forward's cache; the one compiled
    second then took 10-20 µs a call more than an identical copy compiled first (measured at 7b4b502 on the build
    machine's CPU, T5 v1.1 with 12 + 12 layers, whose guards and wrappers cost ~280 µs a call), a bias towards the
    mode compiled first. With its own code object each model's calls see only its own compiled frames, as in a
    process that compiles one model. ``tag`` goes into the code's name: Dynamo keys what it learns about dynamic
    sizes (automatic dynamic shapes) by file, line and name, so that two copies with one name share it."""
    fn = method.__func__
    code = fn.__code__.replace()
    if tag:
        code = code.replace(co_name=f"{code.co_name}_{tag}")
    copy_ = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy_.__kwdefaults__, copy_.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy_.__dict__.update(fn.__dict__)  # functools.wraps' __wrapped__ and the like
    return types.MethodType(copy_, method.__self__)
