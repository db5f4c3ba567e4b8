"""Whole-model benchmark: what ``kernelize`` gives a transformers model in the modes people run.

Models are built from real transformers configs with random weights (no downloads):

* ``gemma3-4b``: Gemma 3 4B's text model (hidden 2560, intermediate 10240, 8 heads, 4 KV heads, head_dim 256,
  vocab 262208), 16 of its 34 layers;
* ``gemma2-2b``: Gemma 2 2B (hidden 2304, intermediate 9216, 26 layers, soft-capping: eager attention);
* ``t5-v1.1-base``: T5 v1.1 base (d_model 768, d_ff 2048, 12 + 12 layers, gated-gelu), encoder-decoder;
* ``modernbert-base``: ModernBERT base (hidden 768, intermediate 1152, 22 layers), encoder;
* ``gemma4-moe``: a Gemma 4 MoE text model with google/gemma-4-26B-A4B's hidden size (2816) and experts (128,
  top-8, moe_intermediate_size 704; the dense MLP beside them, attention and vocabulary are Gemma4TextConfig's
  defaults, which are not that checkpoint's), 6 of its 30 layers.

Each model runs as ``eager``, ``kernelized`` (``kernels.kernelize`` with this project's mapping,
``register_geglu_kernels``, the kernel loaded by kernels' loader from ``--build-dir`` through ``LOCAL_KERNELS``),
``compile`` (``torch.compile`` of the model's forward) and ``kernelized+compile``, in interleaved rounds (the order
rotates every round), and reports per part the median time, tokens/s, and the median [min, max] of the per-round
ratios to eager and to compile; the first call's time (compilation), the peak memory of one call, and the number
of Dynamo graphs over a sweep of sequence lengths. ``copy`` and ``copy+compile``, asked for by name, run a plain
deep copy of the eager model: an A/A control whose ratios show the benchmark's own bias and noise between two
identical models.

Parts: ``prefill`` (batch x seq tokens, filling an empty KV cache made before the call and returning the logits of
the last position, as ``generate``'s first step does; encoders: the whole forward), ``decode`` (greedy ``generate``
of ``--new-tokens`` tokens at each of the ``--decode-batches``, 1 and 8 by default, after a short prompt; not for
encoders; the compile modes only with ``--compile-decode``: ``generate`` with a static cache, compiling its decoding
step), ``train`` (forward, backward and an AdamW step).

    python -m kerneltools bench --model gemma3-4b [--model t5-v1.1-base ...] [--parts prefill,decode,train]
        [--modes eager,kernelized,compile,kernelized+compile] [--rounds 5] [--out DIR]

``--processes N`` repeats the run in N fresh processes, each compiling the modes in a rotated order, and pools
their rounds (each process's report stays in ``OUT/process-i``): a host-bound compiled model's ratio moves with the
process's state by more than its spread within one process, so that one process is one sample.

``--tiny`` shrinks every model to a few layers of small width (for the CPU test; timings then mean nothing).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .common import meta, median, round_order

MODES = ("eager", "kernelized", "compile", "kernelized+compile", "copy", "copy+compile")
# "copy" / "copy+compile": a deep copy of the eager model, not kernelized (an A/A control, asked for by name: its
# ratio to eager / compile is what the benchmark reports between two identical models, its bias and noise floor)
DEFAULT_MODES = MODES[:4]
PARTS = ("prefill", "decode", "train")


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


def _gemma2(tiny: bool):
    from transformers import Gemma2Config

    if tiny:
        return Gemma2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=16)
    return Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256)


def _t5(tiny: bool):
    from transformers import T5Config

    if tiny:
        return T5Config(d_model=64, d_ff=160, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=32,
                        vocab_size=256, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                        decoder_start_token_id=0)
    return T5Config(d_model=768, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12, d_kv=64,
                    vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                    decoder_start_token_id=0)


def _modernbert(tiny: bool):
    from transformers import ModernBertConfig

    if tiny:
        return ModernBertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                                vocab_size=256, local_attention=16, global_attn_every_n_layers=3, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return ModernBertConfig(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
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
    "gemma2-2b": ModelSpec("gemma2-2b", "causal", "AutoModelForCausalLM", _gemma2, (8, 2048), (2, 2048),
                           "google/gemma-2-2b config (soft-capping: eager attention)", attn="eager"),
    "t5-v1.1-base": ModelSpec("t5-v1.1-base", "seq2seq", "AutoModelForSeq2SeqLM", _t5, (8, 512), (8, 512),
                              "google/t5-v1_1-base config (decoder: 1 token in prefill, 128 in training)"),
    "modernbert-base": ModelSpec("modernbert-base", "encoder", "AutoModelForMaskedLM", _modernbert, (8, 1024),
                                 (8, 1024), "answerdotai/ModernBERT-base config"),
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
    models: dict = field(default_factory=dict)  # "eager" / "kernelized" -> nn.Module
    compiled: dict = field(default_factory=dict)  # same keys -> torch.compile(model.forward)
    optimizers: dict = field(default_factory=dict)
    new_tokens: int = 32
    kernelized_mode: Any = None  # the Mode the kernelized model was last kernelized with
    backend: str = "inductor"  # torch.compile backend of the compile modes


def build_models(spec: ModelSpec, build_dir: Path, device: str, dtype, tiny: bool, backend: str,
                 repo_id: str, control: bool = False, layers: int | None = None) -> Setup:
    """The eager model (random weights, seeded) and a kernelized deep copy (``control``: and a plain deep copy, the
    copy modes' model); compiled forwards of each. ``layers`` overrides the config's number of layers."""
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
    kernelize(kern, mode=Mode.INFERENCE, device=device)
    models = {"eager": eager, "kernelized": kern}
    if control:
        models["copy"] = copy.deepcopy(eager)
    s = Setup(spec, device, dtype, tiny, models=models, kernelized_mode=Mode.INFERENCE, backend=backend)
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


def _model_name(mode: str) -> str:
    """The model a mode runs: "kernelized", "copy" or "eager"."""
    return mode.split("+")[0] if mode.startswith(("kernelized", "copy")) else "eager"


def _mode_model(s: Setup, mode: str):
    return s.models[_model_name(mode)]


@contextlib.contextmanager
def _as_mode(s: Setup, mode: str, part: str):
    """The module to call for ``mode`` in ``part``: compiled modes swap the compiled forward in for the duration (so
    that the loss computation inside the forward runs compiled too), except in decode, where ``generate`` compiles
    its own decoding step and the model stays as it is."""
    m = _mode_model(s, mode)
    if part != "decode" and "compile" in mode:
        m.forward = s.compiled[_model_name(mode)]
        try:
            yield m
        finally:
            del m.forward
    else:
        yield m


def _kernelize_for(s: Setup, mode: str, training: bool) -> None:
    """kernelize the kernelized model with the mode a user would give for this part, when it changes (kernelize
    binds new forward methods, which a compiled graph's guards would see as a change)."""
    if not mode.startswith("kernelized"):
        return
    from kernels import Mode, kernelize

    m = Mode.TRAINING if training else Mode.INFERENCE
    if "compile" in mode:
        m = m | Mode.TORCH_COMPILE
    if s.kernelized_mode != m:
        kernelize(s.models["kernelized"], mode=m, device=s.device)
        s.kernelized_mode = m


def _ids(s: Setup, batch: int, seq: int, seed: int = 1):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    vocab = s.models["eager"].config.vocab_size
    return torch.randint(3, vocab, (batch, seq), generator=g).to(s.device)


def _train_kwargs(s: Setup) -> dict:
    b, n = TINY_SHAPES["train"] if s.tiny else s.spec.train
    ids = _ids(s, b, n, seed=2)
    kwargs = dict(input_ids=ids, labels=ids)
    if s.spec.kind == "seq2seq":
        kwargs["labels"] = _ids(s, b, max(n // 4, 4), seed=3)
    return kwargs


def make_part(s: Setup, part: str, batch: int | None = None):
    """(fn(model) running one unit of the part, tokens per unit, training?) for the part."""
    import torch

    spec = s.spec
    if part == "prefill":
        b, n = TINY_SHAPES["prefill"] if s.tiny else spec.prefill
        ids = _ids(s, b, n)
        dec = torch.zeros(b, 1, dtype=torch.long, device=s.device)

        def fn(m, compiled=False):
            with torch.no_grad():
                return m(**prefill_kwargs(s, m, ids, dec)).logits
        return fn, b * n, False
    if part == "decode":
        new = s.new_tokens
        prompt = _ids(s, batch, 16)

        def fn(m, compiled=False):
            # compiled: what transformers documents for a compiled generate, a static cache, with which generate
            # compiles its decoding step itself (CompileConfig: mode "reduce-overhead", CUDA graphs, on GPUs)
            cache = dict(cache_implementation="static", compile_config=_compiled_generate(s, m)) if compiled else {}
            with torch.no_grad():
                return m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None, **cache)
        return fn, batch * new, False
    if part == "train":
        kwargs = _train_kwargs(s)
        b, n = kwargs["input_ids"].shape

        def fn(m, compiled=False):
            opt = s.optimizers[id(m)]
            loss = m(**kwargs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return fn, b * n, True
    raise ValueError(f"unknown part {part!r}; expected one of {', '.join(PARTS)}")


def prefill_kwargs(s: Setup, m, ids, dec) -> dict:
    """The model's arguments for prefill of ``ids``: ``generate``'s first forward (an empty cache made before the
    call, the logits of the last position; ``dec``, the decoder's start tokens of an encoder-decoder); encoders:
    the whole forward."""
    if s.spec.kind == "causal":
        return dict(input_ids=ids, past_key_values=generate_cache(m), use_cache=True, logits_to_keep=1)
    if s.spec.kind == "seq2seq":
        return dict(input_ids=ids, decoder_input_ids=dec, past_key_values=generate_cache(m), use_cache=True)
    return dict(input_ids=ids)


def generate_cache(m):
    """The empty KV cache ``generate`` makes before its first forward (``_prepare_cache_for_generation`` with the
    default cache: a DynamicCache of the text config, in an EncoderDecoderCache with a second one for the cross
    attention of an encoder-decoder). Prefill passes it in, as ``generate`` does, rather than letting the forward
    make it: on torch 2.11 Dynamo breaks the graph at the ``copy.deepcopy`` in the cache's constructor, and the
    frames after that break belong to code objects that every model of the class shares (at 4a7759b on the H200
    the plain copy of T5 v1.1 base compiled no graphs of its own and ran the first model's). With the cache passed
    in, each compiled model makes one graph."""
    from transformers import DynamicCache, EncoderDecoderCache

    config = m.config.get_text_config(decoder=True)
    if m.config.is_encoder_decoder:
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


def _compiled_generate(s: Setup, m):
    """The ``compile_config`` for ``generate`` with a static cache, with which it runs its decoding steps through
    the model's compiled call: transformers' ``CompileConfig`` (mode "reduce-overhead" with Inductor, its default
    ``dynamic=None``) on the ``--backend``. The compiled call is the model's forward from a code object of its own
    (``own_code``, tagged with the model's name: generate's own ``torch.compile(self.__call__)`` compiles the
    forward's frame, whose code every model of the class shares, and with it Dynamo's record of which sizes change;
    the models here have no hooks for ``__call__`` to run). Made once per model; set to compile on every device (on
    CPU generate would not compile by itself)."""
    cfg = getattr(m, "_last_compile_config", None)
    if cfg is not None and getattr(m, "_compiled_call", None) is not None:
        return cfg
    import torch
    from transformers import CompileConfig

    # dynamic=None, as transformers ships it: the static cache's layers keep the filled length as a Python int
    # (StaticSlidingWindowLayer.cumulative_length_int in transformers 5.22), so static shapes (dynamic=False) made a
    # graph per decoding step (31 for 32 new tokens, 168 s to compile Gemma 3 4B-shaped at batch 8 at f57509f on
    # the H200); with automatic dynamic shapes its second value makes it symbolic: two graphs
    cfg = CompileConfig(backend=s.backend, mode="reduce-overhead" if s.backend == "inductor" else None)
    cfg._compile_all_devices = True
    m._compiled_call = torch.compile(own_code(m.forward, _model_key(s, m)), **cfg.to_dict())
    m._last_compile_config = cfg
    return cfg


def _model_key(s: Setup, m) -> str:
    return next(name for name, model in s.models.items() if model is m)


def _sync(s: Setup) -> None:
    import torch

    if s.device == "cuda":
        torch.cuda.synchronize()


def _time_once(s: Setup, fn, m) -> float:
    _sync(s)
    t0 = time.perf_counter()
    fn(m)
    _sync(s)
    return time.perf_counter() - t0


def _peak_mib(s: Setup, fn, m) -> float | None:
    import torch

    if s.device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(m)
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def _round_ratios(times: dict, base: str) -> dict:
    """Per mode: the ratio of its time to ``base``'s in each round."""
    if base not in times:
        return {}
    return {mode: [t / b for t, b in zip(ts, times[base])] for mode, ts in times.items()}


def _spread(rs: list) -> list:
    """[median, min, max] of per-round ratios."""
    return [round(median(rs), 3), round(min(rs), 3), round(max(rs), 3)]


def run_part(s: Setup, part: str, modes: list, rounds: int, reps: int, batch: int | None = None, log=print,
             offset: int = 0) -> dict:
    """Times one part in interleaved rounds for every mode; returns its row (with each round's ratios, which
    ``pool`` joins over processes). ``offset`` rotates the order of the first calls (which model compiles first)
    and of the rounds."""
    import torch
    from torch._dynamo.utils import counters

    fn, tokens, training = make_part(s, part, batch)
    label = part if batch is None else f"{part} b{batch}"
    calls = {mode: functools.partial(fn, compiled="compile" in mode) for mode in modes}
    first, peaks, graphs, times = {}, {}, {}, {mode: [] for mode in modes}
    for m in s.models.values():
        m.train(training)
        if training and id(m) not in s.optimizers:
            s.optimizers[id(m)] = torch.optim.AdamW(m.parameters(), lr=1e-6)
    k = offset % len(modes)
    for mode in modes[k:] + modes[:k]:  # first call (compilation, the fused path's one-time timing), then a warm-up
        _kernelize_for(s, mode, training)
        call = calls[mode]
        made = counters["stats"]["unique_graphs"]
        with _as_mode(s, mode, part) as m:
            first[mode] = round(_time_once(s, call, m), 3)
            _time_once(s, call, m)
            peaks[mode] = _peak_mib(s, call, m)
        graphs[mode] = int(counters["stats"]["unique_graphs"] - made)
        log(f"  {s.spec.name} {label} {mode}: first call {first[mode]:.1f} s, {graphs[mode]} new graphs")
    for r in range(rounds):
        for mode in round_order(list(modes), r + offset):
            _kernelize_for(s, mode, training)
            with _as_mode(s, mode, part) as m:
                times[mode].append(median([_time_once(s, calls[mode], m) for _ in range(reps)]))
    row = dict(part=label, tokens=tokens, modes={})
    by_round = dict(vs_eager=_round_ratios(times, "eager"), vs_compile=_round_ratios(times, "compile"))
    for mode in modes:
        t = median(times[mode])
        row["modes"][mode] = dict(ms=round(t * 1e3, 2), tokens_per_s=round(tokens / t, 1),
                                  first_call_s=first[mode], peak_mib=peaks[mode], new_graphs=graphs[mode])
        for key, rs in by_round.items():
            row["modes"][mode][key] = _spread(rs[mode]) if mode in rs else None
            row["modes"][mode][f"{key}_rounds"] = [round(x, 4) for x in rs[mode]] if mode in rs else None
    log(f"{s.spec.name} {label}: " + ", ".join(
        f"{mode} {row['modes'][mode]['ms']} ms ({row['modes'][mode]['vs_eager']})" for mode in modes))
    for m in s.models.values():
        m.eval()
    return row


KERNEL_CATEGORIES = (  # (category, substrings of the CUDA kernel name), first match wins
    ("geglu (ours)", ("geglu", "gate_up", "down_dgeglu")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "matmul", "mm_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "fused_adam")),
    ("softmax / loss", ("softmax", "cross_entropy", "nll", "log_softmax")),
    ("reduction / norm", ("reduce", "norm", "triton_red", "triton_per", "mean", "sum")),
    ("copy / cast", ("copy", "cat", "memcpy", "memset", "fill", "index", "gather", "scatter", "embedding")),
    ("pointwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "gelu", "mul", "add", "tanh", "pow",
                   "rsqrt", "where", "neg")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _idle_ms(spans: list) -> float | None:
    """GPU idle time between the first kernel's start and the last one's end (the union of the kernels' intervals
    subtracted): where the host did not keep the GPU fed."""
    if not spans:
        return None
    spans.sort()
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return round((spans[-1][1] - spans[0][0] - busy) / 1e3, 2) if spans else None


def _autograd_nodes(t) -> dict:
    """Names of the autograd nodes behind ``t`` (counts): shows which training path ran."""
    seen, stack, counts = set(), [t.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        counts[name] = counts.get(name, 0) + 1
        stack.extend(fn for fn, _ in node.next_functions)
    return counts


def profile_part(s: Setup, part: str, modes: list, batch: int | None = None) -> dict:
    """One call of the part per mode under torch.profiler: CUDA time by kernel category, the largest kernels, and
    (training) the autograd nodes that recorded the MLPs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn, _, training = make_part(s, part, batch)
    out = {}
    for m in s.models.values():
        m.train(training)
    for mode in modes:
        _kernelize_for(s, mode, training)
        compiled = "compile" in mode
        with _as_mode(s, mode, part) as m:
            fn(m, compiled)
            _sync(s)
            nodes = None
            if training and "compile" not in mode:
                loss = m(**_train_kwargs(s)).loss
                nodes = {k: v for k, v in _autograd_nodes(loss).items() if "GeGLU" in k or "Gelu" in k
                         or "Mul" in k}
                loss.backward()
                s.optimizers[id(m)].zero_grad(set_to_none=True)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
            with profile(activities=acts) as prof:
                fn(m, compiled)
                _sync(s)
        cats, kernels_, spans = {}, {}, []
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            cats[_category(e.name)] = cats.get(_category(e.name), 0.0) + e.device_time
            kernels_[e.name] = kernels_.get(e.name, 0.0) + e.device_time
            spans.append((e.time_range.start, e.time_range.end))
        top = sorted(kernels_.items(), key=lambda kv: -kv[1])[:8]
        out[mode] = dict(gpu_ms=round(sum(cats.values()) / 1e3, 2), idle_ms=_idle_ms(spans),
                         categories={k: round(v / 1e3, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
                         top=[(k[:90], round(v / 1e3, 2)) for k, v in top], autograd_nodes=nodes)
    for m in s.models.values():
        m.eval()
    return out


def call_cost(s: Setup, modes: list, rounds: int, calls: int = 200) -> dict:
    """Host cost of one compiled decoding step (a causal model, batch 1, a static cache) with its work taken out:
    each compile mode's model is compiled (fullgraph) with a backend that returns the graph's outputs from its first
    run, so a call is Dynamo's guards, the frame's argument handling and the outputs' rebuilding, which a compiled
    step pays on the host before its CUDA graph replays. Median µs per call over ``rounds`` interleaved rounds of
    ``calls`` calls each, and the per-round ratio to compile (``modes`` must hold compile)."""
    import torch
    from transformers import StaticCache

    def replay(gm, example_inputs):
        out = gm(*example_inputs)
        return lambda *args: out

    ids, steps = _ids(s, 1, 16), {}
    for mode in modes:
        _kernelize_for(s, mode, False)
        m = _mode_model(s, mode)
        cache = StaticCache(config=m.config, max_cache_len=32)
        f = torch.compile(own_code(m.forward, f"{_model_key(s, m)}_call_cost"), backend=replay, fullgraph=True)
        with torch.no_grad():
            m(input_ids=ids, past_key_values=cache, use_cache=True)
            for pos in (16, 17, 18):  # the second position makes the filled length symbolic, as in generate
                kw = dict(input_ids=ids[:, :1], past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([pos], device=s.device),
                          position_ids=torch.tensor([[pos]], device=s.device))
                f(**kw)
        steps[mode] = (f, kw)
    times = {mode: [] for mode in steps}
    with torch.no_grad():
        for r in range(rounds):
            for mode in round_order(list(steps), r):
                f, kw = steps[mode]
                t0 = time.perf_counter()
                for _ in range(calls):
                    f(**kw)
                times[mode].append((time.perf_counter() - t0) / calls * 1e6)
    ratios = _round_ratios(times, "compile")
    return {mode: dict(us=round(median(ts), 1), vs_compile=_spread(ratios[mode])) for mode, ts in times.items()}


def count_graphs(s: Setup, lengths: list, backend: str) -> dict:
    """Dynamo graphs made by ``torch.compile`` of the eager and of the kernelized model over prefill (the prefill
    part's call) at each of ``lengths`` (a fresh compile each; ``backend`` compiles them: the graph count is
    Dynamo's, whatever the backend)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for name in ("eager", "kernelized"):
        m = s.models[name]
        _kernelize_for(s, "kernelized+compile" if name == "kernelized" else "compile", False)
        torch._dynamo.reset()
        counters.clear()
        cf = torch.compile(m.forward, backend=backend)
        dec = torch.zeros(1, 1, dtype=torch.long, device=s.device)
        for n in lengths:
            with torch.no_grad():
                cf(**prefill_kwargs(s, m, _ids(s, 1, n, seed=n), dec))
        out["compile" if name == "eager" else "kernelized+compile"] = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return out


def run_model(name: str, build_dir: Path, *, parts: list, modes: list, rounds: int, reps: int, device: str,
              tiny: bool, backend: str, new_tokens: int, graph_lengths: list, graph_backend: str,
              repo_id: str, profile: bool = False, compile_decode: bool = False, decode_batches=DECODE_BATCHES,
              log=print, on_row: Callable[[dict], None] | None = None, offset: int = 0,
              call_cost_rounds: int = 0, layers: int | None = None) -> dict:
    """Every part of one model; ``on_row`` gets the model's result as far as it got after each row (so that a run
    stopped half-way keeps what it measured); ``offset``: see ``run_part``; ``call_cost_rounds``: also time the
    compiled decoding step with its work taken out (:func:`call_cost`, causal models) in that many rounds; ``layers``:
    see ``build_models``."""
    import torch

    spec = MODELS[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = build_models(spec, build_dir, device, dtype, tiny, backend, repo_id,
                     control=any(mo.startswith("copy") for mo in modes), layers=layers)
    s.new_tokens = new_tokens
    res = dict(model=name, source=spec.source, kind=spec.kind, dtype=str(dtype).replace("torch.", ""),
               layers=s.models["eager"].config.num_hidden_layers, rows=[])
    for part in parts:
        if part == "decode":
            if spec.kind == "encoder":
                continue
            # the compile modes' decode (a static cache: generate compiles its decoding step, with CUDA graphs on
            # a GPU) is timed only when asked (--compile-decode): it compiles once more per model and mode
            dmodes = modes if compile_decode else [mo for mo in modes if "compile" not in mo]
            for b in decode_batches:
                res["rows"].append(run_part(s, "decode", dmodes, rounds, reps, batch=b, log=log, offset=offset))
                if profile:
                    res["rows"][-1]["profile"] = profile_part(s, "decode", dmodes, batch=b)
                if on_row is not None:
                    on_row(res)
        else:
            res["rows"].append(run_part(s, part, modes, rounds, reps, log=log, offset=offset))
            if profile:
                res["rows"][-1]["profile"] = profile_part(s, part, modes)
            if on_row is not None:
                on_row(res)
        if profile:
            for mode, p in res["rows"][-1]["profile"].items():
                log(f"  profile {res['rows'][-1]['part']} {mode}: GPU {p['gpu_ms']} ms, idle {p['idle_ms']} ms "
                    f"{p['categories']}"
                    + (f" nodes {p['autograd_nodes']}" if p["autograd_nodes"] else ""))
    cmodes = [mo for mo in modes if "compile" in mo]
    if call_cost_rounds and spec.kind == "causal" and "compile" in cmodes:
        res["call_cost"] = call_cost(s, cmodes, call_cost_rounds)
        log(f"{name} compiled decoding step with its work taken out, µs per call: "
            + ", ".join(f"{mo} {v['us']} ({v['vs_compile']})" for mo, v in res["call_cost"].items()))
        if on_row is not None:
            on_row(res)
    if graph_lengths and any("compile" in m for m in modes):
        res["graphs"] = count_graphs(s, graph_lengths, graph_backend)
        res["graph_lengths"] = graph_lengths
        res["graph_backend"] = graph_backend
        log(f"{name} graphs over prefill lengths {graph_lengths}: {res['graphs']}")
    del s
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, list):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"
    return str(v)


def _in_processes(run: dict) -> str:
    n = run.get("processes", 1)
    offsets = ", ".join(map(str, run.get("offsets") or range(n)))
    return f" in each of {n} processes (first calls and rounds rotated, by offsets {offsets})" if n > 1 else ""


def _per_process(row: dict) -> str:
    """A pooled row's median ratio in each process, to compile where the row timed compile, else to eager ("" for
    a run in one process)."""
    base = "compile" if "compile" in row["modes"] else "eager"
    key = f"vs_{base}_processes"
    cells = [f"{mode} " + ", ".join(f"{x:.3f}" for x in v[key]) for mode, v in row["modes"].items()
             if mode != base and v.get(key)]
    return f"{row['part']} (/ {base}) " + "; ".join(cells) if cells else ""


def _vs_copy(row: dict) -> str:
    """The kernelized model's time over the unkernelized copy's, round by round (median [min, max]), for each mode
    pair the row timed ("" for none): the A/A-controlled ratio, free of what the benchmark's host model has over any
    second model in the process."""
    cells = []
    for kern, cp in (("kernelized", "copy"), ("kernelized+compile", "copy+compile")):
        k, c = (row["modes"].get(mo, {}).get("vs_eager_rounds") for mo in (kern, cp))
        if k and c and len(k) == len(c):
            cells.append(f"{kern} / {cp} {_cell(_spread([a / b for a, b in zip(k, c)]))}")
    return f"{row['part']}: " + ", ".join(cells) if cells else ""


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Whole models through kernelize on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"transformers {m.get('transformers')}, kernels {m.get('kernels')}; {result['rounds']} interleaved "
             f"rounds of {result['reps']} calls (median per round){_in_processes(result)}, compile backend "
             f"`{result['backend']}`.", "",
             "Ratios are the median [min, max] over the rounds of the mode's time divided by eager's (or compile's) "
             "in the same round: below 1 is faster. First call: wall time of the first call (compilation and the "
             "fused path's one-time timing included). Graphs: Dynamo graphs made by the first calls (a frame whose "
             "compiled code a model shares with one compiled before it, such as the frame after a graph break, is "
             "counted for the first; the count over prefill lengths below compiles each model afresh). Peak: memory "
             "allocated above the model during one call. Decode in the compile modes: `generate` with a static "
             "cache, compiling its decoding step (transformers' `CompileConfig`).", ""]
    if result.get("partial"):
        lines += ["**Partial:** the run stopped before it finished; the rows below are what it had measured.", ""]
    for res in result["models"]:
        lines += [f"## {res['model']} ({res['source']}; {res['layers']} layers, {res['dtype']})", ""]
        run = res.get("run")
        if run is not None and ((run["meta"]["commit"], run["rounds"], run.get("processes", 1))
                                != (m["commit"], result["rounds"], result.get("processes", 1))):
            lines += [f"Commit {run['meta']['commit']}, {run['meta']['date']}, {run['rounds']} rounds of "
                      f"{run['reps']} calls{_in_processes(run)}.", ""]
        lines += ["| part | mode | ms | tokens/s | / eager | / compile | first call s | graphs | peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in res["rows"]:
            for mode, v in row["modes"].items():
                lines.append(f"| {row['part']} | {mode} | {v['ms']} | {v['tokens_per_s']} | {_cell(v['vs_eager'])} "
                             f"| {_cell(v['vs_compile'])} | {v['first_call_s']} | {_cell(v.get('new_graphs'))} "
                             f"| {_cell(v['peak_mib'])} |")
        per_process = [line for line in map(_per_process, res["rows"]) if line]
        if per_process:
            lines += ["", "Each process's median ratio (the ratios above pool every process's rounds): "
                      + "; ".join(per_process) + "."]
        vs_copy = [line for line in map(_vs_copy, res["rows"]) if line]
        if vs_copy:
            lines += ["", "Kernelized against the unkernelized copy in the same rounds: " + "; ".join(vs_copy) + "."]
        if "graphs" in res:
            lines += ["", f"Dynamo graphs over prefill lengths {res['graph_lengths']} (backend "
                      f"`{res['graph_backend']}`): " + ", ".join(f"{k} {v}" for k, v in res["graphs"].items())]
        if "call_cost" in res:
            lines += ["", "Compiled decoding step with its work taken out (Dynamo's guards and the frame's argument "
                      "and output handling; batch 1, static cache), µs per call: "
                      + ", ".join(f"{mo} {v['us']}" + (f" ({_cell(v['vs_compile'])} of compile)"
                                                        if mo != "compile" else "")
                                  for mo, v in res["call_cost"].items())]
        lines.append("")
    return "\n".join(lines)


def summary_markdown(result: dict) -> str:
    """One line per model and part: kernelized / eager and kernelized+compile / compile (the README's table); where
    a run timed the copy modes, their ratios beside them (the A/A control: what two identical models measure)."""
    control = any(mo.startswith("copy") for res in result["models"] for row in res["rows"] for mo in row["modes"])
    cols = ["model", "part", "kernelized / eager", "kernelized+compile / compile"]
    cols += ["copy / eager", "copy+compile / compile"] if control else []
    cols.append("graphs (compile, kernelized)")
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for res in result["models"]:
        g = res.get("graphs", {})
        graphs = f"{g.get('compile', '–')}, {g.get('kernelized+compile', '–')}" if g else "–"
        for row in res["rows"]:
            cells = [row["modes"].get("kernelized", {}).get("vs_eager"),
                     row["modes"].get("kernelized+compile", {}).get("vs_compile")]
            if control:
                cells += [row["modes"].get("copy", {}).get("vs_eager"),
                          row["modes"].get("copy+compile", {}).get("vs_compile")]
            lines.append(f"| {res['model']} | {row['part']} | " + " | ".join(map(_cell, cells)) + f" | {graphs} |")
            graphs = ""
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Ratio to eager (median over the rounds) per part and mode, one panel per model; a mode a part was not run in
    has no bar there. Skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    models = result["models"]
    cols = min(len(models), 4)
    grid = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(4.5 * cols, 3.6 * grid), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, res in zip(axes.flat, models):
        parts = [row["part"] for row in res["rows"]]
        modes = [mo for mo in MODES if mo != "eager" and any(mo in row["modes"] for row in res["rows"])]
        w = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            vals = [row["modes"][mode]["vs_eager"][0] if mode in row["modes"] else float("nan")
                    for row in res["rows"]]
            ax.bar([j + i * w for j in range(len(parts))], vals, w, label=mode, color=f"C{MODES.index(mode)}")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(parts))], parts, fontsize=8)
        commit = res.get("run", {}).get("meta", result["meta"])["commit"]
        ax.set_title(f"{res['model']} (commit {commit})", fontsize=9)
        ax.set_ylabel("time / eager (lower is faster)", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"kernelize on {result['meta']['card']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args, log=print) -> dict:
    import torch

    processes = getattr(args, "processes", 1)
    if processes < 1:
        raise SystemExit(f"error: --processes {processes}: expected at least 1.")
    if processes > 1:
        return run_processes(args, log)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    names = list(MODELS) if "all" in args.model else args.model
    for n in names:
        if n not in MODELS:
            raise SystemExit(f"error: unknown model {n!r}; expected one of {', '.join(MODELS)} or all.")
    parts = args.parts.split(",")
    modes = args.modes.split(",")
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"error: unknown part {p!r}; expected some of {','.join(PARTS)}.")
    for mo in modes:
        if mo not in MODES:
            raise SystemExit(f"error: unknown mode {mo!r}; expected some of {','.join(MODES)}.")
    if "eager" not in modes:
        raise SystemExit("error: --modes must include eager (every ratio is taken against it).")
    if args.offset < 0:
        raise SystemExit(f"error: --offset {args.offset}: expected 0 or more.")
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"error: --layers {args.layers}: expected at least 1 layer.")
    if args.call_cost < 0:
        raise SystemExit(f"error: --call-cost {args.call_cost}: expected a number of rounds (0: off).")
    if args.call_cost and "compile" not in modes:
        raise SystemExit("error: --call-cost compares the compiled models' host cost per call to compile's: "
                         "--modes must include compile.")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    lengths = [int(v) for v in args.graph_lengths.split(",")] if args.graph_lengths else []
    try:
        batches = tuple(int(v) for v in args.decode_batches.split(","))
    except ValueError:
        raise SystemExit(f"error: --decode-batches {args.decode_batches!r}: expected comma-separated integers, "
                         "e.g. 1,8.") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"error: --decode-batches {args.decode_batches!r}: expected batch sizes of at least 1.")
    result = dict(meta=meta(torch), device=device, rounds=args.rounds, reps=args.reps, backend=args.backend,
                  offset=args.offset, models=[])

    def save_partial(model_res: dict) -> None:  # after each row: a run stopped half-way keeps what it measured
        if args.out is not None:
            write(dict(result, models=result["models"] + [model_res], partial=True), args.out)

    for n in names:
        result["models"].append(run_model(
            n, args.build_dir, parts=parts, modes=modes, rounds=args.rounds, reps=args.reps, device=device,
            tiny=args.tiny, backend=args.backend, new_tokens=args.new_tokens, graph_lengths=lengths,
            decode_batches=batches,
            graph_backend=args.graph_backend, repo_id=args.repo_id, profile=args.profile,
            compile_decode=args.compile_decode, log=log, on_row=save_partial, offset=args.offset,
            call_cost_rounds=args.call_cost, layers=args.layers))
    if args.out is not None:
        write(result, args.out)
    return result


def _run_child(args) -> None:  # a spawned process of run_processes (module level: spawn pickles it by name)
    run(args)


def run_processes(args, log=print) -> dict:
    """``--processes N``: the whole run N times, each in a fresh Python process (spawned: its own CUDA context,
    Dynamo caches and Inductor state), the i-th with its first calls and rounds rotated by i places, so that the
    modes take turns compiling first; then :func:`pool`. A host-bound compiled model's ratio moves with the
    process's state (T5 v1.1 base's compiled prefill: 0.968, 1.056 and 1.006 of compile in three processes on an
    H200, docs/development.md), so that one process is one sample. Each process's own report stays in
    ``OUT/process-i``; the graph count, the profile and the call cost run in the first process only."""
    import multiprocessing
    import tempfile

    base = Path(args.out) if args.out is not None else Path(tempfile.mkdtemp(prefix="geglu-bench-"))
    ctx = multiprocessing.get_context("spawn")
    results = []
    for i in range(args.processes):
        child = copy.copy(args)
        child.processes, child.offset, child.out = 1, i, base / f"process-{i}"
        if i:
            child.graph_lengths, child.profile, child.call_cost = "", False, 0
        log(f"process {i + 1} of {args.processes} (report in {child.out})")
        proc = ctx.Process(target=_run_child, args=(child,))
        proc.start()
        proc.join()
        done = child.out / "model.json"
        if proc.exitcode != 0 or not done.exists():
            if results:
                write(dict(pool(results), partial=True), base)
            raise SystemExit(f"error: benchmark process {i + 1} of {args.processes} exited with code "
                             f"{proc.exitcode}; its output is above, what it measured in {child.out}"
                             + (f", the {len(results)} finished processes pooled in {base}." if results else "."))
        results.append(json.loads(done.read_text()))
    result = pool(results)
    write(result, base)
    log(f"pooled {args.processes} processes: {base / 'model.md'}")
    return result


def pool(results: list) -> dict:
    """One result from runs of one benchmark in several processes (:func:`run_processes`, or ``--pool`` of runs made
    apart, each with its own ``--offset``): per model, part and
    mode, the per-round ratios of all the processes together (median [min, max]) and each process's median
    (``vs_eager_processes``, ``vs_compile_processes``); the median of their times and first calls, the largest
    peak. Graph counts (the first calls' and over lengths), profiles and call costs are the first process's (the
    only one that takes the last three). A part that not every process reached is left out, and the result is then
    marked partial."""
    first = results[0]
    names = [res["model"] for res in first["models"]]
    for r in results[1:]:
        other = [res["model"] for res in r["models"]]
        if other[:len(names)] != names[:len(other)]:
            raise ValueError(f"cannot pool runs of different models: {names} and {other}")
    offsets = [r.get("offset", i) for i, r in enumerate(results)]
    if len(set(offsets)) < len(offsets):
        raise ValueError(f"the runs have the same --offset ({offsets}): each process should compile the modes in "
                         "its own order; give each run a different --offset")
    out = dict(first, models=[], processes=len(results), offsets=offsets)
    out["partial"] = any(r.get("partial") for r in results)
    for k, res in enumerate(first["models"]):
        rows = []
        for j, row in enumerate(res["rows"]):
            same = [r["models"][k]["rows"][j] for r in results
                    if k < len(r["models"]) and j < len(r["models"][k]["rows"])]
            if len(same) < len(results):
                out["partial"] = True
                continue
            if any(x["part"] != row["part"] or list(x["modes"]) != list(row["modes"]) for x in same):
                raise ValueError(f"cannot pool {res['model']} {row['part']}: the processes timed different parts "
                                 "or modes")
            modes = {}
            for mode in row["modes"]:
                vs = [x["modes"][mode] for x in same]
                ms = median([v["ms"] for v in vs])
                peaks = [v["peak_mib"] for v in vs if v["peak_mib"] is not None]
                m = dict(ms=round(ms, 2), tokens_per_s=round(row["tokens"] / (ms / 1e3), 1),
                         first_call_s=round(median([v["first_call_s"] for v in vs]), 3),
                         peak_mib=max(peaks) if peaks else None, new_graphs=vs[0]["new_graphs"])
                for key in ("vs_eager", "vs_compile"):
                    rounds = [x for v in vs for x in (v.get(f"{key}_rounds") or [])]
                    m[key] = _spread(rounds) if rounds else None
                    m[f"{key}_rounds"] = rounds or None
                    m[f"{key}_processes"] = [v[key][0] if v[key] else None for v in vs]
                modes[mode] = m
            rows.append(dict(row, modes=modes))
        if rows:
            out["models"].append(dict(res, rows=rows))
    return out


def write(result: dict, out: Path) -> None:
    """model.json, model.md (the tables and the summary) and model.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps(result, indent=1))
    (out / "model.md").write_text(to_markdown(result) + "\n## Summary\n\n" + summary_markdown(result))
    plot(result, out / "model.png")


def merge(paths: list) -> dict:
    """One result from several model.json files (runs of different models, e.g. split over device calls): their
    models in the given order, each keeping its own run's metadata (commit, date, rounds) under ``run``. A file
    that is itself a merge keeps its models' runs."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    if not results:
        raise SystemExit("error: --merge needs at least one model.json")
    merged = dict(results[0], models=[])
    for r in results:
        for res in r["models"]:
            run = res.get("run") or dict(meta=r["meta"], rounds=r["rounds"], reps=r["reps"], backend=r["backend"],
                                         processes=r.get("processes", 1), offsets=r.get("offsets"))
            merged["models"].append(dict(res, run=run))
    return merged


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", default=None,
                   help=f"model(s) for the whole-model benchmark: {', '.join(MODELS)} or all (repeatable)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: prefill,decode,train")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, of {','.join(MODES)} (default {','.join(DEFAULT_MODES)}; copy and "
                        "copy+compile run a plain deep copy of the eager model: an A/A control of the benchmark)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reps", type=int, default=3, help="calls per mode per round; the round keeps their median")
    p.add_argument("--processes", type=int, default=1,
                   help="repeat the run in this many fresh processes, each compiling the modes in a rotated order, "
                        "and pool their rounds (default 1): a host-bound compiled model's ratio moves with the "
                        "process's state, so one process is one sample")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per decode call (default 32)")
    p.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)),
                   help="comma-separated batch sizes of the decode part (default 1,8)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compile modes")
    p.add_argument("--graph-lengths", default="16,40,97,256,1000",
                   help="prefill lengths for the graph count (empty: skip)")
    p.add_argument("--graph-backend", default="aot_eager",
                   help="backend for the graph count (Dynamo's graphs do not depend on it; aot_eager is fast)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (the CPU test; timings mean nothing)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is present")
    p.add_argument("--repo-id", default=None, help="the kernel's repo id (default: build.toml's)")
    p.add_argument("--compile-decode", action="store_true",
                   help="also time decode in the compile modes: generate with a static cache, which compiles its "
                        "decoding step (transformers' CompileConfig: mode reduce-overhead with Inductor)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="MODEL_JSON",
                   help="write one report (--out) from these model.json files instead of running")
    p.add_argument("--pool", nargs="+", type=Path, default=None, metavar="MODEL_JSON",
                   help="write one report (--out) pooling these model.json files, runs of one benchmark in separate "
                        "processes (e.g. one per device call, each with its own --offset), as --processes does")
    p.add_argument("--offset", type=int, default=0,
                   help="rotate which mode compiles first and the rounds' order by this many places (default 0; "
                        "--processes gives process i the offset i)")
    p.add_argument("--layers", type=int, default=None,
                   help="number of layers of every model (each stack of T5) in place of its own, e.g. a tiny config "
                        "with the real model's depth for --call-cost on CPU")
    p.add_argument("--call-cost", type=int, default=0, metavar="ROUNDS",
                   help="also time each compiled model's decoding step with its work taken out (Dynamo's guards and "
                        "call handling, what a CUDA-graph step pays on the host) in this many interleaved rounds; "
                        "causal models, needs compile among --modes (default 0: off)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one call per part and mode: GPU time by kernel category, top kernels, and the "
                        "autograd nodes of the training step")


def main(args) -> int:
    if args.merge or args.pool:
        if args.merge and args.pool:
            raise SystemExit("error: --merge and --pool each write a report: give one of them")
        if args.out is None:
            raise SystemExit(f"error: {'--merge' if args.merge else '--pool'} needs --out DIR")
        if args.merge:
            result = merge(args.merge)
        else:
            runs = [json.loads(p.read_text()) for p in args.pool]
            try:
                result = pool(runs)
            except ValueError as e:  # runs that cannot be pooled
                raise SystemExit(f"error: --pool: {e}") from None
        write(result, args.out)
        return 0
    if args.repo_id is None:
        from kerneltools.transformers_kernels import DEFAULT_REPO_ID

        args.repo_id = DEFAULT_REPO_ID
    run(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    print("use: python -m kerneltools bench --model NAME", file=sys.stderr)
    sys.exit(2)
