"""kernels' own command line on the published repository (loopback Hub): ``kernels info``, ``kernels versions``,
``kernels lock`` and ``kernels download`` work with what ``python -m kerneltools publish`` puts there, and
``kernels info`` reports the metadata fields kernels' validators read (the minimum kernels version among them).
Marked ``ecosystem``: CI runs it with the newest and the oldest supported kernels."""

from __future__ import annotations

import json
import textwrap

import pytest

from kerneltools.build.config import KERNELS_MINVER
from toolhelpers import GEGLU_REPO, KERNELS_CLI, cache_repo, kernels_env, run_cli

pytestmark = pytest.mark.ecosystem


def _ok(proc):
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_kernels_cli_on_the_published_repo(hub, geglu_builds, tmp_path):
    published = geglu_builds.v1.publish(hub)
    env = kernels_env(hub.url, tmp_path)

    info = json.loads(_ok(run_cli([KERNELS_CLI, "info", GEGLU_REPO, "--version", "1", "--json"], env)))
    assert (info["repo_id"], info["name"], info["version"]) == (GEGLU_REPO, "geglu", 1), info
    assert info["kernels_minver"] == KERNELS_MINVER, info

    versions = _ok(run_cli([KERNELS_CLI, "versions", GEGLU_REPO], env))
    assert "Version 1" in versions and "torch-cpu" in versions, versions

    project = tmp_path / "app"
    project.mkdir()
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "app"
        version = "0.1.0"

        [tool.kernels.dependencies]
        "{GEGLU_REPO}" = 1
        """))
    _ok(run_cli([KERNELS_CLI, "lock", str(project)], env))
    lock = json.loads((project / "kernels.lock").read_text())
    assert lock == [{"dependency": {"repo-id": GEGLU_REPO, "version": 1}, "lock": {"commit": published.commit}}]

    _ok(run_cli([KERNELS_CLI, "download", str(project)], env))
    snapshot = cache_repo(tmp_path / "kcache", GEGLU_REPO) / "snapshots" / published.commit
    meta = json.loads((snapshot / "build" / "torch-cpu" / "metadata.json").read_text())
    assert meta["kernels-minver"] == KERNELS_MINVER and meta["name"] == "geglu"
