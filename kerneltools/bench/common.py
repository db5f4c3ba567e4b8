"""Timing and reporting helpers shared by the benchmarks (GPU; nothing here runs at import)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def median_us(fn, rep_ms=200) -> float:
    """Median µs of ``fn`` by ``triton.testing.do_bench`` (events around each call, L2 flushed before each)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def wall_us(fn, calls: int = 5) -> float:
    """Median wall-clock µs of ``calls`` calls after one untimed call (the benchmarks' CPU runs: a smoke test, not a
    measurement)."""
    fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return median(samples)


def timer(cuda: bool, rep_ms: int = 100):
    """The benchmarks' timer: ``median_us`` (do_bench, L2 flushed) on CUDA, ``wall_us`` on CPU."""
    return (lambda fn: median_us(fn, rep_ms)) if cuda else wall_us


def per_call_us(fn, n: int = 2000) -> float:
    """Wall time per call of back-to-back calls, launch and Python overhead included (what decode sees)."""
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_call_us(fn, calls: int = 100) -> float:
    """Time per call of ``calls`` calls captured in one CUDA graph and replayed: the GPU time plus the graph's
    per-kernel cost, with the host out of it (decode with transformers' static cache and "reduce-overhead")."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    t = per_call_us(graph.replay, n=200) / calls
    del graph
    return t


def copy_floor_tbs(torch) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the floor every pointwise pass is held to."""
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src), rep_ms=500)
    return 2 * src.numel() * 2 / (t * 1e-6) / 1e12


def cublas_tflops(torch) -> float:
    """cuBLAS's bf16 rate on an 8192^3 product of random data (the GEMM ceiling of the same run)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = median_us(lambda: a @ b, rep_ms=500)
    return 2 * 8192**3 / (t * 1e-6) / 1e12


def git_commit(root: Path = REPO_ROOT) -> str:
    """HEAD's short id; GEGLU_COMMIT when set (the GPU machine gets a copy of the tree without .git)."""
    if os.environ.get("GEGLU_COMMIT"):
        return os.environ["GEGLU_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


_NOT_SETTINGS = ("GEGLU_BUILD_DIR", "GEGLU_COMMIT", "GEGLU_TEST_SEED")  # where things are, not how the package runs


def meta(torch) -> dict:
    """Card, software versions, commit and date: every result file carries them."""
    import triton

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    out = dict(card=card, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               python=platform.python_version(), commit=git_commit(),
               date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    # the package's settings from the environment (GEGLU_FUSED_MLP=0 and the like): a result measured with a
    # setting changed must say so
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("GEGLU_") and k not in _NOT_SETTINGS}
    if settings:
        out["settings"] = settings
    for name in ("transformers", "kernels"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            pass
    return out


def print_and_write(out, name: str, result: dict, md: str) -> None:
    """Print a benchmark's markdown report and, with ``out``, write it and its result as ``out/name.md`` /
    ``out/name.json``."""
    import json

    print(md)
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{name}.md").write_text(md)


def median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def peak_mib(torch, fn) -> float:
    """Memory allocated above what was live before, at its peak during one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def pair_schedule(others: list, rounds: int) -> list:
    """The benchmark's timing order: per round, each implementation in ``others`` next to eager, as a pair
    [first, second]; the implementations' order reverses every round and eager's place in the pair alternates, so
    that neither a place in the round nor a place in the pair favours anyone."""
    pairs = []
    for r in range(rounds):
        for name in others if r % 2 == 0 else others[::-1]:
            # eager's place alternates per implementation from round to round (keyed on the implementation, not on
            # its place in the reversed order, which would pin each one to one side of its pair)
            pairs.append(["eager", name] if (r + others.index(name)) % 2 == 0 else [name, "eager"])
    return pairs


def round_order(names: list, r: int) -> list:
    """The order of ``names`` in round ``r`` of an interleaved benchmark: rotated by one place each round and
    reversed every other round, so that no implementation keeps a place (first after a warm-up, last before a
    sync) over the rounds."""
    k = r % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (r // len(names)) % 2 else order


def cache_arg(model) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` from transformers 5.25 (which
    deprecates ``past_key_values``), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache a model's output carries (``cache`` from transformers 5.25, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]
