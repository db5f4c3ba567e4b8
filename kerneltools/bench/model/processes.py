"""A run repeated in fresh processes and pooled (``run_processes``, ``pool``), and reports of separate runs joined
into one (``merge``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..common import median
from .report import write
from .rounds import _spread
from .runner import run_here


def _run_child(args) -> None:  # a spawned process of run_processes (module level: spawn pickles it by name)
    run_here(args)  # args.processes is 1 in a child


def run_processes(args, log=print) -> dict:
    """``--processes N``: the whole run N times, each in a fresh Python process (spawned: its own CUDA context,
    Dynamo caches and Inductor state), the i-th with its first calls and rounds rotated by ``--offset`` + i places,
    so that the modes take turns compiling first (and runs made apart, one per device call with offsets N apart,
    can be pooled with ``--pool``); then :func:`pool`. A host-bound compiled model's ratio moves with the process's
    state (T5 v1.1 base's compiled prefill: 0.968, 1.056 and 1.006 of compile in three processes on an H200,
    benchmarks/results/development-notes.md), so that one process is one sample. Each process's own report stays in
    ``OUT/process-i``; the graph count, the profile and the call cost run in the first process only."""
    import multiprocessing
    import tempfile

    base = Path(args.out) if args.out is not None else Path(tempfile.mkdtemp(prefix="geglu-bench-"))
    ctx = multiprocessing.get_context("spawn")
    results = []
    for i in range(args.processes):
        child = copy.copy(args)
        child.processes, child.offset, child.out = 1, args.offset + i, base / f"process-{i}"
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
                peaks = {k: [v[k] for v in vs if v.get(k) is not None] for k in ("peak_mib", "peak_alloc_mib")}
                m = dict(ms=round(ms, 2), tokens_per_s=round(row["tokens"] / (ms / 1e3), 1),
                         first_call_s=round(median([v["first_call_s"] for v in vs]), 3),
                         **{k: max(p) if p else None for k, p in peaks.items()}, new_graphs=vs[0]["new_graphs"])
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
