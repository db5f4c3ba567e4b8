"""The whole-model benchmark on CPU with --tiny configs: every model, mode and part runs end to end and is reported,
and a kernelized model compiles to no more Dynamo graphs than the same model without kernels over a sweep of
sequence lengths (the layers make no shape decision in traced code: the ops do, when they run)."""

import json
import subprocess
import sys

from toolhelpers import REPO_ROOT


def _bench(build_dir, tmp_path, *args):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kerneltools", "bench", "--build-dir", str(build_dir), "--tiny",
                           "--cpu", "--rounds", "1", "--reps", "1", "--backend", "aot_eager", "--out", str(out), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "model.json").read_text()), (out / "model.md").read_text()


def test_no_extra_graphs_for_any_model(build_dir, tmp_path):
    res, md = _bench(build_dir, tmp_path, "--model", "all", "--parts", "prefill", "--graph-lengths", "16,40,97,300")
    assert [m["model"] for m in res["models"]] == ["gemma3-4b", "gemma2-2b", "t5-v1.1-base", "modernbert-base"]
    for m in res["models"]:
        g = m["graphs"]
        assert 1 <= g["kernelized+compile"] <= g["compile"], (m["model"], g)
        row = m["rows"][0]
        assert set(row["modes"]) == {"eager", "kernelized", "compile", "kernelized+compile"}
        assert row["modes"]["eager"]["vs_eager"] == [1.0, 1.0, 1.0]
    assert "## Summary" in md and "| gemma3-4b | prefill |" in md


def test_every_part_of_a_causal_model(build_dir, tmp_path):
    res, md = _bench(build_dir, tmp_path, "--model", "gemma3-4b", "--modes", "eager,kernelized",
                     "--new-tokens", "2", "--graph-lengths", "", "--profile")
    rows = res["models"][0]["rows"]
    assert [r["part"] for r in rows] == ["prefill", "train", "decode b1", "decode b8"] or \
        [r["part"] for r in rows] == ["prefill", "decode b1", "decode b8", "train"]
    train = next(r for r in rows if r["part"] == "train")
    nodes = train["profile"]["kernelized"]["autograd_nodes"]
    assert nodes.get("GeGLUMLPFunctionBackward") == 2, nodes  # the MLP's training step ran as our node
    assert "GeluBackward0" in train["profile"]["eager"]["autograd_nodes"]
    for r in rows:
        assert r["modes"]["kernelized"]["tokens_per_s"] > 0
