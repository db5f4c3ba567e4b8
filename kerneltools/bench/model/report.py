"""The report of a run: model.json, model.md (a table per model, the summary) and model.png (``write``)."""

from __future__ import annotations

import json
from pathlib import Path

from .models import MODES
from .rounds import _spread


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


def _named_settings(meta: dict) -> str:
    """"GEGLU_X=1 GEGLU_Y=0" for the package settings a run changed ("" for none)."""
    return " ".join(f"{k}={v}" for k, v in (meta.get("settings") or {}).items())


def _settings(meta: dict) -> str:
    """", with GEGLU_X=1" for the package settings a run changed (none: "")."""
    named = _named_settings(meta)
    return f", with {named}" if named else ""


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Whole models through kernelize on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"transformers {m.get('transformers')}, kernels {m.get('kernels')}; {result['rounds']} interleaved "
             f"rounds of {result['reps']} calls (median per round){_in_processes(result)}, compile backend "
             f"`{result['backend']}`{_settings(m)}.", "",
             "Ratios are the median [min, max] over the rounds of the mode's time divided by eager's (or compile's) "
             "in the same round: below 1 is faster. First call: wall time of the first call (compilation included; "
             "`bench --cold-start` measures a fresh process's). Graphs: Dynamo graphs made by the first calls (a frame whose "
             "compiled code a model shares with one compiled before it, such as the frame after a graph break, is "
             "counted for the first; the count over prefill lengths below compiles each model afresh). Peak: memory "
             "allocated above the model during one call. Decode in the compile modes: `generate` with a static "
             "cache, compiling its decoding step (transformers' `CompileConfig`). Serve rows: batch-1 prefill of N "
             "tokens (`serve N`) and a batch-1 `generate` through the model's forward (`serve decode`); the compile "
             "modes' forward is made dynamic by two other prompt lengths before the first row, as a server's is "
             "by its first requests (torch.compile's automatic dynamic shapes).", ""]
    if result.get("partial"):
        lines += ["**Partial:** the run stopped before it finished; the rows below are what it had measured.", ""]
    for res in result["models"]:
        lines += [f"## {res['model']} ({res['source']}; {res['layers']} layers, {res['dtype']})", ""]
        run = res.get("run")
        if run is not None and ((run["meta"]["commit"], run["rounds"], run.get("processes", 1))
                                != (m["commit"], result["rounds"], result.get("processes", 1))):
            lines += [f"Commit {run['meta']['commit']}, {run['meta']['date']}, {run['rounds']} rounds of "
                      f"{run['reps']} calls{_in_processes(run)}{_settings(run['meta'])}.", ""]
        elif run is not None and run["meta"].get("settings") != m.get("settings"):
            lines += [f"Settings: {_named_settings(run['meta']) or 'the defaults'}.", ""]
        lines += ["| part | mode | ms | tokens/s | / eager | / compile | first call s | graphs | peak MiB "
                  "(requested / allocated) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in res["rows"]:
            for mode, v in row["modes"].items():
                lines.append(f"| {row['part']} | {mode} | {v['ms']} | {v['tokens_per_s']} | {_cell(v['vs_eager'])} "
                             f"| {_cell(v['vs_compile'])} | {v['first_call_s']} | {_cell(v.get('new_graphs'))} "
                             f"| {_peak_cell(v)} |")
        per_process = [line for line in map(_per_process, res["rows"]) if line]
        if per_process:
            lines += ["", "Each process's median ratio (the ratios above pool every process's rounds): "
                      + "; ".join(per_process) + "."]
        vs_copy = [line for line in map(_vs_copy, res["rows"]) if line]
        if vs_copy:
            lines += ["", "Kernelized against the unkernelized copy in the same rounds: " + "; ".join(vs_copy) + "."]
        for row in res["rows"]:
            lines += _gpu_time(row)
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


def kernel_time(p: dict) -> dict:
    """One mode's profile with the GPU-side user annotations taken out (``profiling.is_annotation``). Profiles
    recorded before the profiler skipped them counted the optimizer's ``Optimizer.step#AdamW.step`` range as a
    kernel: where it is among the largest entries (``top``), its time comes off the total and its category here.
    Profiles recorded since hold none, and pass unchanged."""
    from .profiling import _category, is_annotation

    extra = [(name, ms) for name, ms in p.get("top", []) if is_annotation(name)]
    if not extra:
        return p
    cats = dict(p["categories"])
    for name, ms in extra:
        cats[_category(name)] = round(cats.get(_category(name), 0.0) - ms, 2)
    return dict(p, gpu_ms=round(p["gpu_ms"] - sum(ms for _, ms in extra), 2), categories=cats,
                top=[(n, ms) for n, ms in p["top"] if not is_annotation(n)])


def _gpu_time(row: dict) -> list:
    """A row's ``--profile``: each mode's GPU time for one call by kernel category, its idle time (the GPU waiting
    for the host), the call's wall time under the profiler, its kernel launches and its largest host ops (profiles
    recorded before these were kept show "–" and no host ops), and the GPU-time ratios that the wall-time ratios
    above mix with host time."""
    prof = row.get("profile")
    if not prof:
        return []
    lines = ["", f"{row['part']}, GPU time of one call (torch.profiler), ms:", "",
             "| mode | GPU | idle | wall | kernels | by kernel category |", "|---|---|---|---|---|---|"]
    for mode, p in prof.items():
        p = kernel_time(p)
        cats = ", ".join(f"{c} {t}" for c, t in sorted(p["categories"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {mode} | {p['gpu_ms']} | {p['idle_ms']} | {p.get('host_ms', '–')} | {p.get('kernels', '–')} "
                     f"| {cats} |")
    hosts = [f"- {mode}: " + ", ".join(f"{name} {ms} ({n})" for name, ms, n in p["host_top"][:5])
             for mode, p in prof.items() if p.get("host_top")]
    if hosts:
        lines += ["", "Host ops by self time, ms (calls):", ""] + hosts
    ratios = [f"{mode} / {base} {r:.3f}" for mode, base in _PAIRS if (r := _gpu_ratio(row, mode, base)) is not None]
    if ratios:
        lines += ["", "GPU time: " + ", ".join(ratios) + "."]
    return lines


_PAIRS = (("kernelized", "eager"), ("kernelized+compile", "compile"))  # each mode against its host
_CONTROL = {"kernelized": "copy", "kernelized+compile": "copy+compile"}  # and the A/A copy of that host


def _gpu_ratio(row: dict, mode: str, base: str) -> float | None:
    """``mode``'s GPU time over ``base``'s in the row's ``--profile`` (None without both)."""
    prof = row.get("profile") or {}
    if mode in prof and base in prof and prof[base]["gpu_ms"]:
        return kernel_time(prof[mode])["gpu_ms"] / kernel_time(prof[base])["gpu_ms"]
    return None


def _peak_cell(v: dict) -> str:
    """A mode's peak memory of one call: requested / allocated MiB (results before the allocated figure was kept
    recorded the allocator's bytes alone: shown as "– / allocated")."""
    if "peak_alloc_mib" not in v:
        return f"– / {_cell(v['peak_mib'])}" if v.get("peak_mib") is not None else "–"
    return f"{_cell(v['peak_mib'])} / {_cell(v['peak_alloc_mib'])}"


def peak_ratio(row: dict, mode: str, base: str) -> float | None:
    """``mode``'s peak memory above the model during one call over ``base``'s, as the tensors requested it (the
    program's own need; the allocator's rounding of it depends on what the process ran before), or the allocator's
    figure where an older result has only that (None where either was not measured: CPU runs, or a mode the row
    did not time)."""
    peaks = [row["modes"].get(mo, {}).get("peak_mib") for mo in (mode, base)]
    return peaks[0] / peaks[1] if all(peaks) else None


def never_slower(row: dict, mode: str) -> str:
    """Whether ``mode`` (kernelized or kernelized+compile) is no slower than its host in the row: "yes" where the
    median of its per-round ratios is at most 1.00; "A/A" where it is above 1.00 but within the unkernelized copy's
    range in the same rounds (two identical models measured that far apart) and the profiled call's GPU time is
    at most the host's; "no" otherwise, and "–" where the row did not time the mode."""
    base = dict(_PAIRS)[mode]
    v = row["modes"].get(mode, {}).get(f"vs_{base}")
    if v is None:
        return "–"
    if v[0] <= 1.0:
        return "yes"
    copy = row["modes"].get(_CONTROL[mode], {}).get(f"vs_{base}")
    gpu = _gpu_ratio(row, mode, base)
    return "A/A" if copy is not None and v[0] <= copy[2] and gpu is not None and gpu <= 1.0 else "no"


def summary_markdown(result: dict) -> str:
    """One line per model and part: kernelized / eager and kernelized+compile / compile (the README's table), and
    where the run timed them the unkernelized copy's ratios (the A/A control: what two identical models measure),
    the profiled call's GPU-time ratio (``--profile``; host time left out), the peak-memory ratio (GPU runs:
    :func:`peak_ratio`) and :func:`never_slower`'s verdict."""
    rows = [(res, row) for res in result["models"] for row in res["rows"]]
    control = any(mo.startswith("copy") for _, row in rows for mo in row["modes"])
    gpu = any(row.get("profile") for _, row in rows)
    memory = any(v.get("peak_mib") for _, row in rows for v in row["modes"].values())
    cols = ["model", "part"]
    for mode, base in _PAIRS:
        cols += [f"{mode} / {base}"] + ([f"{_CONTROL[mode]} / {base}"] if control else [])
        cols += ["GPU time"] if gpu else []
        cols += ["peak memory"] if memory else []
        cols += ["<= host"]
    cols += ["graphs (compile, kernelized)", "commit"]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for res in result["models"]:
        g = res.get("graphs", {})
        graphs = f"{g.get('compile', '–')}, {g.get('kernelized+compile', '–')}" if g else "–"
        commit = res.get("run", {}).get("meta", result["meta"])["commit"]
        for row in res["rows"]:
            cells = []
            for mode, base in _PAIRS:
                cells.append(_cell(row["modes"].get(mode, {}).get(f"vs_{base}")))
                if control:
                    cells.append(_cell(row["modes"].get(_CONTROL[mode], {}).get(f"vs_{base}")))
                if gpu:
                    r = _gpu_ratio(row, mode, base)
                    cells.append("–" if r is None else f"{r:.3f}")
                if memory:
                    r = peak_ratio(row, mode, base)
                    cells.append("–" if r is None else f"{r:.3f}")
                cells.append(never_slower(row, mode))
            lines.append(f"| {res['model']} | {row['part']} | " + " | ".join(cells) + f" | {graphs} | {commit} |")
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


def write(result: dict, out: Path) -> None:
    """model.json, model.md (the tables and the summary) and model.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps(result, indent=1))
    (out / "model.md").write_text(to_markdown(result) + "\n## Summary\n\n" + summary_markdown(result))
    plot(result, out / "model.png")
