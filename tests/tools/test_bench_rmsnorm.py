"""The RMSNorm benchmark's code path, run on CPU (``--quick``: the Triton kernels under the interpreter, a
wall-clock timer): it runs to the end and reports every implementation and pass. The timings need a GPU."""

import json
import os
import subprocess
import sys

import torch
from toolhelpers import REPO_ROOT


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "kerneltools.bench.rmsnorm", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_quick_run_reports_every_implementation(build_dir, tmp_path):
    r = _run("--quick", "--sweep", "--build-dir", str(build_dir), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "rmsnorm.json").read_text())
    seen = {(row["M"], row["impl"], row["pass_"]) for row in res["rows"]}
    for impl in ("ours", "eager", "torch.compile"):
        assert {(16, impl, "fwd"), (16, impl, "bwd"), (1, impl, "fwd per call")} <= seen, impl
    assert all(row["us"] > 0 for row in res["rows"]) and res["meta"]["copy_floor_tbs"] > 0
    assert {s["pass_"] for s in res["sweep"]} == {"fwd", "bwd"}
    md = (tmp_path / "rmsnorm.md").read_text()
    assert "| bfloat16 | 16x256 | fwd | ours |" in md and md in r.stdout


def test_refuses_what_it_cannot_run(tmp_path):
    missing = _run("--quick", "--build-dir", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no build tree at" in missing.stderr
    if not torch.cuda.is_available():
        full = _run("--build-dir", str(tmp_path))
        assert full.returncode == 2 and "only --quick runs" in full.stderr
