"""What kernelize adds to a compiled forward's host time: Dynamo's guards on the mapped modules, counted and timed.

kernels binds each mapped module's ``forward`` per instance, and Dynamo guards what a traced forward reads. For the
compiled host, the kernelized compiled model and the unkernelized copy (the A/A control), all made dynamic as a
server's are (two prompt lengths first), this counts the guards of the serving graph by kind, lists those the
kernelized graph adds (layer indices folded), and times back-to-back forwards in interleaved rounds (a round's
time the fastest of 5 blocks of 20 calls). With ``--backend eager`` (the default) the graph runs op by op and the
difference is Dynamo's alone; the figures are host time, so the build machine measures them.

python benchmarks/guard_cost.py --build-dir build [--layers 16] [--length 12] [--rounds 9] [--backend eager]
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import torch


def _guards(text: str) -> list:
    """The guards of the last graph in a guard log, with layer indices folded to [N]."""
    last = text.rsplit("TREE_GUARD_MANAGER:", 1)[-1]
    return [re.sub(r"\['\d+'\]", "[N]", g.split("  #")[0]) for g in re.findall(r"\+- ([A-Z_]+: .*)", last)]


def main(argv=None) -> int:
    from kerneltools.bench.model.models import MODELS, build_models
    from kerneltools.bench.model.rounds import _as_mode, _kernelize_for, make_dynamic, make_part
    from kerneltools.transformers_kernels import DEFAULT_REPO_ID

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", type=Path, required=True)
    p.add_argument("--model", default="gemma3-4b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--length", type=int, default=12)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--backend", default="eager")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log = io.StringIO()
    torch._logging.set_logs(guards=True)
    logging.getLogger("torch._dynamo").addHandler(logging.StreamHandler(log))
    s = build_models(MODELS[args.model], args.build_dir, device, torch.bfloat16 if device == "cuda" else torch.float32,
                     device == "cpu", args.backend, DEFAULT_REPO_ID, control=True, layers=args.layers)
    modes = ["compile", "kernelized+compile", "copy+compile"]
    fn, _, _ = make_part(s, "serve", length=args.length)
    guards = {}
    for mode in modes:
        log.seek(0)
        log.truncate()
        _kernelize_for(s, mode, False)
        make_dynamic(s, [mode], (args.length // 2 + 1, args.length // 2 + 2))
        with _as_mode(s, mode, "serve") as m:
            fn(m, True)
        guards[mode] = _guards(log.getvalue())
    torch._logging.set_logs(guards=False)
    for mode in modes:
        kinds = Counter(g.split(":")[0] for g in guards[mode])
        print(f"{mode}: {len(guards[mode])} guards; " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    added = Counter(guards["kernelized+compile"]) - Counter(guards["compile"])
    print("added by kernelize (count, guard):")
    for g, n in added.most_common(25):
        print(f"  {n:3d}  {g[:160]}")
    times = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            with _as_mode(s, mode, "serve") as m:
                best = float("inf")
                for _ in range(5):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn(m, True)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    best = min(best, (time.perf_counter() - t0) / 20)
                times[mode].append(best)
    for mode in modes:
        rs = [a / b for a, b in zip(times[mode], times["compile"])]
        print(f"{mode:20s} {statistics.median(times[mode]) * 1e6:9.1f} us per forward, / compile "
              f"{statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
