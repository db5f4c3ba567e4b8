"""Fixtures for the tooling tests: a loopback Hub server per test (subprocess, port 0, tmp storage, a write token in
HF_TOKEN), and builds of the real kernel shared by the whole test run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toolhelpers import REPO_ROOT, TRUSTED_ORG, WRITE_ORGS, build_geglu, kernel_source_copy  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kerneltools.hub import serve_hub  # noqa: E402


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    """No test sends a developer's own Hugging Face token; the hub fixture sets its server's."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub server subprocess on 127.0.0.1 (port 0: the one it got), storage in tmp_path/hub, trusting
    geglu-kernels; its write token (user `publisher`, write role in WRITE_ORGS) is hub.token and HF_TOKEN, so that
    huggingface_hub, publish and the kernels subprocesses (kernels_env) use it."""
    with serve_hub(tmp_path / "hub", trusted_orgs=[TRUSTED_ORG], write_orgs=WRITE_ORGS) as h:
        monkeypatch.setenv("HF_TOKEN", h.token)
        yield h


@pytest.fixture
def api(hub):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture(scope="session")
def geglu_builds(tmp_path_factory):
    """The real kernel's noarch variants (torch-cpu, torch-cuda), built once per test run (file copies):

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
