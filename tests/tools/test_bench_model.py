"""The whole-model benchmark on CPU with --tiny configs: every model, mode and part runs end to end and is reported,
and a kernelized model compiles to no more Dynamo graphs than the same model without kernels over a sweep of
sequence lengths (the layers make no shape decision in traced code: the ops do, when they run)."""

import json
import subprocess
import sys

from toolhelpers import REPO_ROOT

from kerneltools.bench.model import _cell


def _run_bench(build_dir, out, *args):
    return subprocess.run([sys.executable, "-m", "kerneltools", "bench", "--build-dir", str(build_dir), "--tiny",
                           "--cpu", "--rounds", "1", "--reps", "1", "--backend", "aot_eager", "--out", str(out), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


def _bench(build_dir, tmp_path, *args):
    out = tmp_path / "out"
    proc = _run_bench(build_dir, out, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "model.json").read_text()), (out / "model.md").read_text()


def test_no_extra_graphs_for_any_model(build_dir, tmp_path):
    res, md = _bench(build_dir, tmp_path, "--model", "all", "--parts", "prefill", "--graph-lengths", "16,40,97,300")
    assert [m["model"] for m in res["models"]] == ["gemma3-4b", "gemma3-12b", "gemma2-2b", "t5-v1.1-base",
                                                  "t5-v1.1-large", "flan-t5-xl", "modernbert-base",
                                                  "modernbert-large", "gemma4-moe"]
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
    for r in rows:  # the host side of the profiled call: its wall time and the ops that took it
        for p in r["profile"].values():
            assert p["host_ms"] > 0 and p["host_top"], p
            assert all(ms <= p["host_ms"] and n >= 1 for _, ms, n in p["host_top"]), p["host_top"]
    assert "Host ops by self time, ms (calls):" in md
    for r in rows:
        assert r["modes"]["kernelized"]["tokens_per_s"] > 0


def test_compiled_decode_with_a_static_cache(build_dir, tmp_path):
    """--compile-decode times generate's own compiled decoding (a static cache, transformers' CompileConfig) in the
    compile modes: they compile (and only they), the kernelized model into as many graphs as the host's, not one
    per decoding step (the cache's filled length, a Python int, becomes symbolic), and the tokens are timed for
    every mode at both batch sizes."""
    res, md = _bench(build_dir, tmp_path, "--model", "gemma3-4b", "--parts", "decode", "--compile-decode",
                     "--new-tokens", "6", "--graph-lengths", "", "--decode-batches", "1,3")
    rows = res["models"][0]["rows"]
    assert [r["part"] for r in rows] == ["decode b1", "decode b3"]
    for r in rows:
        modes = r["modes"]
        assert set(modes) == {"eager", "kernelized", "compile", "kernelized+compile"}
        assert modes["eager"]["new_graphs"] == modes["kernelized"]["new_graphs"] == 0, r
        assert 1 <= modes["compile"]["new_graphs"] <= 2, r  # static shapes made one per step (5 here)
        assert modes["kernelized+compile"]["new_graphs"] == modes["compile"]["new_graphs"], r
    assert "| decode b1 | kernelized+compile |" in md


def test_bad_decode_batches_are_named(build_dir, tmp_path):
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "gemma3-4b", "--decode-batches", "1,x")
    assert proc.returncode != 0 and "--decode-batches '1,x': expected comma-separated integers" in proc.stderr


def test_call_cost_times_each_compiled_decoding_step_with_its_work_taken_out(build_dir, tmp_path):
    """--call-cost times every compile mode's decoding step compiled with a backend that replays its outputs (the
    host's part of a CUDA-graph step: guards and call handling) in interleaved rounds, as µs per call and per-round
    ratios to compile; causal models only (an encoder-decoder's step takes other arguments)."""
    res, md = _bench(build_dir, tmp_path, "--model", "gemma2-2b", "--model", "t5-v1.1-base", "--parts", "prefill",
                     "--modes", "eager,compile,kernelized+compile,copy+compile", "--graph-lengths", "",
                     "--call-cost", "3", "--layers", "3")
    gemma, t5 = res["models"]
    assert gemma["layers"] == t5["layers"] == 3  # --layers: the tiny configs have 2
    cost = gemma["call_cost"]
    assert list(cost) == ["compile", "kernelized+compile", "copy+compile"]
    assert cost["compile"]["vs_compile"] == [1.0, 1.0, 1.0]
    for mode, v in cost.items():
        assert v["us"] > 0 and v["vs_compile"][1] <= v["vs_compile"][0] <= v["vs_compile"][2], (mode, v)
    assert "call_cost" not in t5
    line = next(x for x in md.splitlines() if x.startswith("Compiled decoding step with its work taken out"))
    assert f"kernelized+compile {cost['kernelized+compile']['us']} ({_cell(cost['kernelized+compile']['vs_compile'])}" \
        in line


