"""benchmarks/call_cost.py runs on CPU: each build in its own worker, every case timed in each round, and a report
with one row per case and the ratios to the first build. Its figures are not checked: speed is the benchmark's to
show, on the machine it is run on."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_call_cost_runs_on_cpu_and_reports_every_case(build_dir, tmp_path):
    variant = build_dir / "torch-cpu"
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_cost.py"), "--build", f"a={variant}",
                           "--build", f"b={variant}", "--rounds", "2", "--calls", "4", "--blocks", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "call-cost.json").read_text())
    cases = ["geglu", "geglu autograd", "geglu_packed", "rms_norm", "GeGLUMLP layer", "geglu compiled"]
    assert [r["case"] for r in result["rows"]] == cases and result["rounds"] == 2 and result["blocks"] == 2
    for row in result["rows"]:
        assert row["a us"] > 0 and row["b us"] > 0
        median, low, high = row["b / a"]
        assert low <= median <= high
    md = (out / "call-cost.md").read_text()
    assert md.startswith("| case | a µs | b µs | b / a [range] |") and md.count("\n| ") == len(cases)  # the rows after the header and rule


def test_call_cost_needs_two_builds(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_cost.py"), "--build", f"a={tmp_path}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "give at least two --build" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_cost.py"), "--build", "nolabel"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "expected LABEL=PATH" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_cost.py"), "--build", f"a={tmp_path}",
                           "--build", f"b={tmp_path}", "--blocks", "0"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2 and "expected both at least 1" in proc.stderr
