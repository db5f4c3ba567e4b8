"""kerneltools is installed into the venv, editable from this checkout (scripts/setup-env.sh: pip install -e .):
importable from any directory, with the ``kerneltools`` console script."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from toolhelpers import REPO_ROOT
from kerneltools.build.config import hub_repo_id

SETUP_HINT = "kerneltools is not installed in this venv: run bash scripts/setup-env.sh"


def _env() -> dict:
    """The environment without PYTHONPATH: only what is installed in the venv is importable."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_import_from_outside_the_repository(tmp_path):
    code = ("import kerneltools, kerneltools.build.cuda, kerneltools.publish\n"
            "from kerneltools.transformers_kernels import DEFAULT_REPO_ID, register_geglu_kernels\n"
            "print(kerneltools.__file__)\n"
            "print(DEFAULT_REPO_ID)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, f"{SETUP_HINT}\n{r.stderr[-3000:]}"
    init, repo_id = r.stdout.split()
    assert Path(init).resolve() == REPO_ROOT / "kerneltools" / "__init__.py", "the venv imports another checkout"
    assert repo_id == hub_repo_id()  # build.toml found through the installed package


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "kerneltools"
    assert script.is_file(), SETUP_HINT
    r = subprocess.run([str(script), "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kerneltools ")
    for command in ("build", "serve", "publish", "bench", "demo", "profile", "prefetch"):
        assert f"    {command} " in r.stdout, command
    r = subprocess.run([str(script), "build", "--root", str(REPO_ROOT), "--out", str(tmp_path / "out"),
                        "--variant", "cpu"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "torch-cpu" / "metadata.json").is_file()


def test_the_package_list_covers_every_subpackage():
    from setuptools import find_packages

    find = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(REPO_ROOT), include=find["include"]))
    on_disk = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "kerneltools").rglob("__init__.py")}
    assert {"kerneltools", "kerneltools.build"} <= on_disk
    assert found == on_disk
