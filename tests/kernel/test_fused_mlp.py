"""The fused GeGLU MLP: the gate/up GEMM with the GeGLU in its epilogue (``mlp.kernels``), ``GeGLUMLP``'s
computation in every mode (``mlp.ops.geglu_mlp``, ``mlp.inference``, ``mlp.training``: eager inference and its
fused path with the shipped rule, the training node, the custom ops that torch.compile sees).

Without a GPU the Triton kernel runs under the interpreter on CPU tensors at tiny shapes (backend 'triton', the
decode threshold lowered so the fused kernel runs); with one, the same tests run on CUDA, plus the `gpu` tests at
real shapes.

Exactness. The fused GEMM accumulates in fp32 in its own order, so it is not bit-identical to cuBLAS or the CPU
BLAS; what is exact is its epilogue: on data whose GEMMs are exact in fp32 (small integers times multiples of 1/8),
its eager-rounding epilogue equals our pointwise GeGLU of the rounded pre-activations bit for bit. The fast epilogue (the inference path) rounds the GeGLU of the fp32 accumulators once:
checked elementwise against fp64 within one unit of the storage dtype plus the accumulation's bound. Everything
that is eager's computation (the regular path, the training node, the compiled ops) is compared bit for bit.
"""

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
LOW_DTYPES = [torch.bfloat16, torch.float16]
APPROX = ["none", "tanh"]


@pytest.fixture(scope="module")
def mlp(geglu):
    """The MLP's inference path (the fused path's rule and thresholds)."""
    return importlib.import_module(geglu.__name__ + ".mlp.inference")


def _training(geglu):
    """The MLP's training node and operators."""
    return importlib.import_module(geglu.__name__ + ".mlp.training")


@pytest.fixture(scope="module")
def kt(geglu):
    return importlib.import_module(geglu.__name__ + ".mlp.kernels")


@pytest.fixture
def fused(geglu, mlp):
    """The fused kernel for every row count (tiny test shapes included); on CPU through the Triton interpreter."""
    old = mlp.DECODE_MAX_M
    mlp.DECODE_MAX_M = 0
    restore = geglu.configure(backend="auto" if HAS_CUDA else "triton")
    try:
        yield mlp
    finally:
        mlp.DECODE_MAX_M = old
        restore.__exit__()


@pytest.fixture
def fresh_decisions(mlp, kt, monkeypatch):
    """An empty tile table for the test (the fused path's per-shape stage choices), the real one restored after
    it."""
    monkeypatch.setattr(kt, "TUNED", {})
    return mlp


