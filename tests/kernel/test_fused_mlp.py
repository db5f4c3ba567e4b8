"""The fused GeGLU MLP (torch-ext/geglu/_fused_mlp.py): gate/up GEMM with the GeGLU in its epilogue, then down_proj.

Without a GPU the Triton kernel runs under the interpreter on CPU tensors at tiny shapes (backend 'triton', the
decode fallback threshold lowered so the fused kernel runs); with one, the same tests run on CUDA, plus the `gpu`
tests at real shapes.

Tolerances. The fused GEMM accumulates in fp32 in its own order, so it cannot be bit-identical to cuBLAS / the CPU
BLAS; what is exact is its epilogue: given its own rounded pre-activations (g, u), its output equals our pointwise
GeGLU of (g, u) bit for bit (checked). End to end, the reference is the same MLP computed in fp32 from the same
bf16/fp16 inputs and weights; eager PyTorch in the storage dtype has an error against it (rounding of every GEMM
output and of the GeGLU steps). Our error must be no worse than 1.5x eager's (Frobenius norm, every output and every
gradient) on CPU at tiny sizes (the ratio of two rounding-noise norms over ~1.5-2.5k elements; measured over 4 seeds,
both dtypes and GELUs: 1.000-1.001 for y, dW_gate, dW_up, dW_down and 0.93-0.99 for dX, whose two K=H GEMMs we
accumulate in fp32 where eager adds two rounded products), and no worse than 1.02x eager's at the real GPU shapes
(millions of elements: the ratio concentrates at 1).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
LOW_DTYPES = [torch.bfloat16, torch.float16]
APPROX = ["none", "tanh"]


@pytest.fixture(scope="module")
def fm(geglu):
    return importlib.import_module(geglu.__name__ + "._fused_mlp")


@pytest.fixture(scope="module")
def kt(geglu):
    return importlib.import_module(geglu.__name__ + "._fused_mlp_triton")


@pytest.fixture
def fused(geglu, fm):
    """The fused kernel for every row count (tiny test shapes included); on CPU through the Triton interpreter."""
    old = fm.DECODE_MAX_M
    fm.DECODE_MAX_M = 0
    if not HAS_CUDA:
        geglu.set_backend("triton")
    try:
        yield fm
    finally:
        fm.DECODE_MAX_M = old
        geglu.set_backend("auto")


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
    leaves = [t.detach().clone().requires_grad_() for t in (x, wg, wu) + ((wd,) if wd is not None else ())]
    y = fn(*leaves[:3], leaves[3] if wd is not None else None, approximate)
    gen = torch.Generator().manual_seed(dy_seed)
    dy = torch.randn(y.shape, generator=gen).to(y.dtype).to(y.device)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def _err(a, ref):
    return (a.double() - ref.double()).norm().item()


def _assert_no_worse(ours, eager, ref32, factor, what=""):
    names = ["y", "dx", "dw_gate", "dw_up", "dw_down"]
    for name, o, e, r in zip(names, ours, eager, ref32):
        eo, ee = _err(o, r), _err(e, r)
        scale = r.double().norm().item() + 1e-30
        assert eo <= factor * ee + 1e-6 * scale, (
            f"{what} {name}: our error vs the fp32 reference is {eo / scale:.3g} (relative), eager's "
            f"{ee / scale:.3g}: ratio {eo / max(ee, 1e-30):.3f} > {factor}")


# --- the epilogue is our pointwise GeGLU, exactly -----------------------------------------------------------------


def _configs(kt):
    if not HAS_CUDA:
        return [None, kt.Config(16, 16, 16, 2, 1, 1, tma=False), kt.Config(16, 16, 16, 2, 1, 1, persistent=True)]
    return [None, kt.Config(64, 128, 64, 8, 4, 3, tma=False), kt.Config(128, 128, 64, 8, 8, 3, persistent=True)]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_epilogue_is_pointwise_geglu_of_its_preactivations(geglu, fused, kt, dtype, approximate):
    """h == geglu(g, u) bit for bit, with (g, u) the kernel's own rounded GEMM outputs; every tile-config family
    (TMA descriptors, pointer loads, persistent grid); ragged M, D, H (partial tiles and K steps)."""
    M, D, H = 40, 40, 48
    x, wg, wu, _ = _data(M, D, H, dtype, down=False)
    ref_g = (x.float() @ wg.float().t())
    for cfg in _configs(kt):
        h, gu = kt.gate_up_geglu(x, wg, wu, approximate == "tanh", True, cfg)
        g, u = gu[:, :H], gu[:, H:]
        assert torch.equal(h, geglu.geglu(g, u, approximate)), f"config {cfg}"
        h2, none = kt.gate_up_geglu(x, wg, wu, approximate == "tanh", False, cfg)
        assert none is None and torch.equal(h2, h), "inference mode (no save) differs from training mode"
        # g is the fp32-accumulated GEMM rounded once: within one unit of the storage dtype's rounding
        ulp = torch.finfo(dtype).eps * ref_g.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((g.float() - ref_g).abs() <= ulp * 1.01).all()


# --- one wide dot over both weights, in place: the paired kernel ------------------------------------------------


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
    accumulation order per output (wgmma's does not depend on N), so bit for bit: h and the saved [g | u], both
    epilogues, whichever weight lies first in memory; ragged M, D, H (partial tiles). Under the interpreter the
    dots are numpy matmuls, whose summation order can change with the width: there the pre-activations may differ
    by one rounding and h by what that propagates to."""
    M, D, H = (40, 48, 40) if not HAS_CUDA else (300, 200, 328)
    x = _data(M, D, H, dtype, down=False)[0]
    tanh = approximate == "tanh"
    for where, (wg, wu) in _weight_pairs(H, D, dtype).items():
        layout = kt.pair_layout(wg, wu)
        assert layout is not None
        assert layout.gate_first == (wg.data_ptr() < wu.data_ptr())
        for fast in (False, True):
            ref_h, ref_gu = kt.gate_up_geglu(x, wg, wu, tanh, True, _pair_cfg(kt, fast_epi=fast))
            h, gu = kt.paired_gate_up_geglu(x, wg, wu, tanh, True, _pair_cfg(kt, fast_epi=fast))
            _same(h, ref_h, gu, ref_gu, f"paired, {where}, fast_epi={fast}")
            h2, gu2 = kt.gate_up_geglu(x, wg, wu, tanh, True, _pair_cfg(kt, fast_epi=fast, pair=True))
            _same(h2, ref_h, gu2, ref_gu, f"gate_up_geglu with pair=True, {where}, fast_epi={fast}")