def test_with_layers_changes_only_the_depth():
    """--layers: every model's config with another number of layers, and nothing else changed but what the config
    class derives from the count (the per-layer attention types, one per layer)."""
    from kerneltools.bench.model import MODELS, with_layers

    for name, spec in MODELS.items():
        for tiny in (True, False):
            before = spec.config(tiny)
            after = with_layers(before, 5)
            a, b = before.to_dict(), after.to_dict()
            changed = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
            depth = {"num_layers", "num_decoder_layers"} if spec.kind == "seq2seq" else {"num_hidden_layers"}
            assert depth <= changed <= depth | {"layer_types", "per_layer_config"}, (name, changed)
            assert all(b[k] == 5 for k in depth), name
            if b.get("layer_types") is not None:
                assert len(b["layer_types"]) == 5, name


def test_bad_call_cost_and_layers_are_named(build_dir, tmp_path):
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "gemma2-2b", "--modes", "eager,kernelized+compile",
                      "--call-cost", "3")
    assert proc.returncode != 0 and "--modes must include compile" in proc.stderr
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "gemma2-2b", "--call-cost", "-1")
    assert proc.returncode != 0 and "--call-cost -1: expected a number of rounds" in proc.stderr
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "gemma2-2b", "--layers", "0")
    assert proc.returncode != 0 and "--layers 0: expected at least 1 layer" in proc.stderr


def test_copy_modes_are_an_a_a_control(build_dir, tmp_path):
    """copy / copy+compile time a plain deep copy of the eager model beside the others: its compiled forward is
    compiled for itself (as many graphs as compile's, none borrowed from the eager model's cache), and the graph
    count over lengths still compares only the eager and the kernelized model."""
    res, md = _bench(build_dir, tmp_path, "--model", "t5-v1.1-base", "--parts", "prefill",
                     "--modes", "eager,compile,copy,copy+compile", "--graph-lengths", "16,40")
    m = res["models"][0]
    modes = m["rows"][0]["modes"]
    assert list(modes) == ["eager", "compile", "copy", "copy+compile"]
    assert modes["copy"]["new_graphs"] == 0
    assert modes["copy+compile"]["new_graphs"] == modes["compile"]["new_graphs"] >= 1, modes
    assert set(m["graphs"]) == {"compile", "kernelized+compile"}
    assert "| prefill | copy+compile |" in md
    summary = md.split("## Summary")[1]
    assert "| kernelized / eager | copy / eager | <= host | kernelized+compile / compile | copy+compile / compile |" \
        in summary
    cells = next(line for line in summary.splitlines() if line.startswith("| t5-v1.1-base | prefill |")).split(" | ")
    assert cells[2:8] == ["–", _cell(modes["copy"]["vs_eager"]), "–", "–", _cell(modes["copy+compile"]["vs_compile"]),
                          "–"]


_GRAPH_OPS = """
import collections, json, sys
from pathlib import Path
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from kerneltools.bench import model as bm
from kerneltools.transformers_kernels import DEFAULT_REPO_ID


def compiled_ops(model, kwargs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.forward, backend=backend, fullgraph=True)(**kwargs)
    (entry,) = _debug_get_cache_entry_list(model.forward.__func__.__code__)
    # the guards Dynamo evaluates in Python (not in its C++ guard tree), without their source comments
    python_guards = [line.split("LAMBDA_GUARD: ", 1)[1].split("  #", 1)[0]
                     for line in str(entry.guard_manager).splitlines() if "LAMBDA_GUARD: " in line]
    bound = [type(m).__name__ for m in model.modules() if "forward" in m.__dict__]
    return dict(ops=[op for g in graphs for op in g], python_guards=python_guards, bound=len(bound),
                bound_classes=sorted(set(bound)))


out = {}
for name in sys.argv[2:]:
    s = bm.build_models(bm.MODELS[name], Path(sys.argv[1]), "cpu", torch.float32, True, "aot_eager", DEFAULT_REPO_ID)
    # the kernelized side is the compile modes' model, which build_models kernelized for INFERENCE | TORCH_COMPILE
    models = {"eager": s.models["eager"], "kernelized": s.models["kernelized+compile"]}
    kwargs = dict(input_ids=bm._ids(s, 2, 24))
    if s.spec.kind == "seq2seq":
        kwargs["decoder_input_ids"] = torch.zeros(2, 1, dtype=torch.long)
    out[name] = dict(layers=s.models["eager"].config.num_hidden_layers,
                     **{k: compiled_ops(m.eval(), kwargs) for k, m in models.items()})
    if s.spec.kind == "causal":  # a prompt of ROPE_OP_MIN_ROWS positions: the rotary op's side of its rule
        kwargs = dict(input_ids=bm._ids(s, 1, 2048))
        out[name]["long"] = {k: compiled_ops(m.eval(), kwargs) for k, m in models.items()}
print(json.dumps(out))
"""


_COMPILED_MODELS = ["t5-v1.1-base", "modernbert-base", "gemma3-4b"]
_COMPILED = {}


