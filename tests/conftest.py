"""Shared fixtures: the kernel is built by the project's own builder and loaded the way users load it, through
``kernels.get_local_kernel``. Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors."""

import os
import random
import shutil
import tempfile
import sys
import zlib
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Inductor's on-disk cache is keyed without ATEN_CPU_CAPABILITY: a kernel cached by a run under one ISA setting gave
# garbage when a run under another loaded it (test_compile_inductor). Each test run compiles into its own cache.
_OWN_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _OWN_INDUCTOR_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="geglu-inductor-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_INDUCTOR_CACHE:
        shutil.rmtree(_OWN_INDUCTOR_CACHE, ignore_errors=True)
if not HAS_CUDA:
    # Must be set before triton is first imported (it picks its interpreter at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, so that a run's skips explain themselves (``-rs`` would list the
    location of each of the hundreds of GPU tests a CPU run skips)."""
    from collections import Counter

    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("=", "skipped, by reason")
        for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            terminalreporter.write_line(f"{n:5d}  {reason}")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    """A build tree: $GEGLU_BUILD_DIR when set (e.g. one holding the compiled variant), else the noarch
    variants built from this checkout."""
    env = os.environ.get("GEGLU_BUILD_DIR")
    if env:
        return Path(env).resolve()
    from kerneltools.build import build

    out = tmp_path_factory.mktemp("build")
    build(ROOT, out, variants=["cpu", "cuda"], aot_capability="none", log=lambda *a: None)  # the interpreter runs the kernels
    return out


@pytest.fixture(scope="session")
def geglu(build_dir):
    """The kernel module, loaded by kernels from the build tree (the variant kernels picks for this machine)."""
    import kernels

    return kernels.get_local_kernel(build_dir)


def _impls():
    if HAS_CUDA:
        return ["cuda", "triton"]  # "cuda" skips itself when the loaded variant has no compiled library
    return ["cpu", "triton"]


@pytest.fixture(params=_impls())
def impl(request, geglu):
    """Run the test once per implementation available here; yields (name, device)."""
    name = request.param
    if name == "cuda" and not geglu.HAS_CUDA_LIB:
        pytest.skip("the loaded variant has no compiled CUDA library (set GEGLU_BUILD_DIR to a compiled build)")
    # 'cuda': the compiled library at every size (under 'auto' large problems run Triton, and small autograd calls
    # PyTorch's own ops: tests of the routing itself set 'auto').
    geglu.set_backend("auto" if name == "cpu" else name)
    try:
        yield name, ("cuda" if HAS_CUDA else "cpu")
    finally:
        geglu.set_backend("auto")


# --- seeded random data ------------------------------------------------------------------------------------------
# Each test draws from torch's and Python's global generators, seeded from the run's base seed and the test's id:
# fresh data on every run, and a failure replays with GEGLU_TEST_SEED=<base> (shown in the header and in the
# failure's report; the same test id gets the same data).

_SEED = pytest.StashKey[int]()


def _base_seed() -> int:
    text = os.environ.get("GEGLU_TEST_SEED", "").strip()
    if not text:
        return int.from_bytes(os.urandom(4), "little")
    try:
        return int(text, 0)
    except ValueError:
        raise pytest.UsageError(f"GEGLU_TEST_SEED={text!r}: expected an integer, the seed a failing run reported "
                                "(or unset it for fresh data).") from None


BASE_SEED = _base_seed()


def per_test_seed(nodeid: str, base: int = BASE_SEED) -> int:
    """The seed of one test: a function of the base seed and the test's id, so it replays alone or in a suite."""
    return zlib.crc32(f"{base}:{nodeid}".encode())


@pytest.fixture(autouse=True)
def _seeded_rng(request):
    seed = per_test_seed(request.node.nodeid)
    request.node.stash[_SEED] = seed
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    return seed


# Environment variables that change what kernels' loader loads in every later test's subprocesses: a test that sets
# one in this process (e.g. by building models in-process) must restore it.
_LOADER_ENV = ("LOCAL_KERNELS", "KERNELS_CACHE", "HF_ENDPOINT", "DISABLE_KERNEL_MAPPING")


@pytest.fixture(autouse=True)
def _loader_env_unchanged():
    before = {k: os.environ.get(k) for k in _LOADER_ENV}
    yield
    after = {k: os.environ.get(k) for k in _LOADER_ENV}
    changed = {k: (before[k], after[k]) for k in _LOADER_ENV if before[k] != after[k]}
    assert not changed, (f"this test left the loader's environment changed (before, after): {changed}; restore it "
                         "(monkeypatch.setenv) or do the work in a subprocess")


def pytest_report_header(config):
    return f"random data: GEGLU_TEST_SEED={BASE_SEED} (set it to replay this run's data)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and _SEED in item.stash:
        report.sections.append(("random data", f"replay with GEGLU_TEST_SEED={BASE_SEED} "
                                               f"(this test's torch seed: {item.stash[_SEED]})"))
