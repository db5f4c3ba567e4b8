"""kerneltools.bench.moe on CPU with --quick (tiny shapes): it runs end to end, ours is the kernelized experts
module whose gate runs the packed kernel once per call, every output is compared with eager's (bf16 tanh with an
intermediate size of 64: bit-exact on CPU), and the markdown has every row. The timings themselves are GPU work
(`bash benchmarks/device_run.sh moe`)."""

import json
import os
import subprocess
import sys

import pytest

from toolhelpers import REPO_ROOT


def _bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kerneltools.bench.moe", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_bench_moe_quick_on_cpu(build_dir, tmp_path):
    r = _bench("--quick", "--device", "cpu", "--rounds", "2", "--compile-backend", "aot_eager",
               "--build-dir", str(build_dir), "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "moe.json").read_text())
    assert res["checks"]["experts_forward"] == "GeGLUExperts.forward"
    assert res["checks"]["gate_forward"] == "GeGLUExpertsGate.forward"
    shape = res["meta"]["shape"]
    rows = res["rows"]
    # On CPU tensors the fused gate/up grouped GEMM runs under the Triton interpreter only (TRITON_INTERPRET=1, which
    # the tests set without a GPU)
    fused = ("ours",) if os.environ.get("TRITON_INTERPRET") == "1" else ()
    expected = {(t, step, impl) for t in (32, 1, 8) for step, impls in (
        ("gate", ("eager", "torch.compile", "ours")),
        ("gate_up", ("eager", "grouped_mm alone") + fused),
        ("block", ("eager", "torch.compile", "ours", "ours, fused_mlp off"))) for impl in impls}
    assert {(r["tokens"], r["step"], r["impl"]) for r in rows} == expected and len(rows) == len(expected)
    for row in rows:
        where = f"{row['label']} {row['step']} {row['impl']}"
        assert row["rows"] == row["tokens"] * shape["top_k"] and row["us"] > 0, where
        if row["impl"] == "eager":
            assert row["vs_eager"] == 1.0, where
        if row["step"] == "gate_up":  # the grouped GEMM alone has the [S, 2I] output: nothing to compare
            assert row["pct_grouped_mm"] > 0, where
            if row["impl"] == "grouped_mm alone":
                assert row["max_abs"] is None and row["pct_grouped_mm"] == 100.0, where
            elif row["impl"] == "ours":  # the fused epilogue is not eager's bits; within a unit of bf16 here
                assert row["max_abs"] is not None and row["max_abs"] < 0.05, where
            continue
        # below FUSED_RULES' min_rows routed rows the block's gate is the packed kernel: bit-exact on CPU
        assert row["equal"], f"{where}: max|d| {row['max_abs']} against eager"
        if row["impl"].startswith("ours"):
            assert row["packed_calls"] == 1, where  # grouped_mm: one gate per experts call
        if row["step"] == "gate":  # % of the copy floor: the gate's GB/s over the copy's (both rounded)
            assert row["gbs"] > 0, where
            pct = 100 * row["gbs"] / res["meta"]["copy_floor_gbs"]
            assert row["pct_floor"] == pytest.approx(pct, rel=1e-9), where
    md = (tmp_path / "moe.md").read_text()
    assert md.count("\n| ") == 1 + len(expected) and "| prefill 2x16 | 64 | gate | ours |" in md
    assert "| prefill 2x16 | 64 | gate_up | grouped_mm alone | " in md


def test_bench_moe_refuses_full_shapes_on_cpu_and_bad_rounds(tmp_path):
    full = _bench("--device", "cpu", "--build-dir", str(tmp_path), timeout=120)
    assert full.returncode == 2 and "the full shapes need a GPU" in full.stderr and "--quick" in full.stderr
    rounds = _bench("--quick", "--device", "cpu", "--rounds", "0", "--build-dir", str(tmp_path), timeout=120)
    assert rounds.returncode == 2 and "--rounds must be at least 1, got 0" in rounds.stderr
    missing = _bench("--quick", "--device", "cpu", "--build-dir", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 2 and "no build tree at" in missing.stderr


def test_reference_row_is_exactly_one_hundred_percent():
    """The reference row's percentage is exact by construction, for every measured time: these times made the
    former ``100 * t / t`` read 100.00000000000001 or 99.99999999999999."""
    from random import Random

    from kerneltools.bench.moe import percent_of

    rng = Random()
    times = [5487.44, 5963.27, 5606.44] + [rng.uniform(0.1, 1e5) for _ in range(100_000)]
    assert [t for t in times if percent_of(t, t) != 100.0] == []
    assert percent_of(50.0, 200.0) == 25.0 and percent_of(3.0, 2.0) == 150.0