def _same(h, ref_h, gu, ref_gu, what):
    if HAS_CUDA:
        assert torch.equal(h, ref_h) and torch.equal(gu, ref_gu), what
        return
    eps, tiny = torch.finfo(h.dtype).eps, torch.finfo(h.dtype).tiny  # tiny: subnormals' fixed ulp is below it
    assert ((gu.float() - ref_gu.float()).abs() <= eps * ref_gu.float().abs() + tiny).all(), what
    assert ((h.float() - ref_h.float()).abs() <= 4 * eps * ref_h.float().abs() + tiny).all(), what
    assert (h == ref_h).float().mean() > 0.95, what


def test_pair_layout_refuses_what_one_descriptor_cannot_see(kt):
    """pair_layout names the weights' base and the outer stride, or None: same tensor, different row strides,
    dtypes or shapes, a base off the 16-byte grid, and weights whose rows interleave. Refused pairs still compute right through
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
    got, _ = kt.gate_up_geglu(_data(40, 48, 32, dtype, down=False)[0], rows[0::2], rows[1::2], True, False,
                              _pair_cfg(kt, pair=True))
    assert torch.equal(got, kt.gate_up_geglu(_data(40, 48, 32, dtype, down=False)[0], wg, wu, True, False,
                                             _pair_cfg(kt))[0])
    x = _data(40, 48, 32, dtype, down=False)[0]
    ref, _ = kt.gate_up_geglu(x, wg, wide, True, False, _pair_cfg(kt))
    got, _ = kt.gate_up_geglu(x, wg, wide, True, False, _pair_cfg(kt, pair=True))
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="pair_layout|same-layout"):
        kt.paired_gate_up_geglu(x, wg, wide, True, False, _pair_cfg(kt))


def _exact_grad_data(M, D, H, dtype, seed=3):
    """dY with small integers and W_down with multiples of 1/8: dY @ W_down is exact in fp32 whatever the
    accumulation order, and representable in bf16/fp16, so the fused kernel's d_h equals the reference's bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randint(-3, 4, (M, D), generator=gen).to(dtype).to(DEVICE)
    wd = (torch.randint(-2, 3, (D, H), generator=gen) / 8).to(dtype).to(DEVICE)
    gu = (torch.randn(M, 2 * H, generator=gen) * 2).to(dtype).to(DEVICE)
    return dy, wd, gu


def _bwd_configs(kt):
    if not HAS_CUDA:
        return [None, kt.Config(16, 32, 16, 2, 1, 1, tma=False, epi_split=2),
                kt.Config(16, 64, 16, 2, 1, 1, persistent=True, epi_split=4)]
    return [None, kt.Config(64, 128, 64, 8, 4, 3, tma=False, epi_split=2),
            kt.Config(128, 128, 64, 8, 8, 3, persistent=True, epi_split=4), kt.Config(128, 128, 64, 8, 8, 3)]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_down_dgeglu_epilogue_is_pointwise_backward(geglu, fused, kt, dtype, approximate):
    """The backward kernel: [d_g | d_u] written over [g | u] and the recomputed h equal our pointwise backward and
    forward of the same d_h, g, u bit for bit (d_h exact by construction); every config family; ragged shapes."""
    M, D, H = 40, 32, 48
    dy, wd, gu = _exact_grad_data(M, D, H, dtype)
    d_h = dy.float() @ wd.float()
    assert torch.equal(d_h, d_h.to(dtype).float())  # exact and representable
    ref_dg, ref_du = geglu.geglu_backward(d_h.to(dtype), gu[:, :H], gu[:, H:], approximate)
    ref_h = geglu.geglu(gu[:, :H], gu[:, H:], approximate)
    for cfg in _bwd_configs(kt):
        work = gu.clone()
        h = kt.down_dgeglu(dy, wd, work, approximate == "tanh", True, cfg)
        assert torch.equal(work[:, :H], ref_dg) and torch.equal(work[:, H:], ref_du), f"config {cfg}"
        assert torch.equal(h, ref_h), f"config {cfg}"
        work = gu.clone()
        assert kt.down_dgeglu(dy, wd, work, approximate == "tanh", False, cfg) is None
        assert torch.equal(work[:, :H], ref_dg)
    # the op, both routes (fused kernel here; cuBLAS + pointwise at decode sizes), same results
    work = gu.clone()
    h = geglu.ops.geglu_mlp_down_dgeglu_(dy, wd, work, approximate, True)
    assert torch.equal(work, torch.cat([ref_dg, ref_du], 1)) and torch.equal(h, ref_h)
    fused.DECODE_MAX_M = 64
    work = gu.clone()
    h = geglu.ops.geglu_mlp_down_dgeglu_(dy, wd, work, approximate, True)
    assert torch.equal(work, torch.cat([ref_dg, ref_du], 1)) and torch.equal(h, ref_h)


# --- end to end against eager and an fp32 reference ---------------------------------------------------------------


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("with_down,fused_backward", [(True, False), (False, False), (True, True)])
def test_mlp_forward_backward_vs_fp32_reference(fused, dtype, approximate, with_down, fused_backward, monkeypatch):
    """fused_backward: the dGeGLU in the epilogue of dY @ Wd (h recomputed there for dW_down)."""
    monkeypatch.setattr(fused, "FUSED_BACKWARD", fused_backward)
    M, D, H = 48, 32, 48
    x, wg, wu, wd = _data(M, D, H, dtype, down=with_down)
    ours = _run(fused.fused_geglu_mlp_forward, x, wg, wu, wd, approximate)
    eager = _run(_eager, x, wg, wu, wd, approximate)
    ref32 = _run(_eager, *(t.float() if t is not None else None for t in (x, wg, wu, wd)), approximate)
    assert all(o.dtype == dtype and o.shape == e.shape for o, e in zip(ours, eager))
    _assert_no_worse(ours, eager, ref32, 1.5, f"{dtype} {approximate}")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("fwd,bwd,acc,deriv", [(True, False, False, False), (False, True, False, False),
                                               (True, True, False, False), (False, "gluon", False, False),
                                               (True, "gluon-fast", False, False), (True, "gluon-fast", True, False),
                                               (False, True, True, False), (True, "gluon", False, True),
                                               (True, "gluon-fast", True, True)],
                         ids=["fwd", "bwd", "both", "bwd-gluon", "both-gluon-fast", "both-gluon-fast-acc", "bwd-acc",
                              "both-gluon-deriv", "both-gluon-fast-acc-deriv"])
