"""The compiled CUDA ops against eager PyTorch, bit for bit, on a GPU.

Run on a CUDA machine after building the compiled variant (docs/cuda.md):

    python -m kerneltools build --variant cuda-compiled --capability 9.0
    python -m pytest tests/kernel/test_cuda_gpu.py -m gpu -q

The variant is loaded from $GEGLU_BUILD_DIR (default build/) with kernels.get_local_kernel, so the loader picks
it as it would for a user (when `kernels` is not installed there, the variant is imported the way kernels does
it). Everything is compared bitwise (int views: -0.0 != +0.0, NaN payloads count) with eager
`F.gelu(g, approximate=a) * u` and eager autograd, on fresh random data (randn * 3 reaches GELU's tails) and
NaN-poisoned outputs.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]
DS = [1, 7, 8, 127, 4096, 9216, 13824, 14336, 24576]
MS = [0, 1, 3, 16, 1024, 16384]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# --- loading ---------------------------------------------------------------------------------------------------

from kerneltools.cuda_ops import load_package  # noqa: E402  (kernels' loader, or the variant imported as it does)


@pytest.fixture(scope="module")
def package():
    """The package of the compiled variant (its ``configure`` sets the launch plan)."""
    try:
        return load_package(os.environ.get("GEGLU_BUILD_DIR", REPO / "build"))
    except SystemExit as e:  # no build, no compiled variant, or the loader chose another variant
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def ops(package):
    return importlib.import_module(package.__name__ + "._ops").ops


# --- helpers ---------------------------------------------------------------------------------------------------


def randn(*shape, dtype, device="cuda"):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * 3).to(dtype)


def nan_like(t):
    return torch.full_like(t, float("nan"))


def assert_bitwise(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.contiguous().view(INT_VIEW[actual.dtype])
    e = expected.contiguous().view(INT_VIEW[expected.dtype])
    bad = a != e
    if bad.any():
        n = int(bad.sum())
        idx = tuple(int(i) for i in bad.nonzero()[0])
        ulp = int((a.to(torch.int64) - e.to(torch.int64)).abs().max())
        pytest.fail(
            f"{what}: {n} of {a.numel()} elements differ from eager (first at {idx}: "
            f"{actual[idx].item()!r} vs {expected[idx].item()!r}; max {ulp} ulp)"
        )


def eager_fwd(g, u, approx):
    return F.gelu(g, approximate=approx) * u


def eager_bwd(dy, g, u, approx):
    g = g.detach().clone().requires_grad_(True)
    u = u.detach().clone().requires_grad_(True)
    (F.gelu(g, approximate=approx) * u).backward(dy)
    return g.grad, u.grad


def check_fwd(ops, out, g, u, approx, what=""):
    out.copy_(nan_like(out))
    ops.geglu_fwd(out, g, u, approx == "tanh")
    assert_bitwise(out, eager_fwd(g.contiguous(), u.contiguous(), approx), f"fwd {approx} {what}")


def check_bwd(ops, dg, du, dy, g, u, approx, what=""):
    ref_dg, ref_du = eager_bwd(dy.contiguous(), g.contiguous(), u.contiguous(), approx)
    dg.copy_(nan_like(dg))
    du.copy_(nan_like(du))
    ops.geglu_bwd(dg, du, dy, g, u, approx == "tanh")
    assert_bitwise(dg, ref_dg, f"d_gate {approx} {what}")
    assert_bitwise(du, ref_du, f"d_up {approx} {what}")


# --- the sweep ------------------------------------------------------------------------------------------------


def _sweep_cases():
    for dtype in DTYPES:
        for m in MS:
            for d in DS:
                big = m * d > (1 << 28)
                if dtype == torch.float32 and big:
                    continue  # keeps the sweep under ~2 min and memory modest; fp16/bf16 cover the sizes
                marks = []
                yield pytest.param(dtype, m, d, id=f"{str(dtype)[6:]}-{m}x{d}", marks=marks)


@pytest.mark.parametrize("dtype, m, d", list(_sweep_cases()))
def test_sweep(ops, dtype, m, d):
    g, u, dy = randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), randn(m, d, dtype=dtype)
    out = torch.empty(m, d, device="cuda", dtype=dtype)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    for approx in APPROX:
        check_fwd(ops, out, g, u, approx)
        check_bwd(ops, dg, du, dy, g, u, approx)
    torch.cuda.synchronize()


# --- layouts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("m, d", [(1, 14336), (5, 7), (64, 4096), (333, 1000), (2048, 13824)])
@pytest.mark.parametrize("approx", APPROX)
def test_packed_halves(ops, dtype, m, d, approx):
    """gate/up are the two halves of one [M, 2d] tensor, and so are d_gate/d_up (no copies)."""
    x, dy = randn(m, 2 * d, dtype=dtype), randn(m, d, dtype=dtype)
    g, u = x[:, :d], x[:, d:]
    out = torch.empty(m, d, device="cuda", dtype=dtype)
    check_fwd(ops, out, g, u, approx, "packed")
    grad = torch.empty(m, 2 * d, device="cuda", dtype=dtype)
    check_bwd(ops, grad[:, :d], grad[:, d:], dy, g, u, approx, "packed")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("pad", [5, 8, 64])
@pytest.mark.parametrize("d", [7, 128, 4096, 14336])
def test_strided_rows(ops, dtype, pad, d):
    """x[:, :d] of a wider tensor for every operand (odd pad: scalar path; pad 8/64: strided vector path)."""
    m = 37
    w = lambda: randn(m, d + pad, dtype=dtype)[:, :d]  # noqa: E731
    g, u, dy = w(), w(), w()
    out, dg, du = w(), w(), w()
    for approx in APPROX:
        check_fwd(ops, out, g, u, approx, f"stride {d + pad}")
        check_bwd(ops, dg, du, dy, g, u, approx, f"stride {d + pad}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
def test_chunk_of_3d_flattened(ops, dtype):
    b, s, d = 3, 50, 4096
    x = randn(b, s, 2 * d, dtype=dtype)
    g3, u3 = x.chunk(2, dim=-1)
    g, u = g3.flatten(0, 1), u3.flatten(0, 1)
    assert g.data_ptr() == x.data_ptr() and g.stride() == (2 * d, 1)  # views, not copies
    dy = randn(b * s, d, dtype=dtype)
    out = torch.empty(b * s, d, device="cuda", dtype=dtype)
    for approx in APPROX:
        check_fwd(ops, out, g, u, approx, "chunk")
        grad = torch.empty(b, s, 2 * d, device="cuda", dtype=dtype)
        dg3, du3 = grad.chunk(2, dim=-1)
        check_bwd(ops, dg3.flatten(0, 1), du3.flatten(0, 1), dy, g, u, approx, "chunk")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("approx", APPROX)
@pytest.mark.parametrize("m, d", [(1, 14336), (16, 127), (1024, 4096)])
def test_in_place_backward(ops, dtype, approx, m, d):
    g, u, dy = randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), randn(m, d, dtype=dtype)
    ref_dg, ref_du = eager_bwd(dy, g, u, approx)
    ops.geglu_bwd(g, u, dy, g, u, approx == "tanh")  # d_gate over gate, d_up over up
    assert_bitwise(g, ref_dg, "in-place d_gate")
    assert_bitwise(u, ref_du, "in-place d_up")
    # and in place over a packed [M, 2d] activation
    x, dy = randn(m, 2 * d, dtype=dtype), randn(m, d, dtype=dtype)
    ref_dg, ref_du = eager_bwd(dy, x[:, :d], x[:, d:], approx)
    ops.geglu_bwd(x[:, :d], x[:, d:], dy, x[:, :d], x[:, d:], approx == "tanh")
    assert_bitwise(x[:, :d], ref_dg, "in-place packed d_gate")
    assert_bitwise(x[:, d:], ref_du, "in-place packed d_up")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("which", ["gate", "up", "out", "all"])
@pytest.mark.parametrize("m, d", [(1, 4096), (9, 1000), (512, 14336)])
def test_unaligned_base_pointers(ops, dtype, which, m, d):
    """Base pointers offset by one element (not 16-byte aligned): the scalar path."""
    def make(name):
        if which in (name, "all"):
            return randn(m * d + 1, dtype=dtype)[1:].view(m, d)
        return randn(m, d, dtype=dtype)

    g, u, out = make("gate"), make("up"), make("out")
    dy, dg, du = make("gate"), make("out"), make("out")
    for approx in APPROX:
        check_fwd(ops, out, g, u, approx, f"unaligned {which}")
        check_bwd(ops, dg, du, dy, g, u, approx, f"unaligned {which}")


def test_empty_is_a_no_op(ops):
    """Empty problems write nothing: the operands are empty views at the start of NaN-poisoned buffers, which keep
    every bit (a launch that touched row 0 or column 0 would change them)."""
    for shape in [(0, 4096), (8, 0), (0, 0)]:
        bufs = [torch.full((8, 4096), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(7)]
        before = [b.clone() for b in bufs]
        v = [b[: shape[0], : shape[1]] for b in bufs]
        # (an empty tensor's data_ptr() is 0 in torch: the views' storage is the buffers')
        assert v[0].shape == shape and v[0].untyped_storage().data_ptr() == bufs[0].untyped_storage().data_ptr()
        ops.geglu_fwd(v[0], v[1], v[2], False)
        ops.geglu_bwd(v[3], v[4], v[5], v[6], v[1], True)
        torch.cuda.synchronize()
        for i, (b, ref) in enumerate(zip(bufs, before)):
            assert_bitwise(b, ref, f"buffer {i} around an empty {shape} problem")


def test_broadcast_rows_input(ops):
    """Inputs may repeat one row (row stride 0); outputs may not."""
    d = 4096
    g = randn(1, d, dtype=torch.bfloat16).expand(64, d)
    u = randn(64, d, dtype=torch.bfloat16)
    out = torch.empty(64, d, device="cuda", dtype=torch.bfloat16)
    check_fwd(ops, out, g, u, "tanh", "broadcast gate")
    with pytest.raises(RuntimeError, match="overlapping rows"):
        ops.geglu_fwd(torch.empty(1, d, device="cuda", dtype=torch.bfloat16).expand(64, d), u, u, False)


# --- every launch plan (geglu.configure(cuda_plan=...): the library's setter) --------------------------------------

PLANS = ["256,1", "256,2", "256,4", "64,1", "32,2", "256,p2", "256,p4", "128,p4", "64,p2"]


@pytest.fixture
def plan(request, package):
    with package.configure(cuda_plan=request.param):
        yield request.param


@pytest.mark.parametrize("plan", PLANS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
def test_every_plan(ops, plan, dtype):
    """Each forced plan (one tile per block, pipelined) on contiguous, odd, packed, strided, unaligned and
    in-place inputs; a large case makes the pipelined grid loop over many tiles per block."""
    for approx in APPROX:
        for m, d in [(1, 14336), (3, 7), (1024, 13824), (300, 9216)]:
            g, u, dy = randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), randn(m, d, dtype=dtype)
            out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
            check_fwd(ops, out, g, u, approx, f"plan {plan} {m}x{d}")
            check_bwd(ops, dg, du, dy, g, u, approx, f"plan {plan} {m}x{d}")
        m, d = 77, 4096
        x, dy = randn(m, 2 * d, dtype=dtype), randn(m, d, dtype=dtype)
        grad = torch.empty(m, 2 * d, device="cuda", dtype=dtype)
        out = torch.empty(m, d, device="cuda", dtype=dtype)
        check_fwd(ops, out, x[:, :d], x[:, d:], approx, f"plan {plan} packed")
        check_bwd(ops, grad[:, :d], grad[:, d:], dy, x[:, :d], x[:, d:], approx, f"plan {plan} packed")
        w = lambda pad: randn(m, d + pad, dtype=dtype)[:, :d]  # noqa: E731
        for pad in (8, 3):
            check_fwd(ops, w(pad), w(pad), w(pad), approx, f"plan {plan} pitch {d + pad}")
            check_bwd(ops, w(pad), w(pad), w(pad), w(pad), w(pad), approx, f"plan {plan} pitch {d + pad}")
        un = randn(m * d + 1, dtype=dtype)[1:].view(m, d)
        check_fwd(ops, torch.empty_like(un), un, randn(m, d, dtype=dtype), approx, f"plan {plan} unaligned")
        g, u, dy = randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), randn(m, d, dtype=dtype)
        ref_dg, ref_du = eager_bwd(dy, g, u, approx)
        ops.geglu_bwd(g, u, dy, g, u, approx == "tanh")
        assert_bitwise(g, ref_dg, f"plan {plan} in-place d_gate")
        assert_bitwise(u, ref_du, f"plan {plan} in-place d_up")


def _launch_shapes(fn, tmp_path) -> list:
    """(grid x, block x) of each geglu kernel that ``fn`` launches, from torch.profiler's trace (Kineto records
    every kernel's launch configuration)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return [(e["args"]["grid"][0], e["args"]["block"][0]) for e in events
            if e.get("cat") == "kernel" and "geglu_" in e.get("name", "")]