def _data(M, D, H, dtype, device=DEVICE, down=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    # Weights scaled like nn.Linear's init and x with unit variance: gate pre-activations of order 1-3, which
    # spreads them over GELU's curved region and both tails.
    x = r(M, D, scale=2.0)
    wg, wu = r(H, D, scale=D ** -0.5), r(H, D, scale=D ** -0.5)
    wd = r(D, H, scale=H ** -0.5) if down else None
    return x, wg, wu, wd


def _eager(x, wg, wu, wd, approximate):
    h = F.gelu(F.linear(x, wg), approximate=approximate) * F.linear(x, wu)
    return F.linear(h, wd) if wd is not None else h


def _run(fn, x, wg, wu, wd, approximate, dy_seed=1):
    """Forward output and gradients (x, wg, wu, wd) of fn, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    y = fn(*leaves, approximate)
    gen = torch.Generator().manual_seed(dy_seed)
    dy = torch.randn(y.shape, generator=gen).to(y.dtype).to(y.device)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def _err(a, ref):
    return (a.double() - ref.double()).norm().item()


def _assert_equal(ours, ref, what=""):
    for name, o, r in zip(["y", "dx", "dw_gate", "dw_up", "dw_down"], ours, ref):
        assert torch.equal(o, r), f"{what} {name}: {(o != r).sum().item()} of {o.numel()} differ"


def _fp64_h(x, wg, wu, approximate):
    x64 = x.double()
    return F.gelu(x64 @ wg.double().t(), approximate=approximate) * (x64 @ wu.double().t())


def _assert_within_fp64_bound(h, x, wg, wu, approximate, what=""):
    """h (the fast epilogue: the GeGLU of fp32 accumulators, rounded once) against the fp64 GeGLU of the same
    inputs, elementwise: at most one unit of the storage dtype (the rounding, half a unit, plus the fp32 GELU's own
    error, within the other half) plus the fp32 accumulation's bound K * eps32 * sum|x||w| carried through the
    GeGLU (|gelu'| <= 1.13, |u| and |gelu(g)|)."""
    x64, wg64, wu64 = x.double(), wg.double(), wu.double()
    g64, u64 = x64 @ wg64.t(), x64 @ wu64.t()
    ref = F.gelu(g64, approximate=approximate) * u64
    K = x.shape[-1]
    e32 = torch.finfo(torch.float32).eps
    acc_g = K * e32 * (x64.abs() @ wg64.abs().t())
    acc_u = K * e32 * (x64.abs() @ wu64.abs().t())
    eps, tiny = torch.finfo(h.dtype).eps, torch.finfo(h.dtype).tiny
    bound = eps * ref.abs() + tiny + 1.13 * acc_g * u64.abs() + F.gelu(g64, approximate=approximate).abs() * acc_u
    err = (h.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: worst element is {worst:.3g} x the bound (one unit of {h.dtype} + accumulation)"


# --- the epilogue is our pointwise GeGLU, exactly -----------------------------------------------------------------


def _configs(kt):
    if not HAS_CUDA:
        return [None, kt.Config(16, 16, 16, 2, 1, 1, tma=False), kt.Config(16, 16, 16, 2, 1, 1, persistent=True)]
    return [None, kt.Config(64, 128, 64, 8, 4, 3, tma=False), kt.Config(128, 128, 64, 8, 8, 3, persistent=True)]


def _exact_gemm_data(M, D, H, dtype, device=DEVICE, seed=4):
    """x of small integers and weights of multiples of 1/8: every product and partial sum is exact in fp32, so the
    GEMMs' results do not depend on the accumulation order, and (g, u) rounded to the storage dtype are known."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (M, D), generator=gen).to(dtype)
    wg, wu = ((torch.randint(-2, 3, (H, D), generator=gen) / 8).to(dtype) for _ in range(2))
    g, u = ((x.double() @ w.double().t()).to(dtype) for w in (wg, wu))
    return [t.to(device) for t in (x, wg, wu, g, u)]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_epilogue_is_pointwise_geglu_of_its_preactivations(geglu, fused, kt, dtype, approximate):
    """With eager's rounding (fast_epi off), h == geglu(g, u) bit for bit, (g, u) the GEMMs rounded to the storage
    dtype; every tile-config family (TMA descriptors, pointer loads, persistent grid), the paired kernel too;
    ragged M, D, H (partial tiles and K steps)."""
    x, wg, wu, g, u = _exact_gemm_data(40, 40, 48, dtype)
    want = geglu.geglu(g, u, approximate)
    for cfg in _configs(kt) + [_pair_cfg(kt, pair=True)]:
        cfg = (cfg or kt.choose_config(40, 40, 48, dtype, torch.device(DEVICE)))._replace(fast_epi=False)
        assert torch.equal(kt.gate_up_geglu(x, wg, wu, approximate == "tanh", cfg), want), f"config {cfg}"


# --- one wide dot over both weights, in place: the paired kernel ------------------------------------------------


def test_fallback_tiles_are_remembered_per_device(kt, fresh_decisions):
    """A tile the fused kernel fell back to on one device (fewer stages after OutOfResources) is not chosen for the
    same shape on another device, whose shared memory may differ."""
    here, there = torch.device("cuda", 0), torch.device("cuda", 1)
    fallback = kt.inference_config(300)._replace(num_stages=2)
    kt.TUNED[(kt.m_bucket(300), 64, 128, torch.bfloat16, there)] = fallback
    assert kt.choose_config(300, 64, 128, torch.bfloat16, there) == fallback
    assert kt.choose_config(300, 64, 128, torch.bfloat16, here) == kt.inference_config(300)


def _pair_cfg(kt, **kw):
    base = kt.INTERPRETER if not HAS_CUDA else kt.Config(128, 128, 64, 16, 8, 3, persistent=True)
    return base._replace(**kw)


def _weight_pairs(H, D, dtype, seed=7):
    """(w_gate, w_up) in each memory order the paired kernel meets: views of one buffer with the gate first and with
    the up weight first (deterministic address order), and two separate allocations."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(2, H, D, generator=gen) * D ** -0.5).to(dtype).to(DEVICE)
    sep = (buf[0].clone(), buf[1].clone())
    return {"gate first": (buf[0], buf[1]), "up first": (buf[1], buf[0]), "separate": sep}


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_paired_equals_the_two_accumulator_kernel(fused, kt, dtype, approximate):
    """The paired kernel (one [2, BLOCK_N, BLOCK_K] TMA box over both weights in place, one dot of N = 2 * BLOCK_N)
    computes what the two-accumulator kernel does: same products, same epilogue, and on the GPU the same fp32
    accumulation order per output (wgmma's does not depend on N), so bit for bit, both epilogues, whichever weight
    lies first in memory; ragged M, D, H (partial tiles). Under the interpreter the dots are numpy matmuls, whose
    summation order can change with the width: there h may differ by what one rounding of a pre-activation
    propagates to."""
    M, D, H = (40, 48, 40) if not HAS_CUDA else (300, 200, 328)
    x = _data(M, D, H, dtype, down=False)[0]
    tanh = approximate == "tanh"
    for where, (wg, wu) in _weight_pairs(H, D, dtype).items():
        layout = kt.pair_layout(wg, wu)
        assert layout is not None
        assert layout.gate_first == (wg.data_ptr() < wu.data_ptr())
        for fast in (False, True):
            ref_h = kt.gate_up_geglu(x, wg, wu, tanh, _pair_cfg(kt, fast_epi=fast))
            h2 = kt.gate_up_geglu(x, wg, wu, tanh, _pair_cfg(kt, fast_epi=fast, pair=True))
            _same(h2, ref_h, f"gate_up_geglu with pair=True, {where}, fast_epi={fast}")


def _same(h, ref_h, what):
    if HAS_CUDA:
        assert torch.equal(h, ref_h), what
        return
    eps, tiny = torch.finfo(h.dtype).eps, torch.finfo(h.dtype).tiny  # tiny: subnormals' fixed ulp is below it
    assert ((h.float() - ref_h.float()).abs() <= 4 * eps * ref_h.float().abs() + tiny).all(), what
    assert (h == ref_h).float().mean() > 0.95, what


def test_pair_layout_refuses_what_one_descriptor_cannot_see(kt):
    """pair_layout names the weights' base and the outer stride, or None: same tensor, different row strides,
    dtypes or shapes, a base off the 16-byte grid, and weights whose rows interleave. Refused pairs still compute
    right through
    gate_up_geglu(pair=True), which falls back to the two-accumulator kernel."""
    dtype = torch.bfloat16
    wg, wu = _weight_pairs(32, 48, dtype)["gate first"]
    base, outer, gate_first = kt.pair_layout(wg, wu)
    assert base.data_ptr() == wg.data_ptr() and outer == 32 * 48 and gate_first
    swapped = kt.pair_layout(wu, wg)  # the same memory with the roles exchanged: the base is now the up weight
    assert swapped.base.data_ptr() == wg.data_ptr() and swapped.outer_stride == 32 * 48 and not swapped.gate_first
    wide = torch.zeros(32, 64, dtype=dtype, device=DEVICE)[:, :48]
    wide.copy_(wu)
    odd = torch.zeros(32 * 48 + 1, dtype=dtype, device=DEVICE)[1:].view(32, 48)
    odd.copy_(wu)
    assert kt.pair_layout(wg, wg) is None
    assert kt.pair_layout(wg, wide) is None  # row stride 64 vs 48
    assert kt.pair_layout(wg, wu.half()) is None
    assert kt.pair_layout(wg[:16], wu[:16].clone()[:, :40].contiguous()) is None
    assert kt.pair_layout(wg, odd) is None  # 2-byte offset: not 16-byte aligned
    rows = torch.stack((wg, wu), dim=1).reshape(64, 48)  # the two weights as alternate rows of one tensor
    assert kt.pair_layout(rows[0::2], rows[1::2]) is None
    x = _data(40, 48, 32, dtype, down=False)[0]
    got = kt.gate_up_geglu(x, rows[0::2], rows[1::2], True, _pair_cfg(kt, pair=True))
    assert torch.equal(got, kt.gate_up_geglu(x, wg, wu, True, _pair_cfg(kt)))
    ref = kt.gate_up_geglu(x, wg, wide, True, _pair_cfg(kt))
    got = kt.gate_up_geglu(x, wg, wide, True, _pair_cfg(kt, pair=True))
    assert torch.equal(got, ref)


# --- the fast epilogue (the inference path) -----------------------------------------------------------------------


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_fast_epilogue_within_one_unit_of_fp64(fused, kt, dtype, approximate):
    """fast_epi: the GeGLU of the fp32 accumulators, rounded once (hardware exp2/rcp for tanh on a GPU), for the
    two-accumulator kernel and the paired one (the inference path's above 256 rows): every element within one unit
    of the storage dtype of the fp64 GeGLU of the same inputs (plus the fp32 accumulation's bound). Computing the
    other GELU flavour fails this in fp16, where one unit is finer than the erf/tanh difference."""
    x, wg, wu, _ = _data(96, 64, 80, dtype, down=False, seed=5)
    base = kt.INTERPRETER if kt.INTERPRET else kt.PAIRED_LARGE
    for pair in (False, True):
        h = kt.gate_up_geglu(x, wg, wu, approximate == "tanh", base._replace(fast_epi=True, pair=pair))
        _assert_within_fp64_bound(h, x, wg, wu, approximate, f"fast epilogue, pair={pair}")


# --- GeGLUMLP's computation: routing and the per-shape rule --------------------------------------------------------


def _layer(geglu, D, H, dtype, approximate, M=96, seed=6):
    x, wg, wu, wd = _data(M, D, H, dtype, seed=seed)
    m = geglu.layers.GeGLUMLP()
    m.gate_proj, m.up_proj = torch.nn.Linear(D, H, bias=False), torch.nn.Linear(D, H, bias=False)
    m.down_proj = torch.nn.Linear(H, D, bias=False)
    m.act_fn = torch.nn.GELU(approximate=approximate)
    m.to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
            lin.weight.copy_(w)
    return m, x


def _weights(m):
    return m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight


def _count(monkeypatch, module, name):
    """Counts the calls of ``module.name`` (which still runs)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _rule(monkeypatch, mlp, answer):
    """The shipped rule answering ``answer``; returns the list of its questions (M, D, H)."""
    asked = []

    def rule(M, D, H, device):
        asked.append((M, D, H))
        return answer

    monkeypatch.setattr(mlp, "fused_rule", rule)
    return asked


def _no_timing(monkeypatch):
    """Fail on any CUDA event or synchronisation: the path's choice must cost nothing at run time."""
    def timing(*a, **k):
        pytest.fail("the inference path timed something")

    monkeypatch.setattr(torch.cuda, "Event", timing)
    monkeypatch.setattr(torch.cuda, "synchronize", timing)


@pytest.mark.parametrize("approximate", APPROX)
def test_inference_follows_the_shipped_rule_without_timing(geglu, fused, fresh_decisions, kt, monkeypatch,
                                                          approximate):
    """The inference forward asks the shipped rule (rows, D, H) and times nothing: where it says fused, the fused
    kernel's output (within the fast epilogue's bound of fp64); where it says regular, eager's bits."""
    mlp = fresh_decisions
    m, x = _layer(geglu, 32, 48, torch.bfloat16, approximate)
    calls = _count(monkeypatch, kt, "gate_up_geglu")
    _no_timing(monkeypatch)
    with torch.no_grad():
        asked = _rule(monkeypatch, mlp, False)
        y = m(x)
        assert asked == [(x.shape[0], 32, 48)] and not calls
        assert torch.equal(y, _eager(x, *_weights(m), approximate))
        asked = _rule(monkeypatch, mlp, True)
        y = m(x)
        assert asked == [(x.shape[0], 32, 48)] and len(calls) == 1
        h = kt.gate_up_geglu(x, m.gate_proj.weight, m.up_proj.weight, approximate == "tanh",
                             kt.inference_config(x.shape[0]))
    _assert_within_fp64_bound(h, x, m.gate_proj.weight, m.up_proj.weight, approximate, "inference h")
    assert torch.equal(y, torch.mm(h, m.down_proj.weight.t()))


def _backend_of(mod):
    """The runtime's backend module of the package ``mod`` belongs to (where the shipped rules read the device)."""
    return importlib.import_module(mod.__name__.rsplit(".", 2)[0] + ".runtime.backend")


def test_shipped_rule(mlp, monkeypatch):
    """The shipped rule for sm_9x: fused from min_m rows where M * D * H reaches min_work, never on an architecture
    without a rule; always on CPU tensors (the interpreter)."""
    rule = mlp.FUSED_RULES[9]
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_backend_of(mlp), "capability_major", lambda device: 9)
    M = rule["min_m"]
    H = -(-int(rule["min_work"]) // (M * 2560))
    assert mlp.fused_rule(M, 2560, H, cuda) and mlp.fused_rule(16384, 2560, 10240, cuda)
    assert not mlp.fused_rule(M - 1, 2560, 1 << 16, cuda)
    assert not mlp.fused_rule(M, 2560, H - 1, cuda)
    # a compiled graph calls the op only from compiled_min_work: below it the op's host cost would show
    assert mlp._traced_rule(torch.bfloat16, cuda) == (M, rule["compiled_min_work"]) and rule["compiled_min_work"] > \
        rule["min_work"]
    assert mlp._traced_rule(torch.float32, cuda) is None
    monkeypatch.setattr(_backend_of(mlp), "capability_major", lambda device: 8)
    assert not mlp.fused_rule(1 << 20, 4096, 1 << 16, cuda)
    assert mlp._traced_rule(torch.bfloat16, cuda) is None
    assert mlp.fused_rule(1, 1, 1, torch.device("cpu"))


def test_fused_path_never_runs_when_off_in_training_at_decode_or_through_modules(geglu, fresh_decisions, kt, mlp,
                                                                                  monkeypatch):
    """Nowhere but eager inference above DECODE_MAX_M rows with the fused_mlp setting on: not with the setting off,
    not at decode sizes, not with a gradient to record (the training node), not with a projection that is a module
    of its own (a forward hook); each of those gives eager's bits."""
    restore = geglu.configure(backend="auto" if HAS_CUDA else "triton")
    try:
        m, x = _layer(geglu, 32, 48, torch.bfloat16, "tanh", M=96)
        calls = _count(monkeypatch, kt, "gate_up_geglu")
        eager = _eager(x, *_weights(m), "tanh")
        with torch.no_grad():
            with geglu.configure(fused_mlp=False):
                assert torch.equal(m(x), eager)
            assert torch.equal(m(x[:mlp.DECODE_MAX_M]), eager[:mlp.DECODE_MAX_M])  # decode size
            m.down_proj.register_forward_hook(lambda *a: None)
            assert torch.equal(m(x), eager)
            m.down_proj._forward_hooks.clear()
        y = m(x)  # training: the node (CPU), or eager's own ops (a host-bound CUDA step this small)
        node = "MmBackward0" if HAS_CUDA and _training(geglu).host_bound(x, m.gate_proj.weight) else "GeGLUMLPFunctionBackward"
        assert type(y.grad_fn).__name__ == node and torch.equal(y, eager)
        assert not calls
    finally:
        restore.__exit__()


# --- the custom ops (torch.compile, tracing, tensor subclasses) ---------------------------------------------------


def _graphs_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _ops_in(graphs):
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


def _through(mod, scale=None):
    """fn(x, wg, wu, wd, approximate) for `_run`: ``mod`` called on x (or ``x * scale``) with the three weights in
    place of its own (its approximate is its act_fn's)."""
    return lambda xx, wg, wu, wd, a: torch.func.functional_call(
        mod, {"gate_proj.weight": wg, "up_proj.weight": wu, "down_proj.weight": wd},
        (xx if scale is None else xx * scale,))


@pytest.mark.parametrize("approximate", APPROX)
def test_compiled_layer_runs_the_ops_fullgraph_with_eager_modes_results(geglu, fused, fresh_decisions, approximate,
                                                                        monkeypatch):
    """torch.compile(fullgraph=True) of the layer where the fused path may run for its rows: its graph calls the
    inference op without a gradient (no other computation of its own) and, with one, the host's ops (linear, GELU,
    product, linear: no op of ours); the results equal the same layer in eager mode bit for bit (the op makes the
    eager mode's run-time choices; the host's ops run as traced here), forward and every gradient."""
    mlp = fresh_decisions
    _rule_from(mlp, monkeypatch, rows=1)
    m, x = _layer(geglu, 32, 48, torch.bfloat16, approximate)
    torch._dynamo.reset()
    graphs = []
    f = torch.compile(m, fullgraph=True, backend=_graphs_backend(graphs))
    with torch.no_grad():
        assert torch.equal(f(x), m(x))
    ns = geglu.ops._name if hasattr(geglu.ops, "_name") else None
    assert any(t.endswith("geglu_mlp.default") for t in _ops_in(graphs)), _ops_in(graphs)

    graphs.clear()
    ours = _run(_through(f), x, *_weights(m), approximate)
    assert graphs and not any("geglu" in t for t in _ops_in(graphs)), _ops_in(graphs)
    assert {"<built-in function linear>", "<built-in function gelu>"} <= _ops_in(graphs), _ops_in(graphs)
    ref = _run(_through(m), x, *_weights(m), approximate)
    _assert_equal(ours, ref, f"compiled training {approximate}")
    assert ns is None or ns


def _rule_from(mlp, monkeypatch, rows):
    """The fused path from ``rows`` rows on: the shipped rule of this GPU's architecture (CUDA), the decode bound
    (CPU, where the interpreter's fused kernel has no shipped rule)."""
    if HAS_CUDA:
        monkeypatch.setitem(mlp.FUSED_RULES, torch.cuda.get_device_capability()[0], dict(min_m=rows, min_work=0))
    else:
        monkeypatch.setattr(mlp, "DECODE_MAX_M", rows - 1)


def test_compiled_inference_calls_the_op_only_where_the_rule_may_fuse(geglu, fused, fresh_decisions, monkeypatch):
    """Under torch.compile (default dynamic shapes, as a server meets prompt lengths) the graph is the host's ops
    below the rule's rows, which Inductor compiles as for the unkernelized model, and the fused MLP's op from them
    on: one guard on the symbolic row count, so one graph serves each side and lengths met again recompile nothing.
    Every call gives the eager layer's bits. fp32, or the ``fused_mlp`` setting off, never call the op."""
    mlp = fresh_decisions
    _rule_from(mlp, monkeypatch, rows=64)
    m, _ = _layer(geglu, 32, 48, torch.bfloat16, "tanh")
    torch._dynamo.reset()
    graphs = []
    f = torch.compile(m, backend=_graphs_backend(graphs))
    gen = torch.Generator().manual_seed(11)
    calls = {}
    with torch.no_grad():
        for M in (16, 24, 96, 130, 63, 64, 40):
            x = torch.randn(M, 32, generator=gen).to(DEVICE, torch.bfloat16)
            before = len(graphs)
            assert torch.equal(f(x), m(x)), M
            calls[M] = len(graphs) - before
    has_op = [any(t.endswith("geglu_mlp.default") for t in _ops_in([g])) for g in graphs]
    # 16: a static graph; 24: the dynamic graph below the rule; 96: the dynamic graph from the rule on
    assert has_op == [False, False, True], [sorted(_ops_in([g])) for g in graphs]
    assert calls == {16: 1, 24: 1, 96: 1, 130: 0, 63: 0, 64: 0, 40: 0}, calls
    for dtype, setting in ((torch.float32, True), (torch.bfloat16, False)):
        restore = geglu.configure(fused_mlp=setting)
        try:
            m32, x = _layer(geglu, 32, 48, dtype, "tanh", M=128)
            torch._dynamo.reset()
            graphs.clear()
            with torch.no_grad():  # the host's ops against our kernel (fp32 under the interpreter: its erf and tanh)
                torch.testing.assert_close(torch.compile(m32, backend=_graphs_backend(graphs))(x), m32(x))
            assert graphs and not any("geglu" in t for t in _ops_in(graphs)), (dtype, setting, _ops_in(graphs))
        finally:
            restore.__exit__()


class _HostMLP(torch.nn.Module):
    """A transformers gated MLP as the hosts write it (Gemma's ``GemmaMLP.forward``), on the layer's modules."""

    def __init__(self, m):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = m.gate_proj, m.up_proj, m.down_proj, m.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_compile_with_inductor_equals_eager_mode_and_the_compiled_host(geglu, fused, fresh_decisions):
    """The default backend: without a gradient it compiles around the opaque op (eager mode's bits); a training
    step compiles the host's ops, so forward and gradients equal the compiled unkernelized MLP's bit for bit (the
    same Inductor code) and stay within bf16 rounding of eager mode's."""
    m, x = _layer(geglu, 32, 48, torch.bfloat16, "tanh")
    torch._dynamo.reset()
    f = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(f(x), m(x))
    host = torch.compile(_HostMLP(m), fullgraph=True)
    ours = _run(_through(f, scale=2), x, *_weights(m), "tanh")
    theirs = _run(_through(host, scale=2), x, *_weights(m), "tanh")
    _assert_equal(ours, theirs, "compiled training against the compiled host")
    eager = _run(_through(m, scale=2), x, *_weights(m), "tanh")
    for name, a, b in zip(("y", "dx", "dWg", "dWu", "dWd"), ours, eager):
        # Inductor fuses the GELU and the product in fp32 where eager rounds gelu(g) to bf16 first: normwise, within
        # a few bf16 roundings (2^-8 each)
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against eager mode"


def test_opcheck(geglu, mlp):
    x, wg, wu, wd = _data(24, 32, 48, torch.bfloat16)
    torch.library.opcheck(geglu.ops.geglu_mlp.default, (x, wg, wu, wd, "tanh"))
    torch.library.opcheck(geglu.ops.geglu_mlp.default, (x.view(2, 12, 32), wg, wu, wd, "none"))
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    torch.library.opcheck(geglu.ops.geglu_mlp_train.default, (*leaves, "none"))
    torch.library.opcheck(geglu.ops.geglu_mlp_train.default, (leaves[0].view(2, 12, 32), *leaves[1:], "tanh"))
    y, g, u, h = geglu.ops.geglu_mlp_train(x, wg, wu, wd, "tanh")
    dy = torch.randn_like(y)
    for need in ((True, True, True, True), (False, True, False, True), (True, False, False, False)):
        torch.library.opcheck(geglu.ops.geglu_mlp_train_backward.default, (dy, x, wg, wu, wd, g, u, h, "tanh", *need))


def _python_frames(fn):
    """The files of the Python functions entered while ``fn()`` runs (sys.setprofile)."""
    files = []

    def prof(frame, event, arg):
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


def test_compiled_graphs_call_the_mlp_ops_without_python_wrappers(geglu, mlp):
    """A compiled graph calls the inference op once per MLP layer: the dispatcher must go straight to our
    implementation, with none of torch.library.custom_op's Python layers around it (its autograd kernel and output
    alias check, ~5 µs a call on the build machine: `runtime/library.py`). The training op keeps its autograd kernel and
    nothing else."""
    x, wg, wu, wd = _data(24, 32, 48, torch.bfloat16)
    with torch.no_grad():
        frames = _python_frames(lambda: geglu.ops.geglu_mlp.default(x, wg, wu, wd, "tanh"))
    assert any(f.endswith("mlp/inference.py") for f in frames), frames  # our implementation ran
    assert not [f for f in frames if f"torch{os.sep}_library" in f], frames
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    with torch.no_grad():
        frames = _python_frames(lambda: geglu.ops.geglu_mlp_train.default(*leaves, "tanh"))
    library = {os.path.basename(f) for f in frames if f"torch{os.sep}_library" in f}
    assert "autograd.py" in library and "custom_ops.py" not in library, library
    y, g, u, h = geglu.ops.geglu_mlp_train(x, wg, wu, wd, "tanh")
    frames = _python_frames(lambda: geglu.ops.geglu_mlp_train_backward.default(
        torch.ones_like(y), x, wg, wu, wd, g, u, h, "tanh", True, True, True, True))
    assert not [f for f in frames if f"torch{os.sep}_library" in f], frames


def test_training_ops_equal_the_eager_node(geglu, mlp):
    """geglu_mlp_train + its backward op compute what the eager training node does, bit for bit (the same GEMM
    calls and roundings); gradients not asked for are not computed."""
    x, wg, wu, wd = _data(40, 32, 48, torch.bfloat16)
    ref = _run(_training(geglu).GeGLUMLPFunction.apply, x, wg, wu, wd, "tanh")
    ours = _run(lambda *a: geglu.ops.geglu_mlp_train(*a)[0], x, wg, wu, wd, "tanh")
    _assert_equal(ours, ref, "training ops")
    y, g, u, h = geglu.ops.geglu_mlp_train(x, wg, wu, wd, "tanh")
    grads = geglu.ops.geglu_mlp_train_backward(torch.ones_like(y), x, wg, wu, wd, g, u, h, "tanh", False, True,
                                               False, False)
    assert [t.numel() for t in grads] == [0, wg.numel(), 0, 0]


def test_ops_refuse_bad_input_with_messages(geglu):
    x, wg, wu, wd = _data(4, 32, 48, torch.bfloat16)
    op = geglu.ops.geglu_mlp
    with pytest.raises(ValueError, match="approximate='erf' is not supported"):
        op(x, wg, wu, wd, "erf")
    with pytest.raises(ValueError, match=r"must both be \[H, D\]"):
        op(x, wg, wu[:, :16], wd, "none")
    with pytest.raises(ValueError, match="with D = 16, x's last dim"):
        op(x[:, :16], wg, wu, wd, "none")
    with pytest.raises(ValueError, match=r"w_down \(48, 32\) must be \[D_out, H\]"):
        op(x, wg, wu, wd.t(), "none")
    with pytest.raises(ValueError, match="w_gate is torch.float16 on"):
        op(x, wg.half(), wu, wd, "none")
    with pytest.raises(TypeError, match="expected float32, float16 or bfloat16"):
        op(x.int(), wg, wu, wd, "none")


# --- GPU, real shapes -----------------------------------------------------------------------------------------------

GPU_SHAPES = [(8192, 2304, 9216), (8192, 4096, 14336), (16, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("M,D,H", GPU_SHAPES)
def test_gpu_real_shapes_inference_vs_fp32_reference(geglu, mlp, kt, M, D, H, approximate):
    """bf16 at the benchmark shapes (the last one is decode: cuBLAS + pointwise): the fused forward's output no
    less accurate than eager bf16 (cuBLAS) against the fp32 reference (TF32 off), and its epilogue with eager's
    rounding equal to the pointwise GeGLU of the pre-activations on data whose GEMMs are exact."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, wg, wu, wd = _data(M, D, H, torch.bfloat16, device="cuda")
    with torch.no_grad():
        if M > mlp.DECODE_MAX_M:
            ours = mlp.fused_forward(x, wg, wu, wd, approximate)
        else:
            ours = mlp.inference(x, wg, wu, wd, approximate)
            assert torch.equal(ours, _eager(x, wg, wu, wd, approximate))
        eager = _eager(x, wg, wu, wd, approximate)
        ref32 = _eager(x.float(), wg.float(), wu.float(), wd.float(), approximate)
        scale = ref32.double().norm().item()
        print(f"{M}x{D}x{H} {approximate}: ours {_err(ours, ref32) / scale:.3e} eager {_err(eager, ref32) / scale:.3e}")
        assert _err(ours, ref32) <= 1.02 * _err(eager, ref32)
        x, wg, wu, g, u = _exact_gemm_data(M, D, H, torch.bfloat16, device="cuda")
        for pair in (False, True):
            cfg = kt.PAIRED_LARGE._replace(fast_epi=False, pair=pair)
            assert torch.equal(kt.gate_up_geglu(x, wg, wu, approximate == "tanh", cfg), geglu.geglu(g, u, approximate))


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
def test_gpu_inference_follows_the_rule_and_captures_in_a_graph(geglu, fresh_decisions, kt, approximate,
                                                                monkeypatch):
    """On a GPU the inference path is the shipped rule's choice, decided without timing: at a shape it takes the
    fused path (eager mode and inside a CUDA graph capture, which replays to the same bits), the output is no less
    accurate than eager's; at one it does not, eager's bits."""
    mlp = fresh_decisions
    rule = mlp.FUSED_RULES[torch.cuda.get_device_capability()[0]]
    H = -(-int(rule["min_work"]) // (rule["min_m"] * 2560 * 128)) * 128  # the least aligned width the rule fuses
    m, x = _layer(geglu, 2560, H, torch.bfloat16, approximate, M=rule["min_m"])
    calls = _count(monkeypatch, kt, "gate_up_geglu")
    with torch.no_grad():
        y = m(x)
        assert len(calls) == 1 and torch.equal(m(x), y)
        eager = _eager(x, *_weights(m), approximate)
        ref = F.linear(_fp64_h(x, m.gate_proj.weight, m.up_proj.weight, approximate), m.down_proj.weight.double())
        assert _err(y, ref) <= 1.02 * _err(eager, ref)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            yg = m(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y)
        small = x[: mlp.DECODE_MAX_M + 1]
        n = len(calls)
        assert not mlp.fused_rule(small.shape[0], 2560, H, small.device)
        assert torch.equal(m(small), _eager(small, *_weights(m), approximate)) and len(calls) == n


@pytest.mark.gpu
def test_gpu_opcheck_and_inductor_real_shape(geglu, fresh_decisions):
    """At a real shape on the GPU: opcheck of the ops; torch.compile (Inductor) of the layer in inference equal bit
    for bit to eager mode where the compiled rule calls the op (``inference.traced_op``), and to the compiled host
    MLP where it traces the host's ops (below ``compiled_min_work``); a compiled training step equal to the
    compiled host MLP's bit for bit (it traces the host's ops) and within bf16 rounding of eager mode's."""
    xl, wg, wu, wd = _data(2048, 2304, 9216, torch.bfloat16, device="cuda")
    x = xl[:1024]
    torch.library.opcheck(geglu.ops.geglu_mlp.default, (x, wg, wu, wd, "tanh"))
    torch.library.opcheck(geglu.ops.geglu_mlp_train.default,
                          (*[t.clone().requires_grad_() for t in (x, wg, wu, wd)], "none"))
    m, _ = _layer(geglu, 2304, 9216, torch.bfloat16, "tanh", M=8)
    with torch.no_grad():
        for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
            lin.weight.copy_(w)
    sides = set()
    for rows in (xl, x):  # 2048 rows: M*D*H above sm_90's compiled_min_work; 1024: below it
        torch._dynamo.reset()
        f, host = torch.compile(m, fullgraph=True), torch.compile(_HostMLP(m), fullgraph=True)
        with torch.no_grad():
            op = fresh_decisions.traced_op(rows, wg)
            sides.add(op)
            assert torch.equal(f(rows), m(rows) if op else host(rows)), (rows.shape[0], op)
    assert sides == {True, False} or torch.cuda.get_device_capability()[0] != 9, sides
    torch._dynamo.reset()
    f, host = torch.compile(m, fullgraph=True), torch.compile(_HostMLP(m), fullgraph=True)
    ours = _run(_through(f, scale=2), x, *_weights(m), "tanh")
    _assert_equal(ours, _run(_through(host, scale=2), x, *_weights(m), "tanh"), "compiled training, compiled host")
    eager = _run(_through(m, scale=2), x, *_weights(m), "tanh")
    for name, a, b in zip(("y", "dx", "dWg", "dWu", "dWd"), ours, eager):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against eager mode"