def _compiled(build_dir) -> dict:
    """Per model: the compiled graphs' ops, Python guards and bound forwards of the eager and the kernelized model
    (run once per test session)."""
    if not _COMPILED:
        proc = subprocess.run([sys.executable, "-c", _GRAPH_OPS, str(build_dir), *_COMPILED_MODELS], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _COMPILED.update(json.loads(proc.stdout.splitlines()[-1]))
    return _COMPILED


def test_compiled_graph_is_the_hosts_but_for_the_rope_op(build_dir):
    """Under torch.compile a kernelized model traces to the host's graph op for op and in its order, except that from
    ``ROPE_OP_MIN_ROWS`` positions on the Gemma rotary embedding's cos and sin are one op per table. The pointwise
    layers (T5, ModernBERT) and the norms run the host's math there, and so does GeGLUMLP where its fused path
    cannot run (here: fp32 on CPU), all of which Inductor fuses (tests/kernel/test_fused_mlp.py checks the MLP op
    where the fused path may run). (In a fresh process: building the models registers the kernel mapping and points
    LOCAL_KERNELS at the build.)"""
    import collections

    res = _compiled(build_dir)
    for name in _COMPILED_MODELS:  # 2 x 24 positions: the host's ops in the host's order (Inductor schedules by it)
        assert res[name]["kernelized"]["ops"] == res[name]["eager"]["ops"], name
    long = res["gemma3-4b"]["long"]  # 1 x 2048 positions
    host, ours = collections.Counter(long["eager"]["ops"]), collections.Counter(long["kernelized"]["ops"])
    mine = {op.split(".")[-2]: n for op, n in ours.items() if "_geglu_" in op}  # ns.name.default
    ropes = mine.pop("rope_cos_sin", 0)
    assert mine == {} and ropes >= 1, (mine, ropes)
    # each rotary table's position product, cat and two scalings (cos and sin are methods, not functions) are what
    # the RoPE op replaced, whose pair of outputs adds a getitem
    added = set(ours - host) - {op for op in ours if "_geglu_" in op}
    assert sum((host - ours).values()) == 4 * ropes and added == {"<built-in function getitem>"}, \
        (host - ours, ours - host)


def test_layers_add_no_python_guard_per_module_under_compile(build_dir):
    """Dynamo evaluates some guards in Python on every call of a compiled model; a host-bound compiled model (T5
    v1.1 base's prefill on the H200) pays each of them. kernelize binds a forward to every module it maps (kernels'
    ``_replace_forward``), and Dynamo checks each bound method's ``__self__`` in Python: one guard per bound module.
    Under Mode.TORCH_COMPILE only the layers whose graph is not the host's are mapped (the MLP with its fused op,
    the rotary embeddings): T5 and ModernBERT keep every forward, so their guards are the host's; the Gemma model
    binds only those. Our layers' code adds no guard per module beyond that, only a fixed few for the package's
    own module globals."""
    import re

    def names(guards):  # Dynamo names the constants it guards after their id and a per-process counter
        return [re.sub(r"\b_\d+_c\d+\b", "_const", g) for g in guards]

    res = _compiled(build_dir)
    for name in _COMPILED_MODELS:
        host, ours = names(res[name]["eager"]["python_guards"]), names(res[name]["kernelized"]["python_guards"])
        assert res[name]["eager"]["bound"] == 0, name
        bound = [g for g in ours if g.endswith(".forward.__self__")]
        if name != "gemma3-4b":
            assert res[name]["kernelized"]["bound"] == 0 and ours == host, (name, ours, host)
            continue
        assert set(res[name]["kernelized"]["bound_classes"]) == {"Gemma3MLP", "Gemma3RotaryEmbedding"}, res[name]
        # (at most one per bound module: the activations of the fused MLP op are bound but never called)
        assert 0 < len(bound) <= res[name]["kernelized"]["bound"], (name, bound)
        per_module = [g for g in ours if g not in bound and g not in host and "L['" in g]
        assert not per_module, (name, per_module)
        globals_ = [g for g in ours if g not in bound and g not in host]
        assert len(globals_) <= 12 and all(re.match(r"G\[", g) for g in globals_), (name, globals_)


def test_merge_and_partial_reports(tmp_path):
    """--merge keeps each run's commit with its model; a partial result (a run stopped half-way) says so."""
    from kerneltools.bench import model as bm

    meta = dict(card="H200", date="2026-12-01", commit="a1", torch="2.11", triton="3.6", cuda="13.0",
                transformers="5.22.2", kernels="0.17.2")
    row = dict(part="prefill", tokens=8, modes={"eager": dict(ms=2.0, tokens_per_s=4000.0, vs_eager=[1.0, 1.0, 1.0],
                                                               vs_compile=None, first_call_s=0.1, peak_mib=None)})
    model = dict(model="m1", source="s", kind="causal", dtype="bfloat16", layers=2, rows=[row])
    for i, commit in enumerate(("a1", "b2")):
        run = dict(meta=dict(meta, commit=commit), device="cuda", rounds=3 + i, reps=2, backend="inductor",
                   models=[dict(model, model=f"m{i + 1}")])
        bm.write(run, tmp_path / commit)
    merged = bm.merge([tmp_path / "a1" / "model.json", tmp_path / "b2" / "model.json"])
    assert [(m["model"], m["run"]["meta"]["commit"]) for m in merged["models"]] == [("m1", "a1"), ("m2", "b2")]
    md = bm.to_markdown(merged)
    assert "Commit b2, 2026-12-01, 4 rounds of 2 calls." in md and "Commit a1" not in md
    assert "**Partial:**" in bm.to_markdown(dict(merged, partial=True)) and "**Partial:**" not in md
    # a merge of a merge keeps every model's own run
    bm.write(merged, tmp_path / "m")
    again = bm.merge([tmp_path / "m" / "model.json", tmp_path / "b2" / "model.json"])
    assert [(m["model"], m["run"]["meta"]["commit"]) for m in again["models"]] == [("m1", "a1"), ("m2", "b2"),
                                                                                   ("m2", "b2")]


def test_results_record_the_package_settings_they_ran_with(monkeypatch, tmp_path):
    """A run with a package setting changed in the environment (GEGLU_FUSED_MLP=0) records it in its metadata,
    and the model report names it for that run, merged or not; where things are (GEGLU_BUILD_DIR, GEGLU_COMMIT) is
    not a setting."""
    import torch

    from kerneltools.bench import model as bm
    from kerneltools.bench.common import meta

    monkeypatch.setenv("GEGLU_BUILD_DIR", "/tmp/b")
    plain_meta = meta(torch)
    monkeypatch.setenv("GEGLU_FUSED_MLP", "0")
    set_meta = meta(torch)
    assert "settings" not in plain_meta and set_meta["settings"] == {"GEGLU_FUSED_MLP": "0"}
    row = dict(part="train", tokens=8, modes={"eager": dict(ms=2.0, tokens_per_s=4000.0, vs_eager=[1.0, 1.0, 1.0],
                                                             vs_compile=None, first_call_s=0.1, peak_mib=None)})
    paths = []
    for name, m in (("m1", plain_meta), ("m2", set_meta)):
        run = dict(meta=m, device="cuda", rounds=3, reps=2, backend="inductor",
                   models=[dict(model=name, source="s", kind="causal", dtype="bfloat16", layers=2, rows=[row])])
        bm.write(run, tmp_path / name)
        paths.append(tmp_path / name / "model.json")
    assert "`inductor`, with GEGLU_FUSED_MLP=0." in (tmp_path / "m2" / "model.md").read_text()
    md = bm.to_markdown(bm.merge(paths))
    assert md.count("GEGLU_FUSED_MLP=0") == 1 and "Settings: GEGLU_FUSED_MLP=0." in md


def test_profile_categories_and_gpu_time_report():
    """Kernel names as the H200 profile lists them land in their categories: cuDNN's attention (named ..._sm90_...
    like a GEMM), Inductor's kernels that name our op among the ops they fuse (a norm, not ours), our kernels and
    cuBLAS's; a row's profile is reported as GPU time by category with the GPU-time ratios."""
    from kerneltools.bench.model.profiling import _category
    from kerneltools.bench.model.report import _gpu_time

    assert _category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x256") == "attention"
    assert _category("triton_red_fused__to_copy__unsafe_view_add_geglu_mlp_mean_mul_pow_rsqrt_11") == \
        "reduction / norm"
    assert _category("triton_poi_fused__unsafe_view_gelu_mul_8") == "pointwise"
    assert _category("_paired_gate_up_geglu_kernel") == "geglu (ours)"
    assert _category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    prof = {mode: dict(gpu_ms=ms, idle_ms=1.0, categories={"gemm": ms - 1, "pointwise": 1.0}, top=[])
            for mode, ms in (("eager", 150.0), ("compile", 100.0), ("kernelized+compile", 95.0))}
    lines = _gpu_time(dict(part="prefill", profile=prof))
    assert "| compile | 100.0 | 1.0 | – | – | gemm 99.0, pointwise 1.0 |" in lines
    assert lines[-1] == "GPU time: kernelized+compile / compile 0.950."
    assert _gpu_time(dict(part="prefill")) == []


def test_gpu_time_leaves_out_the_optimizers_annotation():
    """torch.profiler lists a ``record_function`` range (the optimizer's ``Optimizer.step#AdamW.step``) among the
    CUDA events, spanning its kernels: the profiler skips it, and the report takes it out of profiles recorded with
    it (when it is among their largest entries), from the total, its category and the GPU-time ratio."""
    from types import SimpleNamespace

    from kerneltools.bench.model.profiling import is_annotation
    from kerneltools.bench.model.report import _gpu_ratio, _gpu_time, kernel_time

    assert is_annotation("Optimizer.step#AdamW.step")
    assert is_annotation("zero_grad", SimpleNamespace(is_user_annotation=True))
    # kernel names hold '#' too: PyTorch's lambda kernels
    lam = "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(...)::{lambda()#1}>"
    assert not is_annotation(lam) and not is_annotation(lam, SimpleNamespace(is_user_annotation=False))
    prof = {"compile": dict(gpu_ms=160.0, idle_ms=1.0, categories={"gemm": 70.0, "optimizer": 90.0},
                            top=[["Optimizer.step#AdamW.step", 30.0], ["nvjet_sm90_tst", 20.0], [lam, 5.0]]),
            "kernelized+compile": dict(gpu_ms=150.0, idle_ms=1.0, categories={"gemm": 90.0, "optimizer": 60.0},
                                       top=[["nvjet_sm90_tst", 20.0]])}
    k = kernel_time(prof["compile"])
    assert (k["gpu_ms"], k["categories"], k["top"]) == (130.0, {"gemm": 70.0, "optimizer": 60.0},
                                                        [("nvjet_sm90_tst", 20.0), (lam, 5.0)])
    assert kernel_time(prof["kernelized+compile"]) is prof["kernelized+compile"]
    row = dict(part="train", profile=prof)
    assert abs(_gpu_ratio(row, "kernelized+compile", "compile") - 150.0 / 130.0) < 1e-12
    assert "| compile | 130.0 | 1.0 | – | – | gemm 70.0, optimizer 60.0 |" in _gpu_time(row)


def _summary_row(kern, copy, gpu_kern, gpu_host=100.0):
    """A prefill row whose kernelized+compile / compile and copy+compile / compile are ``kern`` and ``copy``
    (median, min, max) and whose profiled GPU times are ``gpu_kern`` against ``gpu_host`` ms."""
    prof = {mode: dict(gpu_ms=ms, idle_ms=1.0, categories={"gemm": ms}, top=[])
            for mode, ms in (("compile", gpu_host), ("kernelized+compile", gpu_kern))}
    return dict(part="prefill", profile=prof, modes={
        "eager": dict(vs_eager=[1.0, 1.0, 1.0]), "compile": dict(vs_compile=[1.0, 1.0, 1.0]),
        "kernelized+compile": dict(vs_compile=kern), "copy+compile": dict(vs_compile=copy)})


def test_never_slower_verdict_and_summary_columns():
    """The summary's verdict: at most 1.00 of the host is "yes"; above it, "A/A" only when the unkernelized copy
    measured as far from the host in the same rounds and the GPU time is no more than the host's; else "no"."""
    from kerneltools.bench.model.report import never_slower, summary_markdown

    assert never_slower(_summary_row([0.99, 0.97, 1.02], [1.0, 0.98, 1.01], 96.0), "kernelized+compile") == "yes"
    assert never_slower(_summary_row([1.01, 0.99, 1.03], [1.0, 0.97, 1.02], 98.0), "kernelized+compile") == "A/A"
    assert never_slower(_summary_row([1.03, 1.02, 1.04], [1.0, 0.97, 1.02], 98.0), "kernelized+compile") == "no"
    assert never_slower(_summary_row([1.01, 0.99, 1.03], [1.0, 0.97, 1.02], 101.0), "kernelized+compile") == "no"
    assert never_slower(_summary_row([1.01, 0.99, 1.03], [1.0, 0.97, 1.02], 98.0), "kernelized") == "–"
    result = dict(meta=dict(commit="abc1234"), models=[dict(
        model="m", rows=[_summary_row([1.01, 0.99, 1.03], [1.0, 0.97, 1.02], 98.0)],
        run=dict(meta=dict(commit="def5678")))])
    head, _, row = summary_markdown(result).splitlines()
    assert head.split(" | ")[6:10] == ["kernelized+compile / compile", "copy+compile / compile", "GPU time",
                                      "<= host"]
    assert row.split(" | ")[6:10] == ["1.010 [0.990, 1.030]", "1.000 [0.970, 1.020]", "0.980", "A/A"]
    assert row.endswith("| def5678 |")


def test_summary_has_the_peak_memory_ratio_where_peaks_were_measured():
    """GPU runs record each mode's peak memory: the summary gives the kernelized model's over its host's beside
    the time; CPU runs (no peaks) have no such column."""
    from kerneltools.bench.model.report import peak_ratio, summary_markdown

    row = _summary_row([0.99, 0.97, 1.02], [1.0, 0.98, 1.01], 96.0)
    row["modes"]["compile"]["peak_mib"], row["modes"]["kernelized+compile"]["peak_mib"] = 800.0, 760.0
    assert peak_ratio(row, "kernelized+compile", "compile") == 0.95
    assert peak_ratio(row, "kernelized", "eager") is None
    result = dict(meta=dict(commit="abc1234"), models=[dict(model="m", rows=[row])])
    head, _, line = summary_markdown(result).splitlines()
    cols, cells = head.split(" | "), line.split(" | ")
    assert cells[cols.index("peak memory", 6)] == "0.950"
    del row["modes"]["compile"]["peak_mib"], row["modes"]["kernelized+compile"]["peak_mib"]
    assert "peak memory" not in summary_markdown(result)


def test_peak_memory_is_what_the_call_requested_beside_what_the_allocator_gave(monkeypatch):
    """A call's peak is measured above what was live before it, twice: as requested by the tensors (the ratios use
    it: the caching allocator may hand out a cached block up to 1 MiB larger than asked for, depending on what the
    process ran before) and as allocated; the report shows both, and an older result's single figure as the
    allocator's."""
    import torch

    from kerneltools.bench.model import rounds
    from kerneltools.bench.model.report import _peak_cell

    stats = {"requested_bytes.all.current": 100 << 20, "allocated_bytes.all.current": 110 << 20,
             "requested_bytes.all.peak": 100 << 20, "allocated_bytes.all.peak": 110 << 20}

    def call(m):
        stats["requested_bytes.all.peak"] = 612 << 20  # 512 MiB more at the peak, as asked for
        stats["allocated_bytes.all.peak"] = 650 << 20  # 540 MiB more in the allocator's blocks

    for name, fn in (("synchronize", lambda: None), ("reset_peak_memory_stats", lambda: None),
                     ("memory_stats", lambda: dict(stats))):
        monkeypatch.setattr(torch.cuda, name, fn)
    on = type("Setup", (), {"device": "cuda"})()
    off = type("Setup", (), {"device": "cpu"})()
    assert rounds._peak_mib(on, call, None) == (512.0, 540.0)
    assert rounds._peak_mib(off, call, None) == (None, None)
    assert _peak_cell(dict(peak_mib=512.0, peak_alloc_mib=540.0)) == "512.0 / 540.0"
    assert _peak_cell(dict(peak_mib=540.0)) == "– / 540.0"
    assert _peak_cell(dict(peak_mib=None, peak_alloc_mib=None)) == "– / –"


def test_serve_part_times_batch_1_prompt_lengths_through_one_dynamic_graph(build_dir, tmp_path):
    """--parts serve: a row per prompt length (batch 1) and a short batch-1 decode through the model's forward; the
    compile modes' forwards are made dynamic before the first row, so that its first call compiles nothing."""
    res, md = _bench(build_dir, tmp_path, "--model", "gemma3-4b", "--parts", "serve", "--serve-lengths", "6,11",
                     "--modes", "eager,kernelized,compile,kernelized+compile", "--new-tokens", "2",
                     "--graph-lengths", "")
    rows = res["models"][0]["rows"]
    assert [r["part"] for r in rows] == ["serve 6", "serve 11", "serve decode"]
    assert [r["tokens"] for r in rows] == [6, 11, 2]
    for mode in ("compile", "kernelized+compile"):
        assert rows[0]["modes"][mode]["new_graphs"] == 0, (mode, rows[0]["modes"][mode])
    for r in rows:
        assert r["modes"]["eager"]["vs_eager"] == [1.0, 1.0, 1.0] and r["modes"]["compile"]["vs_compile"]
    assert "| serve 11 | kernelized+compile |" in md and "| gemma3-4b | serve decode |" in md


def test_serve_without_its_decode_ends_after_the_prefill_rows(build_dir, tmp_path):
    res, md = _bench(build_dir, tmp_path, "--model", "gemma3-4b", "--parts", "serve", "--serve-lengths", "7",
                     "--modes", "eager,kernelized", "--no-serve-decode", "--graph-lengths", "")
    rows = res["models"][0]["rows"]
    assert [r["part"] for r in rows] == ["serve 7"] and set(rows[0]["modes"]) == {"eager", "kernelized"}
    assert "| serve 7 | kernelized |" in md and "| serve decode |" not in md


def test_bad_serve_lengths_are_named(build_dir, tmp_path):
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "gemma3-4b", "--parts", "serve",
                      "--serve-lengths", "64,x")
    assert proc.returncode != 0 and "--serve-lengths '64,x': expected comma-separated integers" in proc.stderr


