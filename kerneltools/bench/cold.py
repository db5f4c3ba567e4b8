"""Cold start: what a fresh process pays the first time it runs a model, eager against kernelized.

Each measurement is one fresh process (spawned by this module) with an empty Triton cache (``TRITON_CACHE_DIR`` a
new folder), as a new container or machine starts: it builds the model (random weights, the model benchmark's
config), kernelizes it for the kernelized modes (``register_geglu_kernels`` + ``kernelize``, the kernel loaded by
kernels' loader from ``--build-dir``), then times, in order, the first and the second call of each part:

* ``prefill BxS``: a forward over B x S tokens (no cache, last position's logits), at each of ``PREFILLS``;
* ``generate N``: greedy ``generate`` of N tokens after a 32-token prompt;
* ``train BxS``: forward, backward (the model re-kernelized for training).

and counts what Triton compiled: the entries written to the cache folder. Modes: ``eager``, ``kernelized``,
``kernelized-jit`` (the kernelized model with ``GEGLU_PREBUILT=0``: every Triton kernel compiled at first use, as
without prebuilt kernels) and ``kernelized-noarch`` (kernelized from a copy of the build's noarch variants alone:
the ``torch-cuda`` variant that CUDA 12 torch builds, torch < 2.10 and aarch64 load). Each kernelized process
records the variant kernels loaded. The processes alternate between the modes; each mode runs ``--processes``
times.

    python -m kerneltools bench --cold-start [--model gemma3-4b] [--processes 2] [--cold-modes eager,kernelized]
        [--out DIR] [--tiny]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import meta, print_and_write

MODES = ("eager", "kernelized", "kernelized-jit", "kernelized-noarch")
NOARCH = ("torch-cpu", "torch-cuda")  # what kernelized-noarch loads from
PREFILLS = ((8, 2048), (1, 300), (1, 1500))
TINY_PREFILLS = ((2, 64), (1, 30), (1, 150))
NEW_TOKENS = 16
TRAIN = (1, 512)


def _cache_entries(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def child(mode: str, build_dir: Path, model: str, tiny: bool, device: str) -> dict:
    """One cold process: the timings of every part's first and second call, and the Triton cache's entries."""
    t_import = time.perf_counter()
    import torch
    import transformers
    from kernels import Mode, kernelize

    from kerneltools.transformers_kernels import DEFAULT_REPO_ID, register_geglu_kernels

    from .model import MODELS

    cache = Path(os.environ["TRITON_CACHE_DIR"])
    spec = MODELS[model]
    out = {"mode": mode, "import_s": time.perf_counter() - t_import, "parts": {}}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(name, fn):
        times = []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        out["parts"][name] = dict(first_s=times[0], second_s=times[1], cache_entries=_cache_entries(cache))

    torch.manual_seed(0)
    t0 = time.perf_counter()
    config = spec.config(tiny)
    config._attn_implementation = spec.attn
    with torch.device(device):
        m = getattr(transformers, spec.auto_class).from_config(config, dtype=torch.bfloat16,
                                                               attn_implementation=spec.attn)
    m.eval()
    out["model_s"] = time.perf_counter() - t0
    kernelized = mode.startswith("kernelized")
    if kernelized:
        t0 = time.perf_counter()
        os.environ["LOCAL_KERNELS"] = f"{DEFAULT_REPO_ID}={Path(build_dir).resolve()}"
        register_geglu_kernels(DEFAULT_REPO_ID, revision="local", devices=(device,))
        kernelize(m, mode=Mode.INFERENCE, device=device)
        out["kernelize_s"] = time.perf_counter() - t0
        import kernels

        out["variant"] = Path(kernels.get_local_kernel(Path(build_dir).resolve()).__file__).parent.name
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b, s in (TINY_PREFILLS if tiny else PREFILLS):
            ids = torch.randint(0, vocab, (b, s), generator=gen).to(device)
            timed(f"prefill {b}x{s}", lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1))
        prompt = torch.randint(0, vocab, (1, 32), generator=gen).to(device)
        timed(f"generate {NEW_TOKENS}", lambda: m.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                          do_sample=False))
    if kernelized:
        kernelize(m, mode=Mode.TRAINING, device=device)
    m.train()
    b, s = (1, 64) if tiny else TRAIN
    ids = torch.randint(0, vocab, (b, s), generator=gen).to(device)

    def step():
        m(input_ids=ids, labels=ids).loss.backward()

    timed(f"train {b}x{s}", step)
    out["cache_entries"] = _cache_entries(cache)
    return out


def run(build_dir: Path, *, model: str = "gemma3-4b", processes: int = 2, modes=MODES, tiny: bool = False,
        device: str | None = None, log=print) -> dict:
    """Run ``processes`` cold processes per mode (alternating) and collect their timings."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    runs = []
    for i in range(processes):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="geglu-cold-triton-") as cache, \
                    tempfile.TemporaryDirectory(prefix="geglu-cold-noarch-") as noarch:
                env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
                env["GEGLU_PREBUILT"] = "0" if mode == "kernelized-jit" else "1"
                build = build_dir
                if mode == "kernelized-noarch":
                    build = Path(noarch)
                    for v in NOARCH:
                        if (Path(build_dir) / v).is_dir():
                            shutil.copytree(Path(build_dir) / v, build / v)
                cmd = [sys.executable, "-m", "kerneltools.bench.cold", "--child", mode, "--build-dir",
                       str(build), "--model", model, "--device", device] + (["--tiny"] if tiny else [])
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise RuntimeError(f"cold-start process ({mode}) failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                res["process_s"] = time.perf_counter() - t0
                runs.append(res)
                first = ", ".join(f"{k} {v['first_s']:.2f}s" for k, v in res["parts"].items())
                log(f"process {i + 1}/{processes} {mode}{' (' + res['variant'] + ')' if 'variant' in res else ''}: "
                    f"{first}; Triton cache entries {res['cache_entries']}")
    return dict(meta=meta(torch), model=model, tiny=tiny, device=device, runs=runs)


def to_markdown(result: dict) -> str:
    m = result["meta"]
    modes = [md for md in MODES if any(r["mode"] == md for r in result["runs"])]
    parts = list(result["runs"][0]["parts"])
    lines = [f"# Cold start on {m['card']}: {result['model']}{' (tiny)' if result['tiny'] else ''}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"transformers {m.get('transformers')}, kernels {m.get('kernels')}; bf16. Each process is fresh with an "
             "empty Triton cache; times are seconds, each process's value joined by ' / '. `kernelized-jit` is the "
             "kernelized model with GEGLU_PREBUILT=0 (Triton compiles every kernel at first use); `kernelized-noarch` the "
             "kernelized model loaded from the noarch variants alone (`torch-cuda` on a GPU).", "",
             "| first call / second call (s) | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]

    def cell(mode, fn):
        return " / ".join(fn(r) for r in result["runs"] if r["mode"] == mode)

    for part in parts:
        lines.append(f"| {part}, first | " + " | ".join(
            cell(md, lambda r: f"{r['parts'][part]['first_s']:.2f}") for md in modes) + " |")
        lines.append(f"| {part}, second | " + " | ".join(
            cell(md, lambda r: f"{r['parts'][part]['second_s']:.3f}") for md in modes) + " |")
    lines.append("| Triton cache entries written | " + " | ".join(
        cell(md, lambda r: str(r["cache_entries"])) for md in modes) + " |")
    lines.append("| variant loaded | " + " | ".join(
        cell(md, lambda r: r.get("variant", "-")) for md in modes) + " |")
    lines.append("| kernelize (s) | " + " | ".join(
        cell(md, lambda r: f"{r.get('kernelize_s', 0):.2f}") for md in modes) + " |")
    ratios = []
    for part in parts:  # process i's kernelized model against process i's eager one (they ran one after the other)
        e = [r["parts"][part]["first_s"] for r in result["runs"] if r["mode"] == "eager"]
        k = [r["parts"][part]["first_s"] for r in result["runs"] if r["mode"] == "kernelized"]
        if e and k:
            ratios.append(f"{part} " + " / ".join(f"{b / a:.2f}x ({b - a:+.2f} s)" for a, b in zip(e, k)))
    if ratios:
        lines += ["", "Kernelized first call over eager's, per process pair: " + "; ".join(ratios) + "."]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    """``kerneltools bench --cold-start``."""
    model = (args.model or ["gemma3-4b"])[0]
    modes = [m.strip() for m in args.cold_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"error: --cold-modes {args.cold_modes!r}: expected some of {','.join(MODES)}")
    result = run(args.build_dir, model=model, processes=args.processes if args.processes > 1 else 2, modes=modes,
                 tiny=args.tiny, device="cpu" if args.cpu else None)
    print_and_write(args.out, "cold-start", result, to_markdown(result))
    return 0


def _child_main(argv) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, choices=MODES)
    p.add_argument("--build-dir", type=Path, required=True)
    p.add_argument("--model", default="gemma3-4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    print(json.dumps(child(a.child, a.build_dir, a.model, a.tiny, a.device)))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
