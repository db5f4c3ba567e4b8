"""The model benchmark's command line: ``python -m kerneltools bench --model NAME ...`` (``add_arguments``,
``main``) and ``run``, which runs in this process or in ``--processes`` fresh ones."""

from __future__ import annotations

import json
from pathlib import Path

from .models import DECODE_BATCHES, DEFAULT_MODES, MODELS, MODES, SERVE_LENGTHS
from .processes import merge, pool, run_processes
from .report import write
from .runner import run_here


def run(args, log=print) -> dict:
    """The run ``args`` ask for: in this process, or (``--processes N``) in N fresh ones, pooled."""
    processes = getattr(args, "processes", 1)
    if processes < 1:
        raise SystemExit(f"error: --processes {processes}: expected at least 1.")
    if processes > 1:
        return run_processes(args, log)
    return run_here(args, log)


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", default=None,
                   help=f"model(s) for the whole-model benchmark: {', '.join(MODELS)} or all (repeatable)")
    p.add_argument("--parts", default="prefill,decode,train",
                   help="comma-separated, of prefill,decode,train,serve (default prefill,decode,train; serve: "
                        "batch-1 prefill at --serve-lengths and a short batch-1 decode, the compile modes with "
                        "dynamic shapes)")
    p.add_argument("--serve-lengths", default=None,
                   help=f"comma-separated prompt lengths of the serve part (default {','.join(map(str, SERVE_LENGTHS))})")
    p.add_argument("--no-serve-decode", action="store_true",
                   help="end the serve part after its prefill rows (e.g. a run of the longer lengths beside one "
                        "that times the decode)")
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
                        "with --processes, process i takes this offset + i)")
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
