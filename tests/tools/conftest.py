"""Fixtures for the tooling tests: a loopback Hub server per test (subprocess, free port, tmp storage)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toolhelpers import REPO_ROOT, TRUSTED_ORG  # noqa: E402

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
