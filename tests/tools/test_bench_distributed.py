"""kerneltools.bench.distributed starts and reports on CPU: two gloo ranks through torchrun (transformers'
tp_plan="auto" and FSDP2) and one process (a 1-process mesh through parallelize_module), with a tiny config. The
timings here mean nothing (a shared 2-core machine); what is checked is that every phase ran both variants, that
the kernel's inputs were each rank's shard under TP, and that the FSDP2 step ran the training node. The GPU run is
the benchmark (docs/distributed.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from toolhelpers import REPO_ROOT

TIMEOUT = 600


def _env():
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_VERBOSITY="error")


def _bench(build_dir, tmp_path, launcher: list, *args):
    """Run the benchmark (through ``launcher``: the interpreter, or torchrun) with a tiny config; (its report, the
    finished process)."""
    out = tmp_path / "report.json"
    cmd = [*launcher, "-m", "kerneltools.bench.distributed", "--tiny", "--build-dir", str(build_dir), "--rounds", "1",
           *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc


def _check_phase(res: dict) -> None:
    assert set(res["ms"]) == {"eager", "kernelized"} and all(v > 0 for v in res["ms"].values())
    assert len(res["round_ratios"]) == 1 and res["ratio_eager_over_kernelized"] > 0


def test_two_ranks_tp_and_fsdp(build_dir, tmp_path):
    report, proc = _bench(build_dir, tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc-per-node", "2"],
                          "--device", "cpu", "--warmup", "0", "--decode-steps", "2")
    assert report["world_size"] == 2 and report["tp"] == "transformers tp_plan='auto'"
    assert set(report["phases"]) == {"prefill", "decode", "train"}
    for res in report["phases"].values():
        _check_phase(res)
    # TP: the kernel's input is each rank's half of the intermediate size (64 / 2)
    assert report["phases"]["prefill"]["profile"]["gate_local_shapes"] == [[2, 16, 32]]
    assert report["phases"]["decode"]["profile"]["gate_local_shapes"] == [[2, 1, 32]]
    # FSDP2: whole projections inside each layer's forward, and the training step as one node per MLP
    train = report["phases"]["train"]["profile"]
    assert train["gate_local_shapes"] == [[2, 16, 64]]
    assert train["geglu_events"]["GeGLUMLPFunction"]["count"] == 2
    assert "[bench-dist] FSDP2 train step: eager" in proc.stdout


def test_one_process_mesh(build_dir, tmp_path):
    report, _ = _bench(build_dir, tmp_path, [sys.executable], "--device", "cpu", "--warmup", "0", "--phases", "prefill")
    assert report["world_size"] == 1 and report["tp"] == "parallelize_module on a 1-process mesh"
    assert set(report["phases"]) == {"prefill"}
    _check_phase(report["phases"]["prefill"])
    assert report["phases"]["prefill"]["profile"]["gate_local_shapes"] == [[2, 16, 64]]


@pytest.mark.gpu
def test_one_gpu_mesh_runs_our_kernels(build_dir, tmp_path):
    """On one GPU (a 1-process mesh, parallelize_module): the profiled prefill and decode launched our kernels
    (names with "geglu", on the GPU) on the kernel's inputs."""
    report, _ = _bench(build_dir, tmp_path, [sys.executable], "--device", "cuda", "--warmup", "1",
                       "--phases", "prefill,decode")
    for phase in ("prefill", "decode"):
        events = report["phases"][phase]["profile"]["geglu_events"]
        assert any(e["device_time_us"] > 0 for e in events.values()), (phase, events)