def test_training_node_with_fused_kernels_vs_fp32_reference(geglu, fused, kt, dtype, approximate, fwd, bwd, acc,
                                                             deriv, monkeypatch):
    """GeGLUMLP's training node (_mlp.py) with FUSED_FORWARD (gate/up GEMM + GeGLU writing g, u, h) and/or
    FUSED_BACKWARD (dY @ Wd + dGeGLU over g, u), ACCUMULATE_DX (dx summed in the second GEMM; with the fused
    forward, dW_gate and dW_up as one GEMM) and SAVE_DERIVATIVE (the forward saves gelu(g), u * gelu'(g); the
    backward's dGeGLU is two products): the fused kernels run (counted), and the output and every gradient are no
    less accurate against an fp32 reference than eager's. FUSED_BACKWARD = "gluon" takes the Gluon kernel on sm_90
    and the Triton kernel where the Gluon one cannot run (CPU: the Triton interpreter; there SAVE_DERIVATIVE is
    ignored)."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    monkeypatch.setattr(mlp, "FUSED_FORWARD", fwd)
    monkeypatch.setattr(mlp, "FUSED_BACKWARD", bwd)
    monkeypatch.setattr(mlp, "ACCUMULATE_DX", acc)
    monkeypatch.setattr(mlp, "SAVE_DERIVATIVE", deriv)
    calls = []
    M, D, H = 48, 32, 48
    x, wg, wu, wd = _data(M, D, H, dtype)
    ws = mlp._gluon_backward(x.device) if bwd in ("gluon", "gluon-fast") else None  # the Gluon kernel where it runs
    for mod, name in ((kt, "gate_up_geglu"), (kt, "down_dgeglu_into"), (ws, "down_dgeglu_ws")):
        if mod is not None:
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    ours = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x.view(3, 16, D), wg, wu, wd, approximate)
    bwd_kernel = "down_dgeglu_ws" if ws is not None else "down_dgeglu_into"
    assert calls == ["gate_up_geglu"] * fwd + [bwd_kernel] * bool(bwd)
    eager = _run(_eager, x.view(3, 16, D), wg, wu, wd, approximate)
    ref32 = _run(_eager, *(t.float() for t in (x.view(3, 16, D), wg, wu, wd)), approximate)
    assert all(o.dtype == dtype and o.shape == e.shape for o, e in zip(ours, eager))
    _assert_no_worse(ours, eager, ref32, 1.5, f"{dtype} {approximate} fwd={fwd} bwd={bwd} acc={acc} deriv={deriv}")


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_accumulated_dx_is_one_rounding_of_both_terms(geglu, dtype, monkeypatch):
    """ACCUMULATE_DX without fused kernels: the output and the three weight gradients are eager's bits (same GEMM
    calls), and dx, the second GEMM accumulated onto the first by addmm_ (on the CPU one rounding fewer than eager's
    bf16 add; cuBLAS may round as eager does), is at least as close to the fp32 reference as eager's."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    monkeypatch.setattr(mlp, "ACCUMULATE_DX", True)
    M, D, H = 40, 24, 56
    x, wg, wu, wd = _data(M, D, H, dtype)
    ours = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, "tanh")
    monkeypatch.setattr(mlp, "ACCUMULATE_DX", False)
    eager_node = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, "tanh")
    for name, a, b in zip(["y", "dWg", "dWu", "dWd"], (ours[0],) + tuple(ours[2:]), (eager_node[0],) + tuple(eager_node[2:])):
        assert torch.equal(a, b), name
    ref32 = _run(_eager, *(t.float() for t in (x, wg, wu, wd)), "tanh")
    err = lambda o: ((o[1].double() - ref32[1].double()).norm() / ref32[1].double().norm()).item()  # noqa: E731
    assert err(ours) <= err(eager_node) * 1.05, (err(ours), err(eager_node))


@pytest.mark.parametrize("fast_epi", [False, True], ids=["epi", "fast-epi"])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_saved_derivative_factors(kt, dtype, approximate, fast_epi):
    """gate_up_geglu(..., deriv=True) saves [gelu(g) | u * gelu'(g)] of the fp32 pre-activations, each rounded once:
    against fp64 both are within the storage dtype's rounding of the exact values (elementwise, relative to the
    factor's scale); with the fast epilogue h is the plain save's, bit for bit (both from the fp32 accumulators)."""
    M, D, H = 40, 48, 56
    x, wg, wu, _ = _data(M, D, H, dtype)
    tanh = approximate == "tanh"
    cfg = (kt.INTERPRETER if kt.INTERPRET else kt.MEDIUM)._replace(fast_epi=fast_epi)
    h2, factors = kt.gate_up_geglu(x, wg, wu, tanh, True, config=cfg, deriv=True)
    h1, _ = kt.gate_up_geglu(x, wg, wu, tanh, True, config=cfg)
    if fast_epi:
        assert torch.equal(h1, h2)
    g64 = x.double() @ wg.double().t()
    u64 = x.double() @ wu.double().t()
    gg = g64.clone().requires_grad_()
    a64 = F.gelu(gg, approximate=approximate)
    (gp64,) = torch.autograd.grad(a64.sum(), gg)
    eps = torch.finfo(dtype).eps
    for name, got, want in (("gelu(g)", factors[:, :H], a64.detach()), ("u * gelu'(g)", factors[:, H:], u64 * gp64)):
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err <= 2 * eps, f"{name}: max error {err:.2e} of its scale (eps {eps:.1e})"


