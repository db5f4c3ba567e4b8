"""The kernel on torch.distributed: DTensor sharding rules of the ops (_sharding.py), transformers' tensor
parallelism (tp_plan="auto"), parallelize_module on families without a plan, and FSDP2 training with the training
node, with and without torch.compile.

Two ranks on CPU (gloo over loopback, FileStore rendezvous) run distributed_worker.py, which loads the kernel from
the build tree and reports JSON; the assertions are here. Every check also proves where the kernel ran: the local
shapes its CPU implementation was called with (a sharded dim shows up halved), and for the op checks the ops the
profiler saw on the local shards.

Numerics (fp32). Bit-exact (torch.equal) wherever the sharded computation does the reference's arithmetic: every
pointwise and packed rule, and TP against the same TP model unkernelized, and FSDP2 with the same batch on every rank.
Otherwise a reduction is ordered differently and the normwise bound ``max|a - b| <= RTOL * max|b|`` holds per tensor:
- TP against the unsharded model: the row-parallel projections' all-reduce sums partial products (observed 5e-7 on
  logits, 1.1e-6 on gradients);
- FSDP2 with each rank its own slice of the batch: the gradient reduce-scatter (observed 3e-7);
- Partial inputs (the ops linear in up / grad): the op runs on each rank's part and the parts are summed after it,
  instead of before: PARTIAL_RTOL (a few fp32 ulp of the largest value; observed 1.2e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("distributed_worker.py")
WORLD = 2
TIMEOUT = 600
RTOL = 1e-5
PARTIAL_RTOL = 8 * torch.finfo(torch.float32).eps
OPS = ("geglu", "geglu_out", "geglu_backward", "geglu_backward_", "geglu_packed", "geglu_packed_backward",
       "geglu_packed_backward_")


def _run(build_dir: Path, out_dir: Path, groups: str) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    store = out_dir / "store"
    procs = []
    for rank in range(WORLD):
        log = open(out_dir / f"rank{rank}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD), str(store),
                                        str(build_dir), str(out_dir), groups],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        if rc != 0 or not (out_dir / f"rank{rank}.json").is_file():
            failed.append(f"rank {rank} (exit {rc}):\n" + (out_dir / f"rank{rank}.log").read_text(errors="replace")[-6000:])
    if failed:
        raise AssertionError("distributed worker failed: " + "\n".join(failed))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reports(build_dir, tmp_path_factory):
    return _run(build_dir, tmp_path_factory.mktemp("dist"), "ops,tp,fsdp")


@pytest.fixture(scope="module")
def compile_reports(build_dir, tmp_path_factory):
    return _run(build_dir, tmp_path_factory.mktemp("dist_compile"), "fsdp_compile")


def case(reports, name: str, rank: int = 0) -> dict:
    res = reports[rank][name]
    assert "error" not in res, f"{name} on rank {rank}: {res.get('traceback', res['error'])}"
    return res


def assert_within(d: dict, rtol: float, what: str) -> None:
    assert d["max_abs"] <= rtol * d["max_ref"], f"{what}: max|delta| {d['max_abs']:.3g} > {rtol:g} * {d['max_ref']:.3g}"


def op_names(res: dict) -> set:
    return {name for name, _ in res["ops"]}


def shapes(res: dict, op: str) -> list:
    """The shapes of the first input of each call of ``op`` the profiler saw (the DTensor call's global shape and
    the local call's shard shape)."""
    return sorted(shape for name, shape in res["ops"] if name == op)


# --- the sharding rules ------------------------------------------------------------------------------------------

M, D = 6, 64
LOCAL = {"R": [M, D], "S0": [M // 2, D], "S1": [M, D // 2]}
PLACEMENT = {"R": "R", "S0": "S(0)", "S1": "S(1)"}


def test_rules_registered_for_every_op(reports):
    for r in reports:
        assert r["sharding_available"] is True
        assert sorted(r["registered"]) == sorted(OPS)


def test_every_rule_was_exercised_on_local_shards(reports):
    seen = set()
    for name, res in reports[0].items():
        if isinstance(res, dict) and "ops" in res:
            seen |= op_names(res)
    assert seen >= set(OPS)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("place,grad_same", [("R", True), ("S0", True), ("S0", False), ("S1", True), ("S1", False)])
@pytest.mark.parametrize("inplace", [False, True])
def test_split_rule(reports, approximate, place, inplace, grad_same):
    """gate and up with one placement (Shard on any dim, the last one too) give that placement out, bit for bit;
    the backward runs in place only where grad has the same placement (DTensor cannot move a written tensor);
    otherwise (grad replicated) out of place."""
    grad = PLACEMENT[place] if grad_same else "R"
    for rank in range(WORLD):
        res = case(reports, f"split/{approximate}/{place}/inplace={inplace}/grad={grad}", rank)
        assert res["out_placements"] == [PLACEMENT[place]] and res["grad_placements"] == [PLACEMENT[place]]
        for k in ("out", "d_gate", "d_up"):
            assert res[k]["equal"], (k, res[k])
        assert res["calls"] == {"fwd": [LOCAL[place]], "bwd": [LOCAL[place]]}
        backward = "geglu_backward_" if inplace and grad_same else "geglu_backward"
        assert op_names(res) == {"geglu", backward}
        assert LOCAL[place] in shapes(res, "geglu") and LOCAL[place] in shapes(res, backward)


@pytest.mark.parametrize("place", ["R", "S0", "S1"])
def test_out_rule_keeps_out_in_place(reports, place):
    """out= keeps its placement (the result is written into it); gate and up are redistributed to it."""
    for rank in range(WORLD):
        res = case(reports, f"out/{place}", rank)
        assert res["same_object"] and res["out_placements"] == [PLACEMENT[place]]
        assert res["out"]["equal"]
        assert res["calls"]["fwd"] == [LOCAL[place]] and LOCAL[place] in shapes(res, "geglu_out")


@pytest.mark.parametrize("name,outputs,op", [("partial/forward", ["out"], "geglu"),
                                             ("partial/backward", ["d_gate", "d_up"], "geglu_backward"),
                                             ("partial/packed_backward", ["dx"], "geglu_packed_backward")])
def test_partial_rule_for_the_linear_input(reports, name, outputs, op):
    """Partial up (forward) or grad (backward) with the rest replicated: the op runs on each rank's part and the
    result stays Partial (no all-reduce before it)."""
    res = case(reports, name)
    assert set(res["out_placements"]) == {"P(sum)"}
    for k in outputs:
        assert_within(res[k], PARTIAL_RTOL, f"{name} {k}")
    assert op_names(res) == {op}
    assert [M, D] in shapes(res, op)  # the first input (up's partner gate, or grad): unsharded, one call per rank


PACKED_LOCAL = {"R": [M, 2 * D], "S0": [M // 2, 2 * D], "SS1": [M, D], "S1": [M, 2 * D]}
PACKED_OUT = {"R": "R", "S0": "S(0)", "SS1": "S(1)", "S1": "R"}
PACKED_X = {"R": "R", "S0": "S(0)", "SS1": "_S(1, 2)", "S1": "R"}


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("place", ["R", "S0", "SS1", "S1"])
@pytest.mark.parametrize("inplace", [False, True])
def test_packed_rule(reports, act_first, place, inplace):
    """x[..., 2d]: Replicate, Shard on a leading dim, or _StridedShard(-1, split_factor=2) (each rank [gate_r |
    up_r]) giving Shard(-1) out, bit for bit. A plain Shard(-1) of x is not a rule (it would split the halves):
    DTensor gathers x first (the documented fallback), so the kernel runs on the whole [M, 2d] and the result is
    replicated and still exact."""
    for rank in range(WORLD):
        res = case(reports, f"packed/act_first={act_first}/{place}/inplace={inplace}", rank)
        assert res["out_placements"] == [PACKED_OUT[place]] and res["grad_placements"] == [PACKED_X[place]]
        assert res["out"]["equal"] and res["dx"]["equal"]
        half = [PACKED_LOCAL[place][0], PACKED_LOCAL[place][1] // 2]  # the kernel sees each half [rows, d_local]
        assert res["calls"] == {"fwd": [half], "bwd": [half]}
        assert PACKED_LOCAL[place] in shapes(res, "geglu_packed")
        # in place where DTensor can keep x where it is: replicated or a leading-dim shard with grad alike
        backward = "geglu_packed_backward_" if inplace and place in ("R", "S0") else "geglu_packed_backward"
        assert op_names(res) == {"geglu_packed", backward}


def test_packed_inplace_backward_direct(reports):
    res = case(reports, "packed/inplace_direct")
    assert res["dx"]["equal"] and res["dx_placements"] == ["S(0)"]
    assert [M // 2, D] in shapes(res, "geglu_packed_backward_")  # grad's local shard


def test_packed_inplace_backward_refuses_a_last_dim_shard(reports):
    err = reports[0]["packed/inplace_direct_last_dim"]["error"]
    assert err.startswith("NotImplementedError: geglu: geglu_packed_backward_ writes its result into an argument")
    assert "_StridedShard(-1, split_factor=2)" in err


def test_two_dim_mesh(reports):
    """Rules are per mesh dim; on a (1, 2) mesh with (Replicate, Shard(1)) the kernel runs on [M, D/2] shards. The
    layer's in-place backward falls back to the out-of-place op there (placements differ along the mesh dims)."""
    res = case(reports, "mesh2/split")
    assert res["out_placements"] == ["R", "S(1)"]
    assert res["out"]["equal"] and res["d_gate"]["equal"] and res["d_up"]["equal"]
    assert res["calls"] == {"fwd": [[M, D // 2]], "bwd": [[M, D // 2]]}
    assert op_names(res) == {"geglu", "geglu_backward"}


def test_inplace_op_refuses_mixed_placements_on_a_two_dim_mesh(reports):
    err = reports[0]["mesh2/inplace_direct"]["error"]
    assert err.startswith("NotImplementedError: geglu: geglu_backward_ writes its result into an argument, but on "
                          "this 2-dimensional mesh")
    assert "Use the out-of-place form" in err


# --- models under tensor parallelism -------------------------------------------------------------------------------

I_LOCAL = 32  # intermediate 64 over 2 ranks


def _assert_model(res: dict, key: str, rtol: float, training: bool, what: str) -> None:
    cmp = res[key]
    if rtol == 0:
        assert cmp["logits"]["equal"], (what, cmp["logits"])
    else:
        assert_within(cmp["logits"], rtol, f"{what} logits")
    if training:
        assert cmp["grads"] and not cmp["missing_grads"]
        for name, d in cmp["grads"].items():
            if rtol == 0:
                assert d["equal"], (what, name, d)
            else:
                assert_within(d, rtol, f"{what} grad {name}")


def _assert_local_calls(res: dict, n_mlps: int, training: bool) -> None:
    calls = res["calls"]
    assert len(calls["fwd"]) == n_mlps and len(calls["bwd"]) == (n_mlps if training else 0), calls
    assert all(shape[-1] == I_LOCAL for shape in calls["fwd"] + calls["bwd"]), calls


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_gemma3_tp_plan_auto(reports, training):
    """from_pretrained(..., tp_plan="auto") (DistributedConfig), kernelized: the projections keep their DTensor
    weights and the hooks that redistribute activations; the kernel runs on each rank's [.., I/2] shard. Equal bit
    for bit to the same TP model unkernelized; within RTOL of the unsharded model (the all-reduce order)."""
    for rank in range(WORLD):
        res = case(reports, f"gemma3/tp_plan_auto/{'training' if training else 'inference'}", rank)
        assert res["weight_type"] == "DTensor" and res["weight_placements"] == ["S(0)"]
        assert res["kernel_forward"] == "GeGLUMLP.forward"
        _assert_local_calls(res, 2, training)
        _assert_model(res, "vs_tp_eager", 0, training, "TP kernelized vs TP eager")
        _assert_model(res, "vs_unsharded", RTOL, training, "TP kernelized vs unsharded eager")


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_t5_parallelize_module(reports, training):
    """T5 v1.1 (gated-gelu; transformers has no plan): wi_0/wi_1 ColwiseParallel, wo RowwiseParallel. gelu_new
    hosts are within RTOL of eager anyway (docs/transformers.md)."""
    res = case(reports, f"t5/parallelize/{'training' if training else 'inference'}")
    _assert_local_calls(res, 4, training)
    _assert_model(res, "vs_unsharded", RTOL, training, "T5 TP kernelized vs unsharded eager")


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_modernbert_packed_wi_strided_colwise(reports, training):
    """ModernBERT's packed Wi [2I, D] sharded _StridedShard(0, split_factor=2): each rank holds [gate_r; up_r], its
    local output is a valid packed [g_r | u_r], and the model is right, kernelized or not."""
    res = case(reports, f"modernbert/strided/{'training' if training else 'inference'}")
    assert res["wi_placements"] == ["_S(0, 2)"]
    _assert_local_calls(res, 2, training)
    _assert_model(res, "vs_unsharded", RTOL, training, "ModernBERT strided TP kernelized vs unsharded")
    _assert_model(res, "tp_eager_vs_unsharded", RTOL, training, "ModernBERT strided TP eager vs unsharded")


def test_modernbert_naive_colwise_is_wrong_for_the_model(reports):
    """A plain Shard(0) of the packed Wi gives rank 0 the gate rows and rank 1 the up rows: each rank's chunk pairs
    gate with gate (or up with up). The model is wrong, with or without the kernel: the plan, not the kernel."""
    res = case(reports, "modernbert/naive/inference")
    assert res["wi_placements"] == ["S(0)"]
    for key in ("vs_unsharded", "tp_eager_vs_unsharded"):
        d = res[key]["logits"]
        assert d["max_abs"] > 100 * RTOL * d["max_ref"], (key, d)


# --- FSDP2 ---------------------------------------------------------------------------------------------------------


def _assert_fsdp(res: dict, data: str, compiled: bool = False) -> None:
    assert "error" not in res, res.get("traceback")
    for step in res["grads"]:
        for name, d in step.items():
            if data == "same" and not compiled:
                assert d["equal"], (name, d)
            else:  # a slice per rank, or Inductor's code for the MLP (not eager's bits)
                assert_within(d, RTOL, f"FSDP2 grad {name}")
    if compiled:  # a compiled training step traces the host's MLP ops: the kernel is not called
        assert not res["calls"].get("fwd") and not res["calls"].get("bwd"), res["calls"]
    else:  # two decoder layers, two steps: the kernel ran forward and backward in each
        assert len(res["calls"]["fwd"]) == 4 and len(res["calls"]["bwd"]) == 4


@pytest.mark.parametrize("data", ["same", "split"])
def test_fsdp2_training_node(reports, data):
    """fully_shard on each decoder layer and the root of a kernelized (Mode.TRAINING) tiny Gemma 3: inside the
    layers' forward the projections' weights are the unsharded plain parameters, so GeGLUMLP's training step runs as
    one autograd node. Two steps; gradients (gathered) against the unsharded eager model on the whole batch:
    bit for bit when every rank has the whole batch, within RTOL when each has its slice."""
    res = case(reports, f"fsdp/eager/{data}")
    assert res["nodes"] == ["GeGLUMLPFunctionBackward"] * 4
    _assert_fsdp(res, data)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["same", "split"])
def test_fsdp2_training_compiled(compile_reports, data):
    """The same with each MLP compiled (Mode.TRAINING | Mode.TORCH_COMPILE, fullgraph): the compiled step traces the
    host's MLP ops (no kernel call), and its gradients stay within RTOL of the unsharded eager model's."""
    _assert_fsdp(case(compile_reports, f"fsdp/compile/{data}"), data, compiled=True)


def test_package_imports_without_torch_distributed(build_dir, tmp_path):
    """_sharding is imported by the package's __init__; on a torch without torch.distributed it must only report
    AVAILABLE = False (and the ops work as before)."""
    code = (
        "import torch, pathlib, sys\n"
        "torch.distributed.is_available = lambda: False\n"
        "import kernels\n"
        "g = kernels.get_local_kernel(pathlib.Path(sys.argv[1]))\n"
        "assert g._sharding.AVAILABLE is False and g._sharding.REGISTERED == [], g._sharding.REGISTERED\n"
        "a, b = torch.randn(3, 8), torch.randn(3, 8)\n"
        "assert torch.equal(g.geglu(a, b), torch.nn.functional.gelu(a) * b)\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(build_dir)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


GPU_RULES = r"""
import json, pathlib, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.profiler import ProfilerActivity, profile
import kernels
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
torch.cuda.set_device(0)
g = kernels.get_local_kernel(pathlib.Path(sys.argv[1]))
mesh = init_device_mesh("cuda", (1,))
torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    a, b, dy = (torch.randn(512, 4096, device="cuda", dtype=dtype) for _ in range(3))
    x = torch.randn(512, 8192, device="cuda", dtype=dtype)
    for name, pl, fn, ref in (
            ("split", Shard(1), lambda t: g.geglu(t[0], t[1], "tanh", inplace_backward=True), None),
            ("packed", _StridedShard(1, split_factor=2), lambda t: g.geglu_packed(t[0], "none"), None)):
        ins = [distribute_tensor(t.clone(), mesh, [pl]).requires_grad_() for t in ((a, b) if name == "split" else (x,))]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            y = fn(ins)
            y.backward(distribute_tensor(dy, mesh, [y.placements[0]]))
            torch.cuda.synchronize()
        plain = [t.clone().requires_grad_() for t in ((a, b) if name == "split" else (x,))]
        if name == "split":
            ry = F.gelu(plain[0], approximate="tanh") * plain[1]
        else:
            ry = F.gelu(plain[0][:, :4096].contiguous()) * plain[0][:, 4096:].contiguous()
        ry.backward(dy)
        gpu = sorted({e.key for e in prof.key_averages() if "geglu" in e.key.lower() and e.device_time_total > 0})
        # one process: the local shard is the whole tensor (torch 2.11's full_tensor() cannot gather a _StridedShard)
        out[f"{name}/{dtype}"] = {"y": bool(torch.equal(y.to_local(), ry)),
                                  "grads": [bool(torch.equal(t.grad.to_local(), p.grad)) for t, p in zip(ins, plain)],
                                  "kernels": gpu}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_rules_on_one_gpu_mesh(build_dir):
    """The rules on CUDA DTensors (a 1-process NCCL mesh; whatever torch the GPU machine has): the split form sharded
    on the last dim and the packed form as _StridedShard, forward and backward, equal to eager (the packed form: eager
    on contiguous halves), with our kernels in the profile."""
    proc = subprocess.run([sys.executable, "-c", GPU_RULES, str(build_dir)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["y"] and all(r["grads"]), (name, r)
        assert r["kernels"], (name, r)
