"""The benchmark's CPU-side parts (kerneltools.bench): its command-line errors and its markdown. The timings
themselves need a GPU (benchmarks/device_run.sh)."""

import subprocess
import sys

from toolhelpers import REPO_ROOT

from kerneltools.bench import common, mlp as bench


def _row(impl, fwd, fwd_bwd):
    return dict(M=8192, D=2304, H=9216, impl=impl, fwd_us=fwd, fwd_pct_cublas=98.2,
                fwd_bwd_us=fwd_bwd, fwd_bwd_pct_cublas=92.5 if fwd_bwd else None,
                fwd_vs_eager=0.896, fwd_bwd_vs_eager=0.956 if fwd_bwd else None,
                fwd_peak_mib=180.0, peak_mib=652.5 if fwd_bwd else None)


def test_mlp_markdown_marks_forward_only_rows():
    md = bench.mlp_markdown(dict(cublas_tflops=707.7, rows=[_row("ours", 1501.0, 4784.0),
                                                            _row(bench.UNFUSED_ROW, 1608.7, None)]))
    lines = md.splitlines()
    assert "cuBLAS 8192^3 at 707.7 TFLOP/s" in md and bench.UNFUSED_ROW in md
    ours = next(line for line in lines if line.startswith("| 8192x2304x9216 | ours |"))
    unfused = next(line for line in lines if line.startswith(f"| 8192x2304x9216 | {bench.UNFUSED_ROW} |"))
    assert ours.split(" | ")[2:] == ["1501.0", "98.2", "0.896", "4784.0", "92.5", "0.956", "180.0", "652.5 |"]
    assert unfused.split(" | ")[2:] == ["1608.7", "98.2", "0.896", "—", "—", "—", "180.0", "— |"]


def test_median_takes_the_middle_value():
    assert common.median([3.0, 1.0, 2.0]) == 2.0 and common.median([5.0]) == 5.0


def test_bench_cli_errors_before_any_gpu_work():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "kerneltools", "bench", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)

    both = run("--mlp-only", "--no-mlp")
    assert both.returncode == 2 and "--mlp-only and --no-mlp leave nothing to run" in both.stderr
    import torch

    if not torch.cuda.is_available():
        plain = run("--quick")
        assert plain.returncode == 2 and "needs a CUDA GPU" in plain.stderr


def test_pair_schedule_pairs_everyone_with_eager_in_both_places():
    others = ["torch.compile", "liger", "ours", bench.UNFUSED_ROW]
    pairs = common.pair_schedule(others, 3)
    assert len(pairs) == 3 * len(others) and all(len(p) == 2 and "eager" in p for p in pairs)
    for r in range(3):  # every implementation once per round
        assert sorted(n for p in pairs[r * 4:(r + 1) * 4] for n in p if n != "eager") == sorted(others)
    for name in others:  # eager both before and after each implementation over the rounds
        places = {p.index("eager") for p in pairs if name in p}
        assert places == {0, 1}, name
    assert common.pair_schedule(["ours"], 2) == [["eager", "ours"], ["ours", "eager"]]