@pytest.mark.parametrize("acc", [False, True], ids=["", "acc"])
@pytest.mark.parametrize("approximate", APPROX)
def test_saved_derivative_products_fallback(geglu, fused, kt, approximate, acc, monkeypatch):
    """SAVE_DERIVATIVE where the forward saved the derivative factors but the Gluon kernel then cannot take the
    backward (a TMA-unaligned tensor): d_h from torch.mm and the two products in place (d_g and d_u end up in each
    other's buffers, so ACCUMULATE_DX takes two weight-gradient GEMMs). Runs anywhere: the Gluon module is a stand-in
    that must not be called, and the alignment check says no. Output and gradients no less accurate than eager's."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    for name, value in (("FUSED_FORWARD", True), ("FUSED_BACKWARD", "gluon"), ("SAVE_DERIVATIVE", True),
                        ("ACCUMULATE_DX", acc)):
        monkeypatch.setattr(mlp, name, value)

    class _NoGluon:
        @staticmethod
        def down_dgeglu_ws(*a, **k):
            raise AssertionError("the Gluon kernel ran on unaligned tensors")

    monkeypatch.setattr(mlp, "_gluon_backward", lambda dev: _NoGluon)
    saves = []
    real_fwd = kt.gate_up_geglu
    monkeypatch.setattr(kt, "gate_up_geglu", lambda *a, **k: saves.append(k.get("deriv")) or real_fwd(*a, **k))
    real_aligned = kt._aligned
    monkeypatch.setattr(kt, "_aligned", lambda t: False if t.dim() == 2 and t.shape[1] == 32 else real_aligned(t))
    x, wg, wu, wd = _data(48, 32, 48, torch.bfloat16)  # dY [48, 32] is the tensor "not aligned"
    ours = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, approximate)
    assert saves == [True]  # the forward saved gelu(g), u * gelu'(g)
    eager = _run(_eager, x, wg, wu, wd, approximate)
    ref32 = _run(_eager, *(t.float() for t in (x, wg, wu, wd)), approximate)
    _assert_no_worse(ours, eager, ref32, 1.5, f"deriv fallback {approximate} acc={acc}")


def test_packed_gradient_view(geglu):
    """`_packed` sees [d_g | d_u] as one [M, 2H] tensor only when they are the column halves of one buffer, in that
    order (then dW_gate and dW_up are one GEMM); separate buffers or the halves swapped give None."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    gu = torch.randn(5, 12)
    packed = mlp._packed(gu[:, :6], gu[:, 6:])
    assert packed is not None and torch.equal(packed, gu)
    assert mlp._packed(gu[:, 6:], gu[:, :6]) is None
    assert mlp._packed(torch.randn(5, 6), torch.randn(5, 6)) is None
    assert mlp._packed(gu[:, :4], gu[:, 4:8]) is None  # not halves of the row


class _GluonStandIn:
    """The Gluon backward's deriv epilogue in torch (for machines without the kernel): d_h = dY @ Wd rounded to the
    storage dtype as the kernel's accumulator is, then d_gate = d_h * (u * gelu'(g)) over the first buffer and
    d_up = d_h * gelu(g) over the second, each product in fp32 and rounded once."""

    def __init__(self):
        self.calls = []

    def down_dgeglu_ws(self, dy, w_down, a, b, tanh, fast=False, deriv=False):
        self.calls.append(deriv)
        assert deriv, "FUSED_TRAINING saves the derivative factors: the backward must take the deriv epilogue"
        dh = (dy.float() @ w_down.float()).to(dy.dtype).float()
        fa, fb = a.float(), b.float()
        a.copy_(dh * fb)
        b.copy_(dh * fa)


@pytest.mark.parametrize("approximate", APPROX)
def test_fused_training_switch_takes_the_gluon_combination(geglu, fused, kt, approximate, monkeypatch):
    """FUSED_TRAINING (GEGLU_FUSED_TRAINING=1) where the Gluon backward runs: the fused forward saves the derivative
    factors, the Gluon kernel's deriv epilogue takes dY @ Wd, x's gradient is accumulated in one GEMM, whatever the
    four separate flags say; output and gradients no less accurate against fp32 than eager's. On sm_90 the real
    Gluon kernel runs, elsewhere a torch stand-in of its epilogue."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    for name in ("FUSED_FORWARD", "FUSED_BACKWARD", "SAVE_DERIVATIVE", "ACCUMULATE_DX"):
        monkeypatch.setattr(mlp, name, False)
    monkeypatch.setattr(mlp, "FUSED_TRAINING", True)
    x, wg, wu, wd = _data(48, 32, 48, torch.bfloat16)
    ws = mlp._gluon_backward(x.device)
    calls = []
    if ws is None:
        ws = _GluonStandIn()
        monkeypatch.setattr(mlp, "_gluon_backward", lambda dev: ws)
    else:
        real_ws = ws.down_dgeglu_ws
        monkeypatch.setattr(ws, "down_dgeglu_ws", lambda *a, **k: calls.append(("bwd", k.get("deriv")))
                            or real_ws(*a, **k))
    real_fwd = kt.gate_up_geglu
    monkeypatch.setattr(kt, "gate_up_geglu", lambda *a, **k: calls.append(("fwd", k.get("deriv")))
                        or real_fwd(*a, **k))
    accumulated = []
    real_acc = mlp._grads_accumulated
    monkeypatch.setattr(mlp, "_grads_accumulated", lambda *a: accumulated.append(1) or real_acc(*a))
    ours = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, approximate)
    if isinstance(ws, _GluonStandIn):
        calls += [("bwd", d) for d in ws.calls]
    assert calls == [("fwd", True), ("bwd", True)] and accumulated == [1]
    eager = _run(_eager, x, wg, wu, wd, approximate)
    ref32 = _run(_eager, *(t.float() for t in (x, wg, wu, wd)), approximate)
    _assert_no_worse(ours, eager, ref32, 1.5, f"FUSED_TRAINING {approximate}")


def test_fused_training_switch_elsewhere_is_the_default_node(geglu, fused, kt, monkeypatch):
    """FUSED_TRAINING where the Gluon backward cannot run: the step is the default node's, bit for bit (there the
    fused Triton backward is slower than cuBLAS + our dGeGLU), and no fused kernel runs."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    monkeypatch.setattr(mlp, "_gluon_backward", lambda dev: None)
    monkeypatch.setattr(kt, "gate_up_geglu", lambda *a, **k: pytest.fail("the fused forward ran"))
    x, wg, wu, wd = _data(48, 32, 48, torch.bfloat16)
    monkeypatch.setattr(mlp, "FUSED_TRAINING", False)
    default = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, "tanh")
    monkeypatch.setattr(mlp, "FUSED_TRAINING", True)
    switched = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, "tanh")
    for name, a, b in zip(["y", "dx", "dWg", "dWu", "dWd"], switched, default):
        assert torch.equal(a, b), name


def test_fused_training_setting(geglu):
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    assert not mlp._switch(None) and not mlp._switch("") and not mlp._switch("0") and not mlp._switch(" off ")
    assert mlp._switch("1") and mlp._switch("true")
    with pytest.raises(ValueError, match="GEGLU_FUSED_TRAINING='fast'.*expected 1"):
        mlp._switch("fast")


