"""One part of a model (prefill, decode, train) timed for every mode in interleaved rounds (``run_part``): the
calls each part makes, the mode's model and kernelize mode, the per-round ratios."""

from __future__ import annotations

import contextlib
import functools
import time

from ..common import cache_arg, median, round_order
from .models import PARTS, TINY_SHAPES, Setup, own_code


def _model_name(mode: str) -> str:
    """The model a mode runs: "kernelized", "kernelized+compile", "copy" or "eager"."""
    if mode in ("kernelized", "kernelized+compile"):
        return mode
    return "copy" if mode.startswith("copy") else "eager"


def _opt_key(m) -> int:
    """The optimizer's key: the model's first parameter (the two kernelized models share their parameters, and so
    one optimizer and its state)."""
    return id(next(m.parameters()))


def _mode_model(s: Setup, mode: str):
    return s.models[_model_name(mode)]


@contextlib.contextmanager
def _as_mode(s: Setup, mode: str, part: str):
    """The module to call for ``mode`` in ``part``: compiled modes swap the compiled forward in for the duration (so
    that the loss computation inside the forward runs compiled too, and serve's ``generate`` calls it at every
    step), except in decode, where ``generate`` compiles its own decoding step and the model stays as it is."""
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
    name = _model_name(mode)
    if s.kernelized_mode.get(name) != m:
        kernelize(s.models[name], mode=m, device=s.device)
        s.kernelized_mode[name] = m


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


def make_part(s: Setup, part: str, batch: int | None = None, length: int | None = None):
    """(fn(model) running one unit of the part, tokens per unit, training?) for the part. "serve": batch-1 prefill
    of ``length`` tokens, or without a length a batch-1 ``generate`` of ``new_tokens`` through the model's forward
    (the compile modes' compiled forward, dynamic shapes, no static cache)."""
    import torch

    spec = s.spec
    if part == "serve" and length is None:
        prompt = _ids(s, 1, 16 if s.tiny else 64)

        def fn(m, compiled=False):
            with torch.no_grad():
                return m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
        return fn, s.new_tokens, False
    if part in ("prefill", "serve"):
        b, n = (1, length) if part == "serve" else TINY_SHAPES["prefill"] if s.tiny else spec.prefill
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
            opt = s.optimizers[_opt_key(m)]
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
        return {"input_ids": ids, cache_arg(m): generate_cache(m), "use_cache": True, "logits_to_keep": 1}
    if s.spec.kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": dec, cache_arg(m): generate_cache(m), "use_cache": True}
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


def _peak_mib(s: Setup, fn, m) -> tuple:
    """(requested, allocated): the peak of one call above what was live before it, in MiB, as the tensors asked
    for it (``requested_bytes``) and as the caching allocator handed it out (``allocated_bytes``: each block
    rounded up, and a cached block up to 1 MiB larger than asked for given whole, so it depends on what the
    process ran before). (None, None) off CUDA."""
    import torch

    if s.device != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    fn(m)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return tuple(round((after[f"{k}_bytes.all.peak"] - before[f"{k}_bytes.all.current"]) / 2**20, 1)
                 for k in ("requested", "allocated"))


def _round_ratios(times: dict, base: str) -> dict:
    """Per mode: the ratio of its time to ``base``'s in each round."""
    if base not in times:
        return {}
    return {mode: [t / b for t, b in zip(ts, times[base])] for mode, ts in times.items()}


def _spread(rs: list) -> list:
    """[median, min, max] of per-round ratios."""
    return [round(median(rs), 3), round(min(rs), 3), round(max(rs), 3)]


def make_dynamic(s: Setup, modes: list, lengths: tuple) -> None:
    """Call each compile mode's forward with batch-1 prompts of ``lengths`` (two or more) before serve's rows, as a
    server meets prompts of several lengths: torch.compile's automatic dynamic shapes recompile the second length
    with a symbolic one, and every row then runs that graph, as a serving process would after its first requests."""
    for mode in modes:
        if "compile" not in mode:
            continue
        _kernelize_for(s, mode, False)
        for n in lengths:
            fn, _, _ = make_part(s, "serve", length=n)
            with _as_mode(s, mode, "serve") as m:
                fn(m, True)


def part_label(part: str, batch: int | None = None, length: int | None = None) -> str:
    """The row's name: "prefill", "decode b8", "serve 256" (batch-1 prefill of 256 tokens), "serve decode"."""
    if part == "serve":
        return f"serve {length}" if length is not None else "serve decode"
    return part if batch is None else f"{part} b{batch}"


def run_part(s: Setup, part: str, modes: list, rounds: int, reps: int, batch: int | None = None, log=print,
             offset: int = 0, length: int | None = None) -> dict:
    """Times one part in interleaved rounds for every mode; returns its row (with each round's ratios, which
    ``pool`` joins over processes). ``offset`` rotates the order of the first calls (which model compiles first)
    and of the rounds."""
    import torch
    from torch._dynamo.utils import counters

    fn, tokens, training = make_part(s, part, batch, length)
    label = part_label(part, batch, length)
    calls = {mode: functools.partial(fn, compiled="compile" in mode) for mode in modes}
    first, peaks, allocated, graphs, times = {}, {}, {}, {}, {mode: [] for mode in modes}
    for m in s.models.values():
        m.train(training)
        if training and _opt_key(m) not in s.optimizers:
            s.optimizers[_opt_key(m)] = torch.optim.AdamW(m.parameters(), lr=1e-6)
    k = offset % len(modes)
    for mode in modes[k:] + modes[:k]:  # first call (compilation), then a warm-up
        _kernelize_for(s, mode, training)
        call = calls[mode]
        made = counters["stats"]["unique_graphs"]
        with _as_mode(s, mode, part) as m:
            first[mode] = round(_time_once(s, call, m), 3)
            _time_once(s, call, m)
            peaks[mode], allocated[mode] = _peak_mib(s, call, m)
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
                                  first_call_s=first[mode], peak_mib=peaks[mode], peak_alloc_mib=allocated[mode],
                                  new_graphs=graphs[mode])
        for key, rs in by_round.items():
            row["modes"][mode][key] = _spread(rs[mode]) if mode in rs else None
            row["modes"][mode][f"{key}_rounds"] = [round(x, 4) for x in rs[mode]] if mode in rs else None
    log(f"{s.spec.name} {label}: " + ", ".join(
        f"{mode} {row['modes'][mode]['ms']} ms ({row['modes'][mode]['vs_eager']})" for mode in modes))
    for m in s.models.values():
        m.eval()
    return row
