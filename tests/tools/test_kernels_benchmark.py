"""benchmarks/benchmark.py with kernels' own benchmark runner: its workloads agree with eager PyTorch, and
`kernels benchmark ORG/NAME@v1` runs them from the version branch that publish wrote on the loopback Hub (a few
iterations, the small CPU shapes without a GPU: the timings themselves are not checked).

kernels 0.17.2's `kernels benchmark` downloads the branch with `snapshot_download` and no `repo_type` (the model
API); the loopback Hub serves kernel repos under the kernel API only. So the CLI runs (`from kernels.cli import
main`, the running interpreter) with that one call made for the kernel type, and a test pins the 0.17.2 behaviour,
failing once kernels or the server changes it. Where `kernels.cli` does not import (the device's Python 3.12 has no
wheels for sigstore's pydantic-core and cffi), kernels' benchmark runner is loaded from its file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from toolhelpers import GEGLU_REPO, REPO_ROOT, git, kernels_env, repo_dir, run_cli

SCRIPT = REPO_ROOT / "benchmarks" / "benchmark.py"
FORMS = ("split", "packed", "packed_act_second")
WORKLOADS = {f"{kind}_{form}" for kind in ("forward", "forward_backward") for form in FORMS}
CLASSES = {"GeGLUErf": "none", "GeGLUTanh": "tanh"}
# eager's CPU erf-GELU rounds differently on the strided chunk views of a packed tensor than on the contiguous
# halves the kernel's CPU implementation computes on; normwise bound, max|kernel - eager| <= RTOL * max|eager|
# (observed 1.3e-7). Everything else is bit-exact on CPU.
RTOL = 1e-6

# kernels 0.17.2's `kernels benchmark ORG/NAME@vN` downloads with snapshot_download(repo_id, revision) and no
# repo_type, i.e. from the *model* API, where a kernel repository is not (the loopback Hub serves kernel repos under
# /api/kernels only). This runs kernels' CLI with that one call made for the kernel type.
KERNELS_BENCHMARK_CLI = """
import functools, sys
from kerneltools.kernels_api import cli_benchmark_module, cli_main
runner = cli_benchmark_module()
main = cli_main()

_api = runner._get_hf_api
def _kernel_api(*args, **kwargs):
    api = _api(*args, **kwargs)
    api.snapshot_download = functools.partial(api.snapshot_download, repo_type="kernel")
    return api