def test_each_compiled_model_has_its_own_frame_cache():
    """Two models of one class compiled through ``own_code`` keep their compiled frames apart (one cache entry per
    code object, none on the class's shared forward), so neither call evaluates the other model's guards; the
    copy computes what the method computes. Compiled straight from the shared method, both entries land on one
    code object."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from kerneltools.bench.model import own_code

    class Toy(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x, *, bias=1.0):
            return x * self.scale + bias

    torch._dynamo.reset()
    a, b, x = Toy(2), Toy(3), torch.arange(4.0)  # int attributes: Dynamo specialises on them
    fa, fb = own_code(a.forward), own_code(b.forward)
    assert fa.__func__.__code__ is not Toy.forward.__code__ and fa.__self__ is a and fa.__qualname__ == Toy.forward.__qualname__
    ca, cb = torch.compile(fa, backend="eager"), torch.compile(fb, backend="eager")
    assert torch.equal(ca(x), a(x)) and torch.equal(cb(x, bias=0.5), b(x, bias=0.5))
    assert [len(_debug_get_cache_entry_list(f.__func__.__code__)) for f in (fa, fb)] == [1, 1]
    # a tag names the copy's code (Dynamo's record of changing sizes is kept per file, line and name)
    tagged = own_code(a.forward, "copy")
    assert tagged.__func__.__code__.co_name == "forward_copy" and fa.__func__.__code__.co_name == "forward"
    assert torch.equal(tagged(x), a(x))
    assert len(_debug_get_cache_entry_list(Toy.forward.__code__)) == 0
    shared_a, shared_b = torch.compile(a.forward, backend="eager"), torch.compile(b.forward, backend="eager")
    shared_a(x), shared_b(x)
    assert len(_debug_get_cache_entry_list(Toy.forward.__code__)) == 2
    torch._dynamo.reset()


def test_prefill_fills_a_cache_made_before_the_call_as_generate_does():
    """Prefill passes an empty cache of its own to every call (generate's first step; a cache made inside the
    forward breaks the graph on torch 2.11), and the logits are the ones the model computes with the cache it makes
    itself, bit for bit."""
    from types import SimpleNamespace

    import torch
    import transformers
    from transformers import DynamicCache, EncoderDecoderCache

    from kerneltools.bench import model as bm
    from kerneltools.bench.common import cache_arg

    for name, cache_type in (("t5-v1.1-base", EncoderDecoderCache), ("gemma3-4b", DynamicCache)):
        spec = bm.MODELS[name]
        torch.manual_seed(0)
        m = getattr(transformers, spec.auto_class).from_config(spec.config(True)).eval()
        s = SimpleNamespace(spec=spec)
        ids = torch.randint(3, m.config.vocab_size, (2, 9))
        dec = torch.zeros(2, 1, dtype=torch.long)
        first, second = bm.prefill_kwargs(s, m, ids, dec), bm.prefill_kwargs(s, m, ids, dec)
        key = cache_arg(m)  # "cache" from transformers 5.25, "past_key_values" before
        assert type(first[key]) is cache_type and first[key] is not second[key], name
        assert first[key].get_seq_length() == 0
        own = dict(first, **{key: None})
        with torch.no_grad():
            got = m(**first).logits
            want = m(**own).logits
        assert first[key].get_seq_length() == (1 if name.startswith("t5") else 9), name
        assert torch.equal(got, want), name


def _upper_median_spread(rs):
    """kerneltools' median (the upper middle value) with min and max, to three places: the report's cell."""
    return [round(sorted(rs)[len(rs) // 2], 3), round(min(rs), 3), round(max(rs), 3)]


def test_processes_pool_their_rounds_and_rotate_the_first_calls(build_dir, tmp_path):
    """--processes 2 runs the benchmark in two fresh processes, the second with its first calls (which model
    compiles first) and rounds rotated by one place, keeps each process's report, and reports every round of
    both: the pooled ratios are the spread of all the rounds, with each process's median beside them."""
    out = tmp_path / "out"
    proc = _run_bench(build_dir, out, "--model", "t5-v1.1-base", "--parts", "prefill",
                      "--modes", "eager,kernelized,copy", "--rounds", "3", "--graph-lengths", "", "--processes", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    firsts = [line.split(" prefill ")[1].split(":")[0] for line in proc.stdout.splitlines() if "first call" in line]
    assert firsts == ["eager", "kernelized", "copy", "kernelized", "copy", "eager"], proc.stdout
    runs = [json.loads((out / f"process-{i}" / "model.json").read_text()) for i in range(2)]
    pooled = json.loads((out / "model.json").read_text())
    assert pooled["processes"] == 2 and not pooled["partial"]
    rows = [r["models"][0]["rows"][0]["modes"] for r in runs]
    for mode, v in pooled["models"][0]["rows"][0]["modes"].items():
        rounds = rows[0][mode]["vs_eager_rounds"] + rows[1][mode]["vs_eager_rounds"]
        assert len(rounds) == 6 and v["vs_eager_rounds"] == rounds
        assert v["vs_eager"] == _upper_median_spread(rounds)
        assert v["vs_eager_processes"] == [rows[0][mode]["vs_eager"][0], rows[1][mode]["vs_eager"][0]]
        assert v["ms"] == max(rows[0][mode]["ms"], rows[1][mode]["ms"])  # the upper median of two
    md = (out / "model.md").read_text()
    assert "in each of 2 processes" in md and "Each process's median ratio" in md
    assert [r["offset"] for r in runs] == [0, 1] and pooled["offsets"] == [0, 1]
    # the kernelized model against the copy, round by round over both processes
    modes = pooled["models"][0]["rows"][0]["modes"]
    vs_copy = [k / c for k, c in zip(modes["kernelized"]["vs_eager_rounds"], modes["copy"]["vs_eager_rounds"])]
    want = "[{:.3f}, {:.3f}]".format(*_upper_median_spread(vs_copy)[1:])
    line = next(x for x in md.splitlines() if x.startswith("Kernelized against the unkernelized copy"))
    assert f"prefill: kernelized / copy {_upper_median_spread(vs_copy)[0]:.3f} {want}" in line, line
    # --pool of the two reports (runs made apart, e.g. one per device call) gives the same pooled result
    again = _run_bench(build_dir, tmp_path / "again", "--pool", *(str(out / f"process-{i}" / "model.json")
                                                                  for i in range(2)))
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "model.json").read_text())["models"] == pooled["models"]
    assert "in each of 2 processes" in (tmp_path / "again" / "model.md").read_text()