def test_forced_plan_sets_the_launch_shape(ops, package, tmp_path):
    """The plan reaches the launches: the block size is the plan's threads, a one-tile-per-block grid covers the
    problem (vectors / (threads * unroll)), the pipelined grid is capped at what fits on the SMs; the built-in
    choice comes back when the context ends."""
    m, d = 4096, 4096  # bf16: 8-element vectors, 2^21 vectors
    g, u = randn(m, d, dtype=torch.bfloat16), randn(m, d, dtype=torch.bfloat16)
    out = torch.empty_like(g)
    vectors = m * d // 8
    launch = lambda: ops.geglu_fwd(out, g, u, False)  # noqa: E731
    auto = _launch_shapes(launch, tmp_path)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for plan, block, grid in [("64,1", 64, vectors // 64), ("128,2", 128, vectors // 256),
                              ("32,4", 32, vectors // 64),  # the vector path runs a forced unroll of 4 as 2
                              ("256,p2", 256, None)]:
        with package.configure(cuda_plan=plan):
            shapes = _launch_shapes(launch, tmp_path)
        assert len(shapes) == 1 and shapes[0][1] == block, (plan, shapes)
        if grid is not None:
            assert shapes[0][0] == grid, (plan, shapes)
        else:
            assert shapes[0][0] <= 16 * sms, (plan, shapes)  # persistent: at most the resident blocks
        check_fwd(ops, torch.empty_like(g), g, u, "none", f"plan {plan}")
    assert _launch_shapes(launch, tmp_path) == auto


def test_malformed_plan_is_refused_and_the_plan_restored(ops, package):
    """A malformed plan raises and leaves the plan in force; leaving the context restores the built-in choice. The
    plans differ only in speed, so each state is checked by its bits and by the launch shape it implies: the forced
    32-thread plan must still give eager's bits on a problem the built-in choice would pipeline."""
    g, u = randn(4096, 4096, dtype=torch.bfloat16), randn(4096, 4096, dtype=torch.bfloat16)
    with package.configure(cuda_plan="32,1"):
        for bad in ["256", "256,3", "300,1", "256,p3", "abc", "256,1,x"]:
            with pytest.raises(ValueError, match="is not a launch plan"):
                package.configure(cuda_plan=bad)
            assert package.get_config().cuda_plan == "32,1"
        check_fwd(ops, torch.empty_like(g), g, u, "none", "plan 32,1 after refusals")
    assert package.get_config().cuda_plan == ""
    check_fwd(ops, torch.empty_like(g), g, u, "tanh", "built-in plan restored")


# --- streams, graphs, devices ------------------------------------------------------------------------------------


def test_runs_on_the_current_stream(ops):
    m, d = 4096, 14336
    g, u = randn(m, d, dtype=torch.bfloat16), randn(m, d, dtype=torch.bfloat16)
    ref = eager_fwd(g, u, "none")
    s = torch.cuda.Stream()
    out = torch.empty_like(g)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.fill_(float("nan"))
        ops.geglu_fwd(out, g, u, False)
        out2 = out.clone()  # ordered after the kernel only if it ran on s
    torch.cuda.current_stream().wait_stream(s)
    assert_bitwise(out2, ref, "side stream")


def test_cuda_graph_capture(ops):
    m, d = 8, 14336
    g, u = randn(m, d, dtype=torch.bfloat16), randn(m, d, dtype=torch.bfloat16)
    out = torch.empty_like(g)
    ops.geglu_fwd(out, g, u, True)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.geglu_fwd(out, g, u, True)
    g.copy_(randn(m, d, dtype=torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    assert_bitwise(out, eager_fwd(g, u, "tanh"), "graph replay")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(ops):
    dev = torch.device("cuda", 1)
    g, u = randn(64, 4096, dtype=torch.bfloat16, device=dev), randn(64, 4096, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(g)
    ops.geglu_fwd(out, g, u, False)  # current device is 0: the op's device guard must switch
    assert_bitwise(out, eager_fwd(g, u, "none"), "cuda:1")


# --- more than 2^31 (and 2^32) elements: 64-bit offsets -------------------------------------------------------------


def _sample_rows(m, d):
    rows = {0, 1, m // 2, m - 2, m - 1}
    rows |= {(1 << 31) // d - 1, (1 << 31) // d, ((1 << 31) + d - 1) // d}  # around element 2^31
    rows |= {(1 << 32) // d - 1, (1 << 32) // d}
    return sorted(r for r in rows if 0 <= r < m)


def test_more_than_2_31_elements_vector_path(ops):
    d = 8192
    m = (1 << 31) // d + 1  # 2^31 + 8192 elements per tensor, bf16: 4.3 GB each
    g = torch.empty(m, d, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    u = torch.empty(m, d, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert g.numel() > (1 << 31)
    ops.geglu_fwd(out, g, u, False)
    rows = _sample_rows(m, d)
    assert_bitwise(out[rows], eager_fwd(g[rows], u[rows], "none"), "2^31+ rows")
    assert not torch.isnan(out).any()
    del g, u, out
    torch.cuda.empty_cache()


def test_more_than_2_32_elements_scalar_strided(ops):
    """Rows at an odd pitch (scalar path) over more than 2^32 elements: the 64-bit row/column split."""
    d = 8192
    m = (1 << 32) // d + 1
    g = torch.empty(m, d + 1, device="cuda", dtype=torch.bfloat16).normal_(0, 3)[:, :d]
    u = torch.empty(m, d + 1, device="cuda", dtype=torch.bfloat16).normal_(0, 3)[:, 1:]
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert g.numel() > (1 << 32)
    ops.geglu_fwd(out, g, u, True)
    rows = _sample_rows(m, d)
    assert_bitwise(out[rows], eager_fwd(g[rows], u[rows], "tanh"), "2^32+ strided rows")
    assert not torch.isnan(out).any()
    del g, u, out
    torch.cuda.empty_cache()


# --- input validation (C++) -------------------------------------------------------------------------------------


def test_validation_messages(ops):
    """Each refused call names the problem and writes nothing (every operand keeps its bits, the output buffer its
    NaN poison); the one allowed alias, d_gate over grad (elementwise: each element is read before it is written),
    gives eager's gradients."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, b = randn(4, 8, dtype=torch.bfloat16), randn(4, 8, dtype=torch.bfloat16)
    c = torch.full((4, 8), float("nan"), **bf)
    cases = [
        (lambda: ops.geglu_fwd(c, a, b.float(), False), "one dtype"),
        (lambda: ops.geglu_fwd(c.double(), a.double(), b.double(), False), "float32, float16 or bfloat16"),
        (lambda: ops.geglu_fwd(c, a, b[:, :4], False), "one shape"),
        (lambda: ops.geglu_fwd(c.view(2, 2, 8), a.view(2, 2, 8), b.view(2, 2, 8), False), "2-D"),
        (lambda: ops.geglu_fwd(c, a.t().contiguous().t(), b, False), "last-dim stride 1"),
        (lambda: ops.geglu_fwd(c, a.cpu(), b, False), "CUDA tensor"),
        (lambda: ops.geglu_fwd(a[:, :4], a[:, 2:6], b[:, :4], False), "overlaps gate"),
        (lambda: ops.geglu_bwd(c, c, a, a, b, False), "outputs must not overlap"),
    ]
    for call, match in cases:
        before = [t.clone() for t in (a, b, c)]
        with pytest.raises(RuntimeError, match=match):
            call()
        torch.cuda.synchronize()
        for name, t, ref in zip("abc", (a, b, c), before):
            assert_bitwise(t, ref, f"{name} after the refused call ({match})")
    ref_dg, ref_du = eager_bwd(a, b, b, "none")
    ops.geglu_bwd(a, c, a[:, :], b, b, False)  # d_gate is exactly grad: allowed
    assert_bitwise(a, ref_dg, "d_gate written over grad")
    assert_bitwise(c, ref_du, "d_up (grad aliased by d_gate)")


def test_schema_annotations(ops):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    g, u = torch.randn(16, 64, **bf), torch.randn(16, 64, **bf)
    torch.library.opcheck(ops.geglu_fwd.default, (torch.empty_like(g), g, u, False), test_utils=("test_schema",))
    torch.library.opcheck(
        ops.geglu_bwd.default,
        (torch.empty_like(g), torch.empty_like(u), torch.randn_like(g), g, u, True),
        test_utils=("test_schema",),
    )