def test_training_node_rejects_an_unknown_fused_backward(geglu, fused, kt, monkeypatch):
    """A misspelt FUSED_BACKWARD is an error that lists the accepted values, not a silent choice of kernel."""
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    monkeypatch.setattr(mlp, "FUSED_BACKWARD", "glu0n")
    x, wg, wu, wd = _data(48, 32, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="'gluon' or 'gluon-fast'"):
        _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, "tanh")


def test_leading_dims_and_inference_mode(geglu, fused):
    """x [B, T, D] works; under no_grad nothing is saved and the output equals the training-mode output."""
    x, wg, wu, wd = _data(2 * 9, 32, 48, torch.bfloat16)
    x3 = x.view(2, 9, 32)
    with torch.no_grad():
        y = fused.fused_geglu_mlp_forward(x3, wg, wu, wd, "tanh")
        y2, gu, h = geglu.ops.geglu_mlp_fused(x3, wg, wu, wd, "tanh", False)
    assert y.shape == (2, 9, 32) and gu.numel() == 0 and h.numel() == 0 and torch.equal(y, y2)
    y3, gu3, h3 = geglu.ops.geglu_mlp_fused(x3, wg, wu, wd, "tanh", True)
    assert torch.equal(y3, y) and gu3.shape == (18, 96) and h3.shape == (18, 48)


def test_decode_fallback_matches_fused_epilogue(geglu, fm):
    """M <= DECODE_MAX_M runs the matmuls + our pointwise GeGLU: same epilogue rounding, so its output equals
    the pointwise GeGLU of its own pre-activations (what the fused path also guarantees)."""
    x, wg, wu, _ = _data(8, 32, 48, torch.bfloat16, down=False)
    assert 8 <= fm.DECODE_MAX_M
    h, gu, _ = geglu.ops.geglu_mlp_fused(x, wg, wu, None, "none", True)
    assert torch.equal(h, geglu.geglu(gu[:, :48], gu[:, 48:], "none"))
    assert torch.equal(gu[:, :48], F.linear(x, wg)) and torch.equal(gu[:, 48:], F.linear(x, wu))


def test_expanded_gradient(fused):
    """A gradient expanded along rows (stride 0, from y.sum(0)) is made contiguous before the kernels see it (TMA
    descriptors need positive strides: only the GPU run can fail without it; the interpreter accepts stride 0)."""
    x, wg, wu, wd = _data(24, 32, 48, torch.bfloat16)
    for fused_backward in (False, True):
        fused.FUSED_BACKWARD = fused_backward
        try:
            w = torch.randn(32).to(torch.bfloat16).to(DEVICE)
            leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
            y = fused.fused_geglu_mlp_forward(*leaves, "tanh")
            (y.sum(0) * w).sum().backward()  # dy = w expanded along rows: strides (0, 1)
            ref = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
            y = fused.fused_geglu_mlp_forward(*ref, "tanh")
            y.backward(w.expand(y.shape).contiguous())
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, ref))
        finally:
            fused.FUSED_BACKWARD = False


def test_fp32_uses_full_precision_fallback(geglu, fm):
    x, wg, wu, wd = _data(80, 32, 48, torch.float32)
    y = fm.fused_geglu_mlp_forward(x, wg, wu, wd, "none")
    assert torch.allclose(y, _eager(x, wg, wu, wd, "none"), rtol=1e-5, atol=1e-5)


def test_bad_input(fm):
    x, wg, wu, wd = _data(4, 32, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="approximate"):
        fm.fused_geglu_mlp_forward(x, wg, wu, wd, "erf")
    with pytest.raises(ValueError, match=r"\[H, D\]"):
        fm.fused_geglu_mlp_forward(x, wg, wu[:, :16], wd)
    with pytest.raises(ValueError, match="D=16 features"):
        fm.fused_geglu_mlp_forward(x[:, :16], wg, wu, wd)
    with pytest.raises(ValueError, match="w_down"):
        fm.fused_geglu_mlp_forward(x, wg, wu, wd.t())
    with pytest.raises(ValueError, match="dtype"):
        fm.fused_geglu_mlp_forward(x, wg.half(), wu, wd)
    assert fm.use_fused(8192, 4096, 14336, torch.bfloat16, "cuda") is False


# --- torch.library contract ---------------------------------------------------------------------------------------


