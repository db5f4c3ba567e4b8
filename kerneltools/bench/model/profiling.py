"""What a call is made of: one call per mode under torch.profiler (``profile_part``), the host cost of a compiled
decoding step with its work taken out (``call_cost``), and the Dynamo graphs over prefill lengths
(``count_graphs``)."""

from __future__ import annotations

import re
import time

from ..common import cache_arg, median, round_order
from .models import Setup, own_code
from .rounds import (_as_mode, _ids, _kernelize_for, _mode_model, _model_key, _opt_key, _round_ratios, _spread,
                     _sync, _train_kwargs, make_part, prefill_kwargs)


KERNEL_CATEGORIES = (  # (category, substrings of the CUDA kernel name), first match wins
    # Inductor's generated kernels first: their names list the ops fused into them, ours among them
    # ("triton_red_fused_..._geglu_mlp_..." is a norm beside our op)
    ("reduction / norm", ("triton_red", "triton_per")),
    ("pointwise", ("triton_poi",)),
    ("geglu (ours)", ("geglu", "gate_up", "down_dgeglu")),
    # before gemm: cuDNN's attention kernels are named ..._sdpa_sm90_flash_fprop_wgmma_...
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "matmul", "mm_")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "fused_adam")),
    ("softmax / loss", ("softmax", "cross_entropy", "nll", "log_softmax")),
    ("reduction / norm", ("reduce", "norm", "mean", "sum")),
    ("copy / cast", ("copy", "cat", "memcpy", "memset", "fill", "index", "gather", "scatter", "embedding")),
    ("pointwise", ("elementwise", "vectorized", "unrolled", "gelu", "mul", "add", "tanh", "pow",
                   "rsqrt", "where", "neg")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


_OPTIMIZER_RANGE = re.compile(r"^Optimizer\.\w+#\w+\.\w+$")  # torch.optim's record_function names


def is_annotation(name: str, event=None) -> bool:
    """A GPU-side user annotation, not a kernel: a ``record_function`` range such as the optimizer's
    ``Optimizer.step#AdamW.step``, which torch.profiler lists among the CUDA events with the span from its first
    kernel's start to its last one's end. Counted as a kernel it adds its kernels' time a second time and the gaps
    between them (training profiles before dee7c9e counted AdamW's step twice: 28.6 of Gemma 3
    4B-shaped's 162.6 ms). An ``event`` says so itself (``is_user_annotation``); a bare name (a report of such an
    earlier profile, or a torch that does not flag it) is recognised by torch.optim's naming, not by a '#' alone:
    kernel names hold one too (``{lambda()#1}``)."""
    return bool(getattr(event, "is_user_annotation", False)) or bool(_OPTIMIZER_RANGE.match(name))


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


def profile_part(s: Setup, part: str, modes: list, batch: int | None = None, length: int | None = None) -> dict:
    """One call of the part per mode under torch.profiler: CUDA time by kernel category, the largest kernels and how
    many ran (each launch costs host time whatever the kernel's own time), the call's wall time under the profiler
    (``host_ms``) with the host ops that took most of it by self time (``host_top``: where a mode's host time goes
    when its GPU time equals its host's), and (training) the autograd nodes that recorded the MLPs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn, _, training = make_part(s, part, batch, length)
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
                s.optimizers[_opt_key(m)].zero_grad(set_to_none=True)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                fn(m, compiled)
                _sync(s)
                host_ms = (time.perf_counter() - t0) * 1e3
        host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda kv: -kv[1])
        cats, kernels_, spans = {}, {}, []
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA or is_annotation(e.name, e):
                continue
            cats[_category(e.name)] = cats.get(_category(e.name), 0.0) + e.device_time
            kernels_[e.name] = kernels_.get(e.name, 0.0) + e.device_time
            spans.append((e.time_range.start, e.time_range.end))
        top = sorted(kernels_.items(), key=lambda kv: -kv[1])[:8]
        out[mode] = dict(gpu_ms=round(sum(cats.values()) / 1e3, 2), idle_ms=_idle_ms(spans), kernels=len(spans),
                         categories={k: round(v / 1e3, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
                         top=[(k[:90], round(v / 1e3, 2)) for k, v in top], autograd_nodes=nodes,
                         host_ms=round(host_ms, 2),
                         host_top=[(k[:90], round(us / 1e3, 2), n) for k, us, n in host[:8] if us > 0])
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
            m(**{"input_ids": ids, cache_arg(m): cache, "use_cache": True})
            for pos in (16, 17, 18):  # the second position makes the filled length symbolic, as in generate
                kw = {"input_ids": ids[:, :1], cache_arg(m): cache, "use_cache": True,
                      "cache_position": torch.tensor([pos], device=s.device),
                      "position_ids": torch.tensor([[pos]], device=s.device)}
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
    for mode in ("compile", "kernelized+compile"):
        m = _mode_model(s, mode)
        _kernelize_for(s, mode, False)
        torch._dynamo.reset()
        counters.clear()
        cf = torch.compile(m.forward, backend=backend)
        dec = torch.zeros(1, 1, dtype=torch.long, device=s.device)
        for n in lengths:
            with torch.no_grad():
                cf(**prefill_kwargs(s, m, _ids(s, 1, n, seed=n), dec))
        out[mode] = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return out
