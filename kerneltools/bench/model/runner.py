"""A run in this process: every part of one model (``run_model``), and the run of every model ``args`` ask for,
its report written after every row (``run_here``)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

from ..common import meta
from .models import DECODE_BATCHES, MODELS, MODES, PARTS, SERVE_LENGTHS, TINY_SERVE_LENGTHS, build_models
from .profiling import call_cost, count_graphs, profile_part
from .report import write
from .rounds import make_dynamic, run_part


def run_model(name: str, build_dir: Path, *, parts: list, modes: list, rounds: int, reps: int, device: str,
              tiny: bool, backend: str, new_tokens: int, graph_lengths: list, graph_backend: str,
              repo_id: str, profile: bool = False, compile_decode: bool = False, decode_batches=DECODE_BATCHES,
              log=print, on_row: Callable[[dict], None] | None = None, offset: int = 0,
              call_cost_rounds: int = 0, layers: int | None = None, serve_lengths: tuple | None = None,
              serve_decode: bool = True) -> dict:
    """Every part of one model; ``on_row`` gets the model's result as far as it got after each row (so that a run
    stopped half-way keeps what it measured); ``offset``: see ``run_part``; ``call_cost_rounds``: also time the
    compiled decoding step with its work taken out (:func:`call_cost`, causal models) in that many rounds; ``layers``:
    see ``build_models``; ``serve_lengths``: the prompt lengths of the serve part (default ``SERVE_LENGTHS``, tiny:
    ``TINY_SERVE_LENGTHS``), followed by the short decode unless ``serve_decode`` is False."""
    import torch

    spec = MODELS[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = build_models(spec, build_dir, device, dtype, tiny, backend, repo_id,
                     control=any(mo.startswith("copy") for mo in modes), layers=layers)
    s.new_tokens = new_tokens
    res = dict(model=name, source=spec.source, kind=spec.kind, dtype=str(dtype).replace("torch.", ""),
               layers=s.models["eager"].config.num_hidden_layers, rows=[])
    for part in parts:
        if part == "serve":
            lengths = serve_lengths or (TINY_SERVE_LENGTHS if tiny else SERVE_LENGTHS)
            # two lengths that no row times make the compiled forwards dynamic before the first row
            make_dynamic(s, modes, (lengths[0] // 2 + 1, lengths[0] // 2 + 2))
            for n in [*lengths, None] if serve_decode else lengths:  # None: the short decode
                if n is None and spec.kind == "encoder":
                    continue
                res["rows"].append(run_part(s, "serve", modes, rounds, reps, log=log, offset=offset, length=n))
                if profile:
                    res["rows"][-1]["profile"] = profile_part(s, "serve", modes, length=n)
                if on_row is not None:
                    on_row(res)
        elif part == "decode":
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
                log(f"  profile {res['rows'][-1]['part']} {mode}: GPU {p['gpu_ms']} ms, idle {p['idle_ms']} ms, "
                    f"wall {p['host_ms']} ms, {p['kernels']} kernels {p['categories']}"
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


def run_here(args, log=print) -> dict:
    """The run ``args`` ask for, in this process (``--processes`` is the caller's: :func:`cli.run`)."""
    import torch

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
    try:
        given = getattr(args, "serve_lengths", None)
        serve_lengths = tuple(int(v) for v in given.split(",")) if given else None
    except ValueError:
        raise SystemExit(f"error: --serve-lengths {args.serve_lengths!r}: expected comma-separated integers, "
                         "e.g. 64,256,1024.") from None
    if serve_lengths is not None and min(serve_lengths) < 2:
        raise SystemExit(f"error: --serve-lengths {args.serve_lengths!r}: expected prompt lengths of at least 2.")
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
            call_cost_rounds=args.call_cost, layers=args.layers, serve_lengths=serve_lengths,
            serve_decode=not getattr(args, "no_serve_decode", False)))
    if args.out is not None:
        write(result, args.out)
    return result