runner._get_hf_api = _kernel_api
sys.exit(main())
"""
KERNELS_CLI = "import sys; from kerneltools.kernels_api import cli_main; sys.exit(cli_main()())"


def _runner():
    """kernels' benchmark runner module. ``kernels.cli``'s package init imports its signature verifier (sigstore,
    cryptography) before the runner; where those are not installed (the GPU machine's Python has no wheels for
    them) the runner's own file is loaded by path: it needs neither."""
    import importlib.util

    from kerneltools.kernels_api import cli_benchmark_source

    path = cli_benchmark_source()
    spec = importlib.util.spec_from_file_location("_kernels_cli_benchmark", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner


def _classes():
    runner = _runner()
    return {c.__name__: c for c in runner.discover_benchmark_classes(SCRIPT, REPO_ROOT)}  # the runner's own discovery


def test_the_workloads_are_forward_and_backward_of_each_form_for_both_gelus():
    classes = _classes()
    assert set(classes) == set(CLASSES)
    for name, cls in classes.items():
        assert cls.approximate == CLASSES[name]
        benchmarks = {n[len("benchmark_"):] for n in dir(cls) if n.startswith("benchmark_")}
        verifies = {n[len("verify_"):] for n in dir(cls) if n.startswith("verify_")}
        assert benchmarks == verifies == WORKLOADS, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cls_name", list(CLASSES))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_each_workload_matches_eager(geglu, device, cls_name, workload):
    """As the runner calls them (seed, setup, benchmark_*, then verify_*), on the kernel loaded from the build; the
    reference is computed without the kernel. On the GPU (bf16, the benchmark's full shape) bit-exact throughout."""
    cls = _classes()[cls_name]
    bench = cls()
    bench.kernel, bench.device = geglu, device
    torch.manual_seed(bench.seed)
    bench.setup()
    getattr(bench, f"benchmark_{workload}")()
    out = bench.out
    bench.kernel = None  # verify_* is eager PyTorch alone
    ref = getattr(bench, f"verify_{workload}")()
    assert out.shape == ref.shape and out.dtype == ref.dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
    assert out.device.type == device
    rows, d = bench.dy.shape
    assert out.numel() == rows * d * (2 if workload.startswith("forward_backward") else 1)
    if device == "cpu" and cls.approximate == "none" and "packed" in workload:
        assert (out - ref).abs().max() <= RTOL * ref.abs().max()
    else:
        assert torch.equal(out, ref)
    assert torch.allclose(out, ref, atol=1e-2)  # the runner's own check


@pytest.fixture
def published(hub, geglu_builds, tmp_path):
    """The real kernel's v1, with benchmarks/benchmark.py, on the loopback Hub; returns (hub, tmp dir)."""
    result = geglu_builds.v1.publish(hub)
    assert result.benchmarks == ["benchmarks/benchmark.py"]
    return hub, tmp_path


def _check_report(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(proc.stdout)
    results = {r["workload"]: r for r in payload["results"]}
    assert set(results) == {f"{c}.{w}" for c in CLASSES for w in WORKLOADS}
    assert all(r["verified"] is True for r in results.values())
    assert all(r["timingResults"]["iterations"] == 2 for r in results.values())
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the runner's choice: its backend's device
    assert payload["machineInfo"]["backend"].startswith("CUDA" if device == "cuda" else "CPU")
    assert f"Running GeGLUErf on {device}" in proc.stderr and f"Running GeGLUTanh on {device}" in proc.stderr


def test_kernels_benchmark_runs_the_published_version(published):
    hub, tmp = published
    assert git(repo_dir(hub, GEGLU_REPO), "show", "v1:benchmarks/benchmark.py") == SCRIPT.read_text()
    proc = run_cli([sys.executable, "-c", KERNELS_BENCHMARK_CLI, "benchmark", f"{GEGLU_REPO}@v1",
                    "--iterations", "2", "--warmup", "1", "--json"], kernels_env(hub.url, tmp / "hub-run"),
                   timeout=300)
    _check_report(proc)
    assert f"Downloading {GEGLU_REPO}@v1" in proc.stderr


def test_kernels_benchmark_on_a_download_of_the_branch(published):
    """kernels' CLI as it is, on a local copy of branch v1 (build/ and benchmarks/, as the Hub holds them)."""
    from huggingface_hub import HfApi

    hub, tmp = published
    snapshot = Path(HfApi(endpoint=hub.url, token=False).snapshot_download(
        GEGLU_REPO, repo_type="kernel", revision="v1", local_dir=tmp / "v1"))
    assert (snapshot / "benchmarks" / "benchmark.py").is_file() and (snapshot / "build" / "torch-cpu").is_dir()
    proc = run_cli([sys.executable, "-c", KERNELS_CLI, "benchmark", str(snapshot), "--iterations", "2",
                    "--warmup", "1", "--json"], kernels_env(hub.url, tmp / "local-run"), timeout=300)
    _check_report(proc)


def test_kernels_0_17_2_asks_the_model_api_for_a_version(published):
    """Why KERNELS_BENCHMARK_CLI exists: the unchanged CLI looks for ORG/NAME@v1 among models. When this fails,
    kernels (or the Hub server) has changed and the workaround above can go."""
    import kernels

    if kernels.__version__ != "0.17.2":
        pytest.skip(f"checks kernels 0.17.2's behaviour, this is {kernels.__version__}")
    hub, tmp = published
    proc = run_cli([sys.executable, "-c", KERNELS_CLI, "benchmark", f"{GEGLU_REPO}@v1", "--iterations", "1"],
                   kernels_env(hub.url, tmp / "model-api"), timeout=300)
    assert proc.returncode != 0
    assert f"/api/models/{GEGLU_REPO}/revision/v1" in proc.stderr