def test_pool_leaves_out_parts_a_process_did_not_reach():
    """A process that stopped early (its report partial) leaves the pooled report without the parts it lacks,
    marked partial; processes that timed different modes are refused by name."""
    import random

    import pytest

    from kerneltools.bench import model as bm

    rng = random.Random(7)

    def row(part, modes=("eager", "kernelized")):
        rs = {mo: [1.0] * 3 if mo == "eager" else [round(rng.uniform(0.6, 1.2), 4) for _ in range(3)]
              for mo in modes}
        return dict(part=part, tokens=8, modes={mo: dict(ms=rng.uniform(1, 3), tokens_per_s=1.0, first_call_s=0.1,
                                                          peak_mib=None, new_graphs=0, vs_eager=_upper_median_spread(r),
                                                          vs_eager_rounds=r, vs_compile=None, vs_compile_rounds=None)
                                                for mo, r in rs.items()})

    def result(rows, partial=False):
        return dict(meta={}, device="cpu", rounds=3, reps=1, backend="inductor", partial=partial,
                    models=[dict(model="m", source="s", kind="causal", dtype="float32", layers=2, rows=rows)])

    full = result([row("prefill"), row("train")])
    cut = result([row("prefill")], partial=True)
    pooled = bm.pool([full, cut])
    assert pooled["partial"] and [r["part"] for r in pooled["models"][0]["rows"]] == ["prefill"]
    k = pooled["models"][0]["rows"][0]["modes"]["kernelized"]
    rounds = full["models"][0]["rows"][0]["modes"]["kernelized"]["vs_eager_rounds"] + \
        cut["models"][0]["rows"][0]["modes"]["kernelized"]["vs_eager_rounds"]
    assert k["vs_eager"] == _upper_median_spread(rounds) and k["vs_compile"] is None
    with pytest.raises(ValueError, match="cannot pool m prefill"):
        bm.pool([full, result([row("prefill", ("eager", "copy")), row("train")])])
    other = result([row("prefill")])
    other["models"][0]["model"] = "n"
    with pytest.raises(ValueError, match="cannot pool runs of different models"):
        bm.pool([full, other])
    with pytest.raises(ValueError, match="give each run a different --offset"):
        bm.pool([dict(full, offset=1), dict(cut, offset=1)])


