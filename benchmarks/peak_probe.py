"""Probe: what is live at the peak of one compiled batch-1 prefill, the compiled host against the kernelized compiled
model.

Both forwards are made dynamic as a server's are (two other prompt lengths first; ``--warm-lengths`` names them,
and any further lengths each forward is called with before, in order, as the model bench's serve rows do), then
one call of each at ``--length`` tokens runs under the CUDA allocator's memory history. Replaying the history gives
the moment of the peak (requested bytes above what was live before the call) and the allocations live then, grouped
by the innermost Python frame that allocated them (Inductor's generated code names its buffers; an op's own
allocations name its source line). Prints and writes (``--out``) each mode's peak and its largest groups.

python3 benchmarks/peak_probe.py --build-dir build [--model gemma3-4b] [--length 4096] [--warm-lengths 33,34,64,...]
    [--out DIR]
(a GPU)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch


def _where(frames: list) -> str:
    """The innermost frame outside torch's own allocation plumbing."""
    for f in frames:
        name = f.get("filename", "")
        if "torch/cuda" in name or "torch/_ops.py" in name or "torch/utils" in name:
            continue
        return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "?"


def _live_at_peak(trace: list) -> tuple:
    """(peak MiB, {place: MiB}) from the allocator's event trace of one call."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            if e["action"] == "free_requested":
                cur -= live.pop(e["addr"])[0]
    groups = defaultdict(float)
    for size, where in at_peak.values():
        groups[where] += size / 2**20
    return round(peak / 2**20, 1), dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    from kerneltools.bench.model.models import MODELS, build_models
    from kerneltools.bench.model.rounds import _as_mode, _kernelize_for, _peak_mib, make_dynamic, make_part
    from kerneltools.transformers_kernels import DEFAULT_REPO_ID
    from torch._dynamo.utils import counters

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", type=Path, required=True)
    p.add_argument("--model", default="gemma3-4b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--warm-lengths", default="",
                   help="comma-separated prompt lengths called before the recorded one: the first two make the "
                        "forwards dynamic, the rest are called in order (default: length/2+1, length/2+2; the model "
                        "bench's serve rows at 64,...,4096: 33,34,64,256,1024,2048)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        warm = [int(n) for n in args.warm_lengths.split(",") if n.strip()]
    except ValueError:
        p.error(f"--warm-lengths {args.warm_lengths!r}: expected comma-separated token counts, e.g. 33,34,64")
    if not warm:
        warm = [args.length // 2 + 1, args.length // 2 + 2]
    if len(warm) < 2 or min(warm) < 1:
        p.error(f"--warm-lengths {args.warm_lengths!r}: expected at least two positive token counts (the first two "
                "make the compiled forwards dynamic)")
    if not torch.cuda.is_available():
        raise SystemExit("peak_probe: needs a CUDA GPU (it reads the CUDA allocator's history).")
    torch._dynamo.config.cache_size_limit = 64
    s = build_models(MODELS[args.model], args.build_dir, "cuda", torch.bfloat16, False, "inductor", DEFAULT_REPO_ID,
                     layers=args.layers)
    modes = ["compile", "kernelized+compile"]
    make_dynamic(s, modes, tuple(warm[:2]))
    for n in warm[2:]:  # as the bench's rows: each length in every mode before the next
        warm_fn, _, _ = make_part(s, "serve", length=n)
        for mode in modes:
            _kernelize_for(s, mode, False)
            made = counters["stats"]["unique_graphs"]
            with _as_mode(s, mode, "serve") as m:
                warm_fn(m, True)
            print(f"warm {n} tokens, {mode}: {counters['stats']['unique_graphs'] - made} new graphs")
    fn, _, _ = make_part(s, "serve", length=args.length)
    result = dict(model=args.model, length=args.length, warm_lengths=warm, torch=torch.__version__,
                  card=torch.cuda.get_device_name(), modes={})
    for mode in modes:
        _kernelize_for(s, mode, False)
        with _as_mode(s, mode, "serve") as m:
            fn(m, True)  # warm: the graph for this length is compiled outside the recorded call
            bench_peak, _ = _peak_mib(s, lambda mm: fn(mm, True), m)  # the model bench's figure, for comparison
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            fn(m, True)
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        peak, groups = _live_at_peak(trace)
        result["modes"][mode] = dict(peak_mib=peak, bench_peak_mib=bench_peak,
                                     live_at_peak_mib={k: round(v, 1) for k, v in groups.items()})
        print(f"{args.length} tokens, {mode}: peak {peak} MiB above the call's start (the model bench's measure: "
              f"{bench_peak} MiB); live at the peak:")
        for where, mib in list(groups.items())[:15]:
            print(f"    {mib:9.1f} MiB  {where}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peak.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