def test_opcheck(geglu, fused):
    op = geglu.ops.geglu_mlp_fused.default
    x, wg, wu, wd = _data(24, 32, 48, torch.bfloat16)
    torch.library.opcheck(op, (x, wg, wu, wd, "tanh", False))
    torch.library.opcheck(op, (x.view(2, 12, 32), wg, wu, None, "none", False))
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    # Training sample: the eager backward deliberately overwrites the internal `gu` output with [d_g | d_u] (no
    # second [M, 2H] buffer), which test_aot_dispatch_dynamic reports as an output mismatch after its backward.
    # Forward and gradients under AOTAutograd are checked against eager by test_compile_fullgraph instead.
    torch.library.opcheck(op, (*leaves, "none", True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(op, (*leaves, "tanh", True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    dy, wd2, gu = _exact_grad_data(24, 32, 48, torch.bfloat16)
    torch.library.opcheck(geglu.ops.geglu_mlp_down_dgeglu_.default, (dy, wd2, gu, "tanh", True))
    torch.library.opcheck(geglu.ops.geglu_mlp_down_dgeglu_.default, (dy, wd2, gu, "none", False))


@pytest.mark.parametrize("fused_backward", [False, True])
def test_compile_fullgraph(geglu, fused, fused_backward, monkeypatch):
    """No graph break through forward and backward (fullgraph=True); results equal the eager call of the same op."""
    monkeypatch.setattr(fused, "FUSED_BACKWARD", fused_backward)
    torch._dynamo.reset()
    x, wg, wu, wd = _data(32, 32, 48, torch.bfloat16)
    backend = "inductor" if HAS_CUDA else "aot_eager"
    f = torch.compile(lambda x, wg, wu, wd, a: fused.fused_geglu_mlp_forward(x, wg, wu, wd, a), fullgraph=True,
                      backend=backend)
    ours = _run(f, x, wg, wu, wd, "tanh")
    ref = _run(fused.fused_geglu_mlp_forward, x, wg, wu, wd, "tanh")
    for o, r in zip(ours, ref):
        assert torch.equal(o, r) if not HAS_CUDA else torch.allclose(o.float(), r.float(), rtol=1e-2, atol=1e-3)
    with torch.no_grad():
        assert torch.equal(f(x, wg, wu, wd, "tanh"), fused.fused_geglu_mlp_forward(x, wg, wu, wd, "tanh"))


# --- GPU, real shapes ---------------------------------------------------------------------------------------------

GPU_SHAPES = [(8192, 2304, 9216), (8192, 4096, 14336), (16, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("fused_backward", [False, True])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("M,D,H", GPU_SHAPES)
def test_gpu_real_shapes_vs_fp32_reference(geglu, fm, M, D, H, approximate, fused_backward, monkeypatch):
    """bf16 at the benchmark shapes (the last one is decode: the cuBLAS + pointwise fallback): forward and every
    gradient no worse than eager bf16 (cuBLAS) against the fp32 reference (TF32 off), and the epilogue equal to
    the pointwise GeGLU of the kernel's own pre-activations. fused_backward: the dGeGLU in dY @ Wd's epilogue."""
    monkeypatch.setattr(fm, "FUSED_BACKWARD", fused_backward)
    torch.backends.cuda.matmul.allow_tf32 = False
    x, wg, wu, wd = _data(M, D, H, torch.bfloat16, device="cuda")
    ours = _run(fm.fused_geglu_mlp_forward, x, wg, wu, wd, approximate)
    eager = _run(_eager, x, wg, wu, wd, approximate)
    ref32 = _run(_eager, x.float(), wg.float(), wu.float(), wd.float(), approximate)
    for name, o, e, r in zip(["y", "dx", "dw_gate", "dw_up", "dw_down"], ours, eager, ref32):
        scale = r.double().norm().item()
        print(f"{M}x{D}x{H} {approximate} fused_bwd={fused_backward} {name}: ours {_err(o, r) / scale:.3e} "
              f"eager {_err(e, r) / scale:.3e}")
    _assert_no_worse(ours, eager, ref32, 1.02, f"{M}x{D}x{H} {approximate}")
    del ours, eager, ref32
    with torch.no_grad():
        h, gu, _ = geglu.ops.geglu_mlp_fused(x, wg, wu, None, approximate, True)
        assert torch.equal(h, geglu.geglu(gu[:, :H], gu[:, H:], approximate))


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("M,D,H", [(1000, 320, 1000), (1000, 320, 4000), (4096, 2304, 9216)])
def test_gpu_warp_specialised_backward_equals_pointwise(geglu, kt, M, D, H, dtype, approximate):
    """The experimental Gluon kernel (_gluon_bwd.py: a TMA producer warp and two consumer warpgroups taking
    alternate tiles): d_g, d_u written over g, u equal our pointwise backward of the same d_h bit for bit (d_h exact
    by construction), at ragged sizes (one tile a program, then two: both warpgroups) and at a benchmark size, for 3
    and 4 stages, the epilogue's chunks unrolled and in a runtime loop, one or two warpgroups a consumer; and with
    ``deriv`` (g, u holding the forward's derivative factors) the two products d_h * u, d_h * g, each rounded once."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is written for sm_90 (wgmma, TMA)")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    dy, wd, gu = _exact_grad_data(M, D, H, dtype)
    g0, u0 = gu[:, :H].contiguous(), gu[:, H:].contiguous()
    d_h = (dy.float() @ wd.float()).to(dtype)
    ref_dg, ref_du = geglu.geglu_backward(d_h, g0, u0, approximate)
    variants = [dict(), dict(stages=3), dict(chunk=16), dict(loop_chunks=False),
                dict(chunk=16, consumer_warps=8, consumer_regs=120)]
    for v in variants:
        g, u = g0.clone(), u0.clone()
        ws.down_dgeglu_ws(dy, wd, g, u, approximate == "tanh", **v)
        torch.cuda.synchronize()
        assert torch.equal(g, ref_dg) and torch.equal(u, ref_du), (
            f"{v}: max diff d_g "
            f"{(g.float() - ref_dg.float()).abs().max()}, d_u {(u.float() - ref_du.float()).abs().max()}")
    # deriv: g, u taken as the forward's factors [gelu(g) | u * gelu'(g)]; the epilogue is two products
    g, u = g0.clone(), u0.clone()
    ws.down_dgeglu_ws(dy, wd, g, u, approximate == "tanh", deriv=True)
    torch.cuda.synchronize()
    assert torch.equal(g, (d_h.float() * u0.float()).to(dtype)) and torch.equal(u, (d_h.float() * g0.float()).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("save", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("M,D,H", [(1000, 320, 1000), (2048, 320, 2048), (4096, 2304, 9216)])
def test_gpu_gluon_forward_epilogue_warps(geglu, M, D, H, dtype, approximate, save):
    """The experimental Gluon gate/up kernel (_gluon_fwd.py: the GeGLU in its own warps, under the next tile's main
    loop). On data whose GEMMs are exact in fp32 whatever the accumulation order (x in {-1, 0, 1}, weights multiples
    of 1/64), its g, u (``save``) are the exact pre-activations rounded to the storage dtype, bit for bit; h is the
    GeGLU of those in fp32 rounded once: the erf GELU bit for bit against torch's fp32 gelu, the tanh one (hardware
    exp2 / reciprocal approximations) within one unit in the last place of the fp64 GeGLU of the same g, u. Ragged sizes (masked stores),
    one tile a program, then several (the staging buffer's hand-over between the warps, tile after tile)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is written for sm_90 (wgmma, TMA)")
    gf = importlib.import_module(geglu.__name__ + "._gluon_fwd")
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-1, 2, (M, D), generator=gen).to(dtype).cuda()
    wg, wu = ((torch.randint(-2, 3, (H, D), generator=gen) / 64).to(dtype).cuda() for _ in range(2))
    g = (x.float() @ wg.float().t()).to(dtype)
    u = (x.float() @ wu.float().t()).to(dtype)
    assert g.float().std() > 0.2  # the GELU's curved region, not only its linear tails
    h, gu = gf.gate_up_geglu_ws(x, wg, wu, approximate == "tanh", save)
    torch.cuda.synchronize()
    if save:
        assert torch.equal(gu[:, :H], g) and torch.equal(gu[:, H:], u)
    else:
        assert gu is None
    if approximate == "none":
        want = (F.gelu(g.float()) * u.float()).to(dtype)
        assert torch.equal(h, want), f"max diff {(h.float() - want.float()).abs().max()}"
    else:
        # against the fp64 GeGLU of the same g, u: within one unit in the last place of the exact value (h is an
        # fp32 value ~1e-6 off, rounded once)
        ref = F.gelu(g.double(), approximate="tanh") * u.double()
        diff = (h.double() - ref).abs()
        ulp = ref.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
        bad = diff > ulp
        if bad.any():
            i = bad.flatten().nonzero()[0].item()
            pytest.fail(f"{int(bad.sum())} of {h.numel()} elements more than one ulp from the fp64 GeGLU; e.g. g "
                        f"{g.flatten()[i].item()!r} u {u.flatten()[i].item()!r}: h {h.flatten()[i].item()!r}, fp64 "
                        f"{ref.flatten()[i].item()!r}, torch fp32 "
                        f"{(F.gelu(g.flatten()[i:i + 1].float(), approximate='tanh') * u.flatten()[i].float()).item()!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("M,D,H", [(1000, 320, 1000), (4096, 2304, 9216)])
def test_gpu_warp_specialised_fast_backward_vs_fp64(geglu, kt, M, D, H, approximate):
    """The Gluon kernel's fast dGeGLU (`fast=True`, tanh GELU): d_g and d_u against an fp64 reference from the same
    bf16 dY, Wd, g, u are no less accurate than the exact kernel's (eager's rounding), in norm and at the worst
    element; with the erf GELU `fast` changes nothing (bit for bit)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is written for sm_90 (wgmma, TMA)")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    x, wg, wu, wd = _data(M, D, H, torch.bfloat16, device="cuda")  # wd [D, H] (nn.Linear(H, D)): d_h = dy @ wd
    g0, u0 = F.linear(x, wg), F.linear(x, wu)
    dy = torch.randn(M, D, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").bfloat16()
    out = {}
    for fast in (False, True):
        g, u = g0.clone(), u0.clone()
        ws.down_dgeglu_ws(dy, wd, g, u, approximate == "tanh", fast=fast)
        out[fast] = (g, u)
    if approximate == "none":
        assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
        return
    dh = dy.double() @ wd.double()
    gg = g0.double().requires_grad_()
    ref_dg = torch.autograd.grad(F.gelu(gg, approximate="tanh"), gg, dh * u0.double())[0]
    ref_du = dh * F.gelu(g0.double(), approximate="tanh")
    for name, i, ref in (("d_g", 0, ref_dg), ("d_u", 1, ref_du)):
        exact, fast = out[False][i].double(), out[True][i].double()
        e_exact, e_fast = (exact - ref).norm().item(), (fast - ref).norm().item()
        m_exact, m_fast = (exact - ref).abs().max().item(), (fast - ref).abs().max().item()
        print(f"{M}x{D}x{H} {name}: rel err fast {e_fast / ref.norm().item():.3e} exact {e_exact / ref.norm().item():.3e}; "
              f"max abs fast {m_fast:.3e} exact {m_exact:.3e}")
        assert e_fast <= e_exact * 1.001 and m_fast <= m_exact * 1.1, name

@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
def test_gpu_training_node_saved_derivative_unaligned_dy(geglu, kt, approximate, monkeypatch):
    """SAVE_DERIVATIVE with the Gluon backward, but a dY the Gluon kernel cannot take (not 16-byte aligned): the
    forward has already saved the derivative factors, so the node takes cuBLAS's d_h and two products (the Gluon
    kernel does not run), and the output and every gradient are still no less accurate than eager's."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is written for sm_90 (wgmma, TMA)")
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    for name, value in (("FUSED_FORWARD", True), ("FUSED_BACKWARD", "gluon"), ("SAVE_DERIVATIVE", True)):
        monkeypatch.setattr(mlp, name, value)
    calls = []
    real = ws.down_dgeglu_ws
    monkeypatch.setattr(ws, "down_dgeglu_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    M, D, H = 1000, 320, 1000
    x, wg, wu, wd = _data(M, D, H, torch.bfloat16, device="cuda")

    def run(fn, *args):
        leaves = [t.detach().clone().requires_grad_() for t in args]
        y = fn(*leaves, approximate)
        buf = torch.randn(y.numel() + 1, generator=torch.Generator().manual_seed(1)).to(y.dtype).to(y.device)
        dy = buf[1:].view(y.shape)  # 2 bytes past an aligned start
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    ours = run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd)
    assert not calls
    eager = run(_eager, x, wg, wu, wd)
    ref32 = run(_eager, *(t.float() for t in (x, wg, wu, wd)))
    _assert_no_worse(ours, eager, ref32, 1.5, f"unaligned dy {approximate}")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("M,D,H", [(1000, 320, 1000), (2048, 2304, 9216)])
def test_gpu_training_node_gluon_backward_equals_triton(geglu, kt, M, D, H, approximate, monkeypatch):
    """GeGLUMLP's training node with FUSED_BACKWARD = "gluon" runs the Gluon kernel (counted) and gives the output
    and every gradient of FUSED_BACKWARD = True (the Triton kernel) bit for bit, on fresh random bf16 data."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is written for sm_90 (wgmma, TMA)")
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    calls = []
    real = ws.down_dgeglu_ws
    monkeypatch.setattr(ws, "down_dgeglu_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, wg, wu, wd = _data(M, D, H, torch.bfloat16, device="cuda")
    results = {}
    for mode in (True, "gluon"):
        monkeypatch.setattr(mlp, "FUSED_BACKWARD", mode)
        results[mode] = _run(lambda *a: mlp.GeGLUMLPFunction.apply(*a), x, wg, wu, wd, approximate)
    assert len(calls) == 1
    for name, a, b in zip(["y", "dx", "dw_gate", "dw_up", "dw_down"], results[True], results["gluon"]):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.gpu
def test_gpu_opcheck_and_compile_real_shape(geglu, fm):
    x, wg, wu, wd = _data(1024, 2304, 9216, torch.bfloat16, device="cuda")
    op = geglu.ops.geglu_mlp_fused.default
    torch.library.opcheck(op, (x, wg, wu, wd, "tanh", False))
    # training sample: as in test_opcheck, the backward overwrites the internal `gu` output on purpose, which
    # test_aot_dispatch_dynamic reports as a mismatch (H200 run); the compile check below covers AOTAutograd.
    torch.library.opcheck(op, (*[t.clone().requires_grad_() for t in (x, wg, wu, wd)], "none", True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch._dynamo.reset()
    f = torch.compile(fm.fused_geglu_mlp_forward, fullgraph=True)
    ours = _run(lambda *a: f(*a), x, wg, wu, wd, "tanh")
    ref = _run(fm.fused_geglu_mlp_forward, x, wg, wu, wd, "tanh")
    assert torch.equal(ours[0], ref[0])
    for o, r in zip(ours[1:], ref[1:]):
        assert torch.allclose(o.float(), r.float(), rtol=2e-2, atol=1e-2)


# --- the fast epilogue and GeGLUMLP's opt-in inference path -------------------------------------------------------


def _fp64_h(x, wg, wu, approximate):
    x64 = x.double()
    return F.gelu(x64 @ wg.double().t(), approximate=approximate) * (x64 @ wu.double().t())


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_fast_epilogue_is_more_accurate_than_eager(fused, kt, dtype, approximate):
    """fast_epi: the GeGLU of the fp32 accumulators, rounded once (hardware exp2/rcp for tanh on a GPU): its error
    against an fp64 reference is no larger than eager's (which rounds g, u and gelu(g) to the storage dtype)."""
    x, wg, wu, _ = _data(96, 64, 80, dtype, down=False, seed=5)
    base = kt.INTERPRETER if kt.INTERPRET else kt.FAST_LARGE
    ref = _fp64_h(x, wg, wu, approximate)
    eager = _err(_eager(x, wg, wu, None, approximate), ref)
    for pair in (False, True):  # the two-accumulator kernel and the paired one (the inference path's, M > 256)
        h, _ = kt.gate_up_geglu(x, wg, wu, approximate == "tanh", False, base._replace(fast_epi=True, pair=pair))
        ours = _err(h, ref)
        assert ours <= eager, f"fast epilogue (pair={pair}) error {ours:.3g} > eager's {eager:.3g}"


def _mlp_layer(geglu, D, H, dtype, approximate, seed=6):
    x, wg, wu, wd = _data(96, D, H, dtype, seed=seed)
    m = geglu.layers.GeGLUMLP()
    m.gate_proj, m.up_proj = torch.nn.Linear(D, H, bias=False), torch.nn.Linear(D, H, bias=False)
    m.down_proj = torch.nn.Linear(H, D, bias=False)
    m.act_fn = torch.nn.GELU(approximate=approximate)
    m.to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
            lin.weight.copy_(w)
    return m, x


def test_fused_mlp_setting(fm):
    assert fm._enabled(None) and fm._enabled("1") and fm._enabled(" on ")
    assert not fm._enabled("0") and not fm._enabled("false")
    with pytest.raises(ValueError, match="GEGLU_FUSED_MLP='maybe'.*expected 1"):
        fm._enabled("maybe")


def test_geglumlp_fused_inference_default_and_inference_only(geglu, fused, kt, monkeypatch):
    """fm.ENABLED (on unless GEGLU_FUSED_MLP=0): GeGLUMLP's inference forward takes the fused kernel where the
    per-shape decision says it is faster (set here by hand; on a GPU it is timed), and nowhere else: not when
    turned off, with a gradient to record, where the decision says no, or with a Linear that is not plain."""
    D, H, dtype, approximate = 32, 48, torch.bfloat16, "tanh"
    m, x = _mlp_layer(geglu, D, H, dtype, approximate)
    calls = []
    real = fused.fused_geglu_mlp_forward
    monkeypatch.setattr(fused, "fused_geglu_mlp_forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fused, "_DECISIONS", {(kt.m_bucket(x.shape[0]), D, H, dtype, x.device): True})

    def regular():
        return m.down_proj(geglu.geglu(m.gate_proj(x), m.up_proj(x), approximate))

    with torch.no_grad():
        monkeypatch.setattr(fused, "ENABLED", False)
        assert torch.equal(m(x), regular()) and not calls  # turned off
        monkeypatch.setattr(fused, "ENABLED", True)
        y = m(x)
        assert calls == [1]
        ref = F.linear(_fp64_h(x, m.gate_proj.weight, m.up_proj.weight, approximate), m.down_proj.weight.double())
        eager = _eager(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, approximate)
        assert _err(y, ref) <= 1.5 * _err(eager, ref)
        fused._DECISIONS[next(iter(fused._DECISIONS))] = False  # measured slower: the regular path
        assert torch.equal(m(x), regular()) and calls == [1]
        fused._DECISIONS[next(iter(fused._DECISIONS))] = True
        m.down_proj.register_forward_hook(lambda *a: None)  # a hooked Linear must run as a module
        assert torch.equal(m(x), regular()) and calls == [1]
    m.down_proj._forward_hooks.clear()
    y = m(x)  # a gradient to record: the regular, differentiable path
    assert y.requires_grad and calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
def test_gpu_geglumlp_inference_times_once_per_shape(geglu, fm, kt, approximate, monkeypatch):
    """On a GPU, the first inference call of a shape times fused against cuBLAS + pointwise and remembers the
    answer; later calls of that shape bucket reuse it (no timing, no recompile); whichever path runs, the output
    is no less accurate than eager's; during CUDA-graph capture an undecided shape takes the regular path."""
    monkeypatch.setattr(fm, "ENABLED", True)
    monkeypatch.setattr(fm, "_DECISIONS", {})
    monkeypatch.setattr(fm, "DECISION_TIMES", {})
    monkeypatch.setattr(kt, "TUNED", {})
    m, x = _mlp_layer(geglu, 256, 1024, torch.bfloat16, approximate)
    with torch.no_grad():
        y = m(x)
        assert len(fm._DECISIONS) == 1
        times = fm.DECISION_TIMES[next(iter(fm._DECISIONS))]  # the medians it compared, recorded with the decision
        assert times["fused_ms"] > 0 and times["regular_ms"] > 0
        assert fm._DECISIONS[next(iter(fm._DECISIONS))] == (times["fused_ms"] < fm._MARGIN * times["regular_ms"])
        monkeypatch.setattr(fm, "_fused_is_faster", lambda *a, **k: pytest.fail("timed twice"))
        assert torch.equal(m(x), y)
        eager = _eager(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, approximate)
        ref = F.linear(_fp64_h(x, m.gate_proj.weight, m.up_proj.weight, approximate), m.down_proj.weight.double())
        assert _err(y, ref) <= 1.02 * _err(eager, ref)
        print(f"decision at 96x256x1024 {approximate}: fused={next(iter(fm._DECISIONS.values()))}; "
              f"error {_err(y, ref):.3e} vs eager {_err(eager, ref):.3e}")
        fm._DECISIONS.clear()
        regular = m.down_proj(geglu.geglu(m.gate_proj(x), m.up_proj(x), approximate))
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m.down_proj(geglu.geglu(m.gate_proj(x), m.up_proj(x), approximate))  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            yg = m(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, regular) and not fm._DECISIONS
