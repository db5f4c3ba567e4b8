"""Fixtures for the tooling tests: a loopback Hub server per test (subprocess, free port, tmp storage), and builds of
the real kernel shared by the whole session."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toolhelpers import REPO_ROOT, TRUSTED_ORG, build_geglu, kernel_source_copy  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kerneltools.hub_server import serve_hub  # noqa: E402


@pytest.fixture
def hub(tmp_path):
    """A Hub server subprocess on 127.0.0.1:<free port>, storage in tmp_path/hub, trusting geglu-kernels."""
    with serve_hub(tmp_path / "hub", trusted_orgs=[TRUSTED_ORG]) as h:
        yield h


@pytest.fixture
def api(hub):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=False)


@pytest.fixture(scope="session")
def geglu_builds(tmp_path_factory):
    """The real kernel's noarch variants (torch-cpu, torch-cuda), built once per session (file copies):

    - v1: from this checkout, as `python -m kerneltools build` would;
    - v2: from a committed copy of the sources with build.toml's version = 2;
    - v1_changed: version 1 again, from a committed copy with a changed __init__.py (a new tree: new ids).
    """
    tmp = tmp_path_factory.mktemp("geglu_builds")
    return SimpleNamespace(
        v1=build_geglu(REPO_ROOT, tmp / "v1" / "build"),
        v2=build_geglu(kernel_source_copy(tmp / "src2", version=2), tmp / "src2" / "build"),
        v1_changed=build_geglu(kernel_source_copy(tmp / "src1b", note="rebuilt: v1 moved on"),
                               tmp / "src1b" / "build"),
    )