def test_bad_pool_is_named(build_dir, tmp_path):
    """--pool refuses runs that compiled the modes in the same order, and --merge with --pool, by name."""
    a = dict(meta={}, device="cpu", rounds=1, reps=1, backend="inductor", offset=0, models=[])
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(a))
    proc = _run_bench(build_dir, tmp_path / "out", "--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode != 0 and "--pool: the runs have the same --offset ([0, 0])" in proc.stderr
    proc = _run_bench(build_dir, tmp_path / "out", "--pool", str(tmp_path / "a.json"),
                      "--merge", str(tmp_path / "b.json"))
    assert proc.returncode != 0 and "--merge and --pool each write a report: give one of them" in proc.stderr
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "t5-v1.1-base", "--offset", "-1")
    assert proc.returncode != 0 and "--offset -1: expected 0 or more" in proc.stderr


def test_bad_processes_are_named(build_dir, tmp_path):
    proc = _run_bench(build_dir, tmp_path / "out", "--model", "t5-v1.1-base", "--processes", "0")
    assert proc.returncode != 0 and "--processes 0: expected at least 1" in proc.stderr


def test_processes_start_from_the_given_offset(tmp_path, monkeypatch):
    """--processes N --offset K gives process i the offset K + i (a second device call's processes then rotate
    differently from the first's, and --pool takes both); each child runs one process in its own report folder."""
    import argparse
    import multiprocessing

    from kerneltools.bench.model import processes

    seen = []

    def child(args):
        seen.append((args.processes, args.offset, args.profile))
        args.out.mkdir(parents=True)
        row = dict(part="prefill", tokens=8, modes={mo: dict(ms=1.0, tokens_per_s=8.0, first_call_s=0.1, peak_mib=1,
                                                               new_graphs=0, vs_eager=[1.0, 1.0, 1.0],
                                                               vs_eager_rounds=[1.0], vs_compile=None,
                                                               vs_compile_rounds=None)
                                                   for mo in ("eager", "kernelized")})
        (args.out / "model.json").write_text(json.dumps(dict(meta=dict(commit="x"), offset=args.offset,
                                                             models=[dict(model="m", rows=[row])])))

    class Inline:  # a spawned process, run in this one
        def __init__(self, target, args):
            self.target, self.args, self.exitcode = target, args, None

        def start(self):
            self.target(*self.args)
            self.exitcode = 0

        def join(self):
            pass

    monkeypatch.setattr(processes, "_run_child", child)
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: argparse.Namespace(Process=Inline))
    monkeypatch.setattr(processes, "write", lambda result, base: None)
    args = argparse.Namespace(processes=3, offset=4, out=tmp_path, profile=True, graph_lengths="1", call_cost=0)
    pooled = processes.run_processes(args, log=lambda *a: None)
    assert seen == [(1, 4, True), (1, 5, False), (1, 6, False)]
    assert pooled["offsets"] == [4, 5, 6] and pooled["processes"] == 3
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["process-0", "process-1", "process-2"]
