"""The cold-start benchmark on CPU (tiny configs): fresh processes per mode, each with its own empty Triton cache,
timing every part's first and second call, and a report that names each mode's numbers. Timings mean nothing
here; what is checked is that the processes run, each cold, and that the report says what they measured."""

import json
import shutil

from kerneltools.bench import cold


def test_cold_start_runs_fresh_processes_and_reports_them(build_dir, tmp_path):
    result = cold.run(build_dir, processes=1, modes=("eager", "kernelized"), tiny=True, device="cpu",
                      log=lambda *a: None)
    runs = result["runs"]
    assert [r["mode"] for r in runs] == ["eager", "kernelized"]
    parts = ["prefill 2x64", "prefill 1x30", "prefill 1x150", f"generate {cold.NEW_TOKENS}", "train 1x64"]
    for r in runs:
        assert list(r["parts"]) == parts
        for p in r["parts"].values():
            assert p["first_s"] > 0 and p["second_s"] > 0
        assert r["cache_entries"] == 0  # CPU tensors: nothing for Triton to compile
    assert "kernelize_s" in runs[1] and "kernelize_s" not in runs[0]
    md = cold.to_markdown(result)
    assert "| prefill 2x64, first |" in md and "| Triton cache entries written | 0 | 0 |" in md
    assert "per process pair" in md
    (tmp_path / "r.json").write_text(json.dumps(result))  # the result is plain JSON


def test_cold_start_noarch_mode_loads_the_noarch_variants_alone(build_dir, tmp_path):
    """``kernelized-noarch`` kernelizes from a copy of the build's noarch variants only (on a GPU, the torch-cuda
    variant a CUDA 12 torch loads, even where the build has a compiled variant this torch would prefer); the
    process says which variant kernels loaded, and the report shows it."""
    build = tmp_path / "build"
    for v in ("torch-cpu", "torch-cuda"):
        shutil.copytree(build_dir / v, build / v)
    result = cold.run(build, processes=1, modes=("kernelized-noarch",), tiny=True, device="cpu",
                      log=lambda *a: None)
    (run,) = result["runs"]
    assert run["mode"] == "kernelized-noarch" and run["variant"] == "torch-cpu" and run["cache_entries"] == 0
    assert "| variant loaded | torch-cpu |" in cold.to_markdown(result)
