"""Gemma's RMSNorm: ``geglu.rms_norm`` (the op, its eager paths, autograd) and the ``GemmaRMSNorm`` hub layer.

The reference is the host module's forward (transformers' ``Gemma3RMSNorm``, transcribed in ``host`` and checked
against the class itself) and, for the bounds, the same formula in fp64 on the same inputs with eager's fp32
rounding of the scale ``offset + w`` and of eps (docs/rmsnorm.md):

* CPU implementation: bit-exact with the host module, forward and backward (torch.equal).
* Triton kernels (here under the interpreter; on a GPU the ``gpu`` tests): ``|y - ref| <= ulp_T/2 + K eps32 |ref|``
  (within one ulp of the output dtype), and no worse than eager beyond that rounding; the backward within
  ``ulp_T/2 + K eps32 scale`` with the scales of ``_rmsnorm_reference.bwd_ref``.

Random data comes from generators seeded per test (the seed is in every failure message).
"""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._rmsnorm_reference import (DTYPES, E32, EPS, WORSE_EXCESS_ULP32, WORSE_FRACTION, assert_bwd_bound, assert_fwd_bound,
                                 host, host_grads, no_worse_than_eager, ref64)
from ._rmsnorm_reference import Calls as _Calls
from ._rmsnorm_reference import data as _data
from ._rmsnorm_reference import seed_of as _seed
from ._rmsnorm_reference import norm_impl  # noqa: F401  (the fixture)

def _mod(geglu, name):
    return importlib.import_module(f"{geglu.__name__}.{name}")


# ----------------------------------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------------------------------


def test_host_transcription_is_transformers_forward():
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    # the transcription is compared, bit for bit, with the installed transformers' Gemma3RMSNorm (CI runs the
    # oldest and the newest supported transformers)
    x, w, _ = _data((3, 5, 48), torch.bfloat16, seed=_seed("host"))
    mod = Gemma3RMSNorm(48, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(w)
    assert torch.equal(host(x, w), mod(x))


# ----------------------------------------------------------------------------------------------------------------
# forward and backward on random data
# ----------------------------------------------------------------------------------------------------------------

SHAPES = [(32, 2560), (2, 7, 1000), (96, 256), (5, 4099), (9, 1), (0, 64), (4, 0), (3, 20000)]
# (x dtype, weight dtype): Gemma's weight is in the model's dtype; fp32 weights with bf16 activations also occur
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float16)]


@pytest.mark.parametrize("scale", [1.0, 1e-3, 30.0], ids=["unit", "eps-sized", "large"])
@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(norm_impl, geglu, shape, dtype, wdtype, scale):
    name, device = norm_impl
    seed = _seed("fwd", shape, dtype, wdtype, scale)
    x, w, _ = _data(shape, dtype, wdtype, scale, seed, device)
    y = geglu.rms_norm(x, w, EPS)
    ye = host(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == ye.stride()
    if name == "cpu":
        assert torch.equal(y, ye), f"seed {seed}: {(y != ye).sum().item()} of {y.numel()} differ from eager"
        return
    what = f"seed {seed}"
    assert_fwd_bound(y, x, w, what=what)
    frac, excess = no_worse_than_eager(y, ye, ref64(x, w), dtype)
    assert frac <= WORSE_FRACTION[dtype] and excess <= WORSE_EXCESS_ULP32, (
        f"{what}: farther from fp64 than eager in {frac:.3g} of the elements, by up to {excess:.3g} fp32 ulps")


@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward(norm_impl, geglu, shape, dtype, wdtype):
    name, device = norm_impl
    seed = _seed("bwd", shape, dtype, wdtype)
    x, w, dy = _data(shape, dtype, wdtype, 1.0, seed, device)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = geglu.rms_norm(xr, wr, EPS)
    y.backward(dy)
    assert xr.grad.dtype == x.dtype and wr.grad.dtype == w.dtype
    dx_op, dw_op = geglu.ops.rms_norm_backward.default(dy, x, w, EPS, 1.0)  # the op's backward: rstd recomputed
    if name == "cpu":  # eager autograd records the CPU implementation's own ops; the op replays their formulas
        ye, dxe, dwe = host_grads(x, w, dy)
        assert type(y.grad_fn) is type(host(xr, wr).grad_fn)
        assert torch.equal(y, ye) and torch.equal(xr.grad, dxe) and torch.equal(wr.grad, dwe), f"seed {seed}"
        assert torch.equal(dx_op, dxe) and torch.equal(dw_op, dwe), f"op backward, seed {seed}"
        return
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward"
    assert_bwd_bound(xr.grad, wr.grad, x, w, dy, what=f"seed {seed}")
    assert_bwd_bound(dx_op, dw_op, x, w, dy, what=f"op backward, seed {seed}")


@pytest.mark.parametrize("eps,offset", [(0.1, 1.0), (0.0, 1.0), (1e-6, 0.0), (1e-5, 2.5)])
def test_eps_and_offset(norm_impl, geglu, eps, offset):
    """eps large enough to matter, zero, and the scale offset + w for offsets other than Gemma's 1."""
    name, device = norm_impl
    seed = _seed("eps", eps, offset)
    x, w, dy = _data((16, 384), torch.bfloat16, torch.float32, 0.3, seed, device)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = geglu.rms_norm(xr, wr, eps, offset)
    y.backward(dy)
    if name == "cpu":
        ye, dxe, dwe = host_grads(x, w, dy, eps, offset)
        assert torch.equal(y, ye) and torch.equal(xr.grad, dxe) and torch.equal(wr.grad, dwe), f"seed {seed}"
        return
    assert_fwd_bound(y.detach(), x, w, eps, offset, what=f"seed {seed}")
    assert_bwd_bound(xr.grad, wr.grad, x, w, dy, eps, offset, what=f"seed {seed}")


@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=str)
def test_kernel_rounds_like_eager_given_its_rstd(norm_impl, geglu, dtype, wdtype):
    """Bit for bit, the kernel's output is eager's rounding sequence on its own r: fl(fl(x * r) * fl(1 + w)),
    rounded once to x's dtype (round to nearest even); r itself is within a few fp32 ulps of the exact one."""
    name, device = norm_impl
    if name == "cpu":
        pytest.skip("the CPU implementation is eager itself (test_forward)")
    tri = _mod(geglu, "rmsnorm.kernels")
    for shape in [(40, 2560), (64, 256), (3, 20000)]:
        seed = _seed("emulate", shape, dtype, wdtype)
        x, w, _ = _data(shape, dtype, wdtype, 1.0, seed, device)
        y, rstd = tri.forward(x, w, tri.f32(EPS), 1.0, True)
        emulated = ((x.float() * rstd[:, None]) * (1.0 + w.float())).to(dtype)
        assert torch.equal(y, emulated), f"seed {seed}: {(y != emulated).sum().item()} of {y.numel()} differ"
        exact = torch.rsqrt(x.double().pow(2).mean(-1) + tri.f32(EPS))
        assert ((rstd.double() - exact).abs() / exact).max().item() <= 8 * E32, f"seed {seed}"


# ----------------------------------------------------------------------------------------------------------------
# layouts: every eager input layout works; the output is laid out like torch.empty_like(x) (eager's layout)
# ----------------------------------------------------------------------------------------------------------------


def _layout(name, device, dtype, seed):
    """(leaf, view): x = view(leaf) in the named layout; gradients reach the leaf through the view."""
    g = torch.Generator().manual_seed(seed)
    B, S, H, hd = 2, 5, 3, 64
    shapes = {"heads-transposed": (B, S, H, hd), "row-slice": (7, 2 * hd), "last-dim-strided": (hd, 9),
              "expanded": (1, hd), "batch-slice": (4, 6, hd)}
    views = {
        # q_norm / k_norm: q_proj(x).view(B, S, H, hd).transpose(1, 2), dense but not contiguous
        "heads-transposed": lambda t: t.transpose(1, 2),
        "row-slice": lambda t: t[:, :hd],  # rows with a stride: read in place
        "last-dim-strided": lambda t: t.t(),  # dense, last dim not unit-stride: a copy
        "expanded": lambda t: t.expand(6, hd),
        "batch-slice": lambda t: t[:, 1:5],  # leading dims that do not collapse to one row stride
    }
    leaf = torch.randn(shapes[name], generator=g).to(dtype).to(device)
    return leaf, views[name]


LAYOUTS = ["heads-transposed", "row-slice", "last-dim-strided", "expanded", "batch-slice"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(norm_impl, geglu, layout):
    name, device = norm_impl
    seed = _seed("layout", layout)
    leaf, view = _layout(layout, device, torch.bfloat16, seed)
    x = view(leaf)
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(x.shape[-1], generator=g) * 0.5).to(torch.bfloat16).to(device)
    dy = torch.randn(x.shape, generator=g).to(x.dtype).to(device)
    y = geglu.rms_norm(x, w, EPS)
    assert y.stride() == torch.empty_like(x).stride()
    if name == "cpu":
        assert torch.equal(y, host(x, w)) and y.stride() == host(x, w).stride()
    else:
        assert torch.equal(y, geglu.rms_norm(x.contiguous(), w, EPS)), "a row's result depends on its layout"
        assert_fwd_bound(y, x, w, what=f"seed {seed}")
    for grad in (dy, dy.transpose(-1, -2).contiguous().transpose(-1, -2)):  # contiguous, then strided
        xv, wr = view(leaf.clone().requires_grad_()), w.clone().requires_grad_()
        dx, dw = torch.autograd.grad(geglu.rms_norm(xv, wr, EPS), (xv, wr), grad)
        if name == "cpu":
            xe, we = view(leaf.clone().requires_grad_()), w.clone().requires_grad_()
            dxe, dwe = torch.autograd.grad(host(xe, we), (xe, we), grad)
            assert torch.equal(dx, dxe) and torch.equal(dw, dwe), f"seed {seed}"
        else:
            assert_bwd_bound(dx, dw, x, w, dy, what=f"seed {seed}")


def test_dw_is_deterministic(norm_impl, geglu):
    name, device = norm_impl
    for shape in [(300, 512), (3, 20000)]:  # several rows per program; the looped wide-row kernel
        x, w, dy = _data(shape, torch.bfloat16, torch.float32, 1.0, _seed("det", shape), device)
        runs = []
        for _ in range(2):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            geglu.rms_norm(xr, wr, EPS).backward(dy)
            runs.append((xr.grad, wr.grad))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_gradients_only_where_asked(norm_impl, geglu):
    name, device = norm_impl
    x, w, dy = _data((8, 96), torch.float32, seed=_seed("needs"), device=device)
    wr = w.clone().requires_grad_()
    geglu.rms_norm(x, wr, EPS).backward(dy)
    xr = x.clone().requires_grad_()
    geglu.rms_norm(xr, w, EPS).backward(dy)
    _, dxe, dwe = host_grads(x, w, dy)
    if name == "cpu":
        assert torch.equal(wr.grad, dwe) and torch.equal(xr.grad, dxe)
    else:
        assert_bwd_bound(xr.grad, wr.grad, x, w, dy)
    with torch.no_grad():
        assert geglu.rms_norm(xr, wr, EPS).grad_fn is None


# ----------------------------------------------------------------------------------------------------------------
# torch.library contract
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(norm_impl, geglu, requires_grad):
    name, device = norm_impl
    for dtype, wdtype, shape in [(torch.float32, torch.float32, (3, 5, 24)), (torch.bfloat16, torch.float32, (4, 33))]:
        x, w, dy = _data(shape, dtype, wdtype, seed=_seed("opcheck", shape), device=device)
        torch.library.opcheck(geglu.ops.rms_norm.default,
                              (x.requires_grad_(requires_grad), w.requires_grad_(requires_grad), EPS, 1.0))
        torch.library.opcheck(geglu.ops.rms_norm_backward.default, (dy, x.detach(), w.detach(), EPS, 1.0))
    leaf, view = _layout("heads-transposed", device, torch.float32, 0)
    xt = view(leaf)
    torch.library.opcheck(geglu.ops.rms_norm.default, (xt, torch.zeros(xt.shape[-1], device=device), EPS, 1.0))


def test_compile_fullgraph_forward_backward(norm_impl, geglu):
    """The public function under torch.compile(fullgraph=True) runs the op: no graph break, eager's results."""
    name, device = norm_impl
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def f(x, w):
        return geglu.rms_norm(x * 2, w, EPS) * 3

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    x, w, dy = _data((6, 10, 48), torch.bfloat16, torch.float32, seed=_seed("compile"), device=device)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = compiled(xr, wr)
    y.backward(dy)
    assert len(graphs) == 1 and any(op.endswith(".rms_norm.default") for op in graphs[0]), graphs
    with torch.no_grad():
        assert torch.equal(y, geglu.rms_norm(x * 2, w, EPS) * 3)
    dx, dw = geglu.ops.rms_norm_backward.default(dy * 3, x * 2, w, EPS, 1.0)
    assert torch.equal(xr.grad, dx * 2) and torch.equal(wr.grad, dw)


def test_ops_live_in_the_build_namespace(geglu):
    ns = _mod(geglu, "_ops").add_op_namespace_prefix("rms_norm").split("::")[0]
    assert ns == geglu.__name__
    assert hasattr(getattr(torch.ops, ns), "rms_norm") and hasattr(getattr(torch.ops, ns), "rms_norm_backward")


# ----------------------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_what_was_expected(geglu):
    x, w, _ = _data((4, 16), torch.float32)
    cases = [
        ((x.to(torch.int32), w, EPS), TypeError, "x has dtype torch.int32; expected torch.float32"),
        ((x, w.double(), EPS), TypeError, "weight has dtype torch.float64"),
        ((x.tolist(), w, EPS), TypeError, "x must be a torch.Tensor, got list"),
        ((x, w[:8], EPS), ValueError, r"weight has shape \(8,\); expected \(16,\)"),
        ((x, w.view(4, 4), EPS), ValueError, r"weight has shape \(4, 4\); expected \(16,\)"),
        ((torch.tensor(1.0), w[:1], EPS), ValueError, "x is a 0-dim tensor"),
        ((x, w.to("meta"), EPS), ValueError, "x is on cpu but weight is on meta; expected one device"),
        ((x, w, "1e-6"), TypeError, "eps must be a float, got str"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            geglu.rms_norm(*args)
    with pytest.raises(ValueError, match=r"grad has shape \(4, 15\)"):
        geglu.ops.rms_norm_backward.default(x[:, :15].contiguous(), x, w, EPS, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# the hub layer through kernels' kernelize
# ----------------------------------------------------------------------------------------------------------------

kernels = pytest.importorskip("kernels")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping  # noqa: E402


@use_kernel_forward_from_hub("GemmaRMSNorm")
class HostNorm(torch.nn.Module):
    """The shape of transformers' GemmaRMSNorm (weight initialised to zeros there; random here)."""

    def __init__(self, dim, eps=EPS):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return host(x, self.weight, self.eps)


class Block(torch.nn.Module):
    """A residual block with a norm before and after (Gemma's pre/post norms) and one on head_dim rows."""

    def __init__(self, d, hd):
        super().__init__()
        self.pre, self.post, self.q_norm = HostNorm(d), HostNorm(d), HostNorm(hd)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.hd = hd

    def forward(self, x):
        h = self.proj(self.pre(x))
        B, S, D = h.shape
        q = self.q_norm(h.view(B, S, -1, self.hd).transpose(1, 2)).transpose(1, 2).reshape(B, S, D)
        return x + self.post(q)


def _models(device, dtype, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Block(64, 16), Block(64, 16)).to(device=device, dtype=dtype)
    for m in model.modules():
        if isinstance(m, HostNorm):
            torch.nn.init.normal_(m.weight, std=0.5)
    ref = torch.nn.Sequential(Block(64, 16), Block(64, 16)).to(device=device, dtype=dtype)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _mapping(build_dir, device):
    return {"GemmaRMSNorm": {device: LocalLayerRepository(repo_path=build_dir, layer_name="GemmaRMSNorm")}}


def test_layer_rules_and_kernel_runs_in_inference_and_training(norm_impl, geglu, build_dir, monkeypatch):
    name, device = norm_impl
    seed = _seed("layer", name)
    model, ref = _models(device, torch.float32, seed)
    calls = _Calls(geglu.__name__, monkeypatch)
    with use_kernel_mapping(_mapping(build_dir, device)):
        kernelize(model, mode=Mode.TRAINING, device=device)  # kernels validates the layer rules on load
    norms = [m for m in model.modules() if isinstance(m, HostNorm)]
    assert len(norms) == 6 and all(m.forward.__func__.__qualname__ == "GemmaRMSNorm.forward" for m in norms)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed)).to(device)
    dy = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    impl_fwd, impl_bwd = (("rmsnorm.ops.cpu_forward", None) if name == "cpu"
                          else ("rmsnorm.kernels.forward", "rmsnorm.kernels.backward"))

    with torch.no_grad():
        y, y_ref = model(x), ref(x)
    assert calls.take() == {impl_fwd: 6}
    y_t = model(x)
    y_t.backward(dy)
    y_r = ref(x)
    y_r.backward(dy)
    # CPU: eager autograd records the CPU implementation's ops (no backward of ours runs); Triton: our backward
    assert calls.take() == ({impl_fwd: 6} if name == "cpu" else {impl_fwd: 6, impl_bwd: 6})
    if name == "cpu":
        assert torch.equal(y, y_ref) and torch.equal(y_t, y_r)
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"gradient of {pname}"
        return
    # Triton: each norm within its bound; through the model, normwise (the blocks amplify a last-bit change)
    scale = y_ref.abs().max().item()
    assert (y - y_ref).abs().max().item() <= 1e-5 * scale and (y_t - y_r).abs().max().item() <= 1e-5 * scale
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-5 * q.grad.abs().max().item(), f"gradient of {pname}"


def _compile_case(form, device):
    """(model, reference, mapping, width) for a layer form: Gemma's blocks, or Gemma 4's norm with and without
    weight."""
    if form == "gemma":
        return (*_models(device, torch.float32, _seed("layer-compile")), _mapping, 64)
    mods = [_scaled_pair(device, torch.float32, _seed("scaled-compile", ws), ws) for ws in (True, False)]
    return (torch.nn.Sequential(*(m for m, _ in mods)), torch.nn.Sequential(*(r for _, r in mods)),
            _scaled_mapping, 48)


@pytest.mark.parametrize("form", ["gemma", "scaled"])
def test_layer_under_compile_runs_the_hosts_math(norm_impl, geglu, build_dir, monkeypatch, form):
    """Mode.TORCH_COMPILE: one graph with no opaque norm op (Inductor can fuse the host's math), eager's result."""
    name, device = norm_impl
    model, ref, mapping, width = _compile_case(form, device)
    with use_kernel_mapping(mapping(build_dir, device)):
        kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device=device)
    calls = _Calls(geglu.__name__, monkeypatch)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward  # the traced graph itself, run as eager ops

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(2, 9, width, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        y = compiled(x)
        assert torch.equal(y, ref(x))
    assert len(graphs) == 1 and not any("rms_norm" in op for op in graphs[0]), graphs
    assert calls.take() == {}


def test_layer_keeps_the_hosts_math_for_other_dtypes(norm_impl, geglu, build_dir, monkeypatch):
    name, device = norm_impl
    norm = HostNorm(32).to(device=device, dtype=torch.float64)
    ref = HostNorm(32).to(device=device, dtype=torch.float64)
    with use_kernel_mapping(_mapping(build_dir, device)):
        kernelize(norm, mode=Mode.INFERENCE, device=device)
    assert norm.forward.__func__.__qualname__ == "GemmaRMSNorm.forward"
    calls = _Calls(geglu.__name__, monkeypatch)
    x = torch.randn(3, 32, dtype=torch.float64, device=device)
    assert torch.equal(norm(x), ref(x)) and calls.take() == {}


# --- Gemma 3n / Gemma 4's form: the layer Gemma3nRMSNorm ----------------------------------------------------------


def scaled_host(x, w, eps=EPS):
    """transformers' Gemma3nRMSNorm.forward (Gemma 4's), op for op; w None: with_scale=False."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y * w.float() if w is not None else y).type_as(x)


@use_kernel_forward_from_hub("Gemma3nRMSNorm")
class HostScaledNorm(torch.nn.Module):
    """The shape of transformers' Gemma3nRMSNorm / Gemma4RMSNorm (weight optional)."""

    def __init__(self, dim, eps=EPS, with_scale=True):
        super().__init__()
        self.eps, self.with_scale = eps, with_scale
        if with_scale:
            self.weight = torch.nn.Parameter(torch.randn(dim) * 0.5)

    def forward(self, x):
        return scaled_host(x, self.weight if self.with_scale else None, self.eps)


def _scaled_mapping(build_dir, device):
    return {"Gemma3nRMSNorm": {device: LocalLayerRepository(repo_path=build_dir, layer_name="Gemma3nRMSNorm")}}


def _scaled_pair(device, dtype, seed, with_scale):
    torch.manual_seed(seed)
    ref = HostScaledNorm(48, with_scale=with_scale).to(device=device, dtype=dtype)
    mod = HostScaledNorm(48, with_scale=with_scale).to(device=device, dtype=dtype)
    mod.load_state_dict(ref.state_dict())
    return mod, ref


@pytest.mark.parametrize("with_scale", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_layer_inference_and_training(norm_impl, geglu, build_dir, monkeypatch, dtype, with_scale):
    """Offset 0 and an optional weight: CPU bit-exact with the host (its torch.pow), the kernels within the bound
    of the formula in fp64 (scale w, or ones), forward and backward."""
    name, device = norm_impl
    seed = _seed("scaled-layer", name, dtype, with_scale)
    mod, ref = _scaled_pair(device, dtype, seed, with_scale)
    with use_kernel_mapping(_scaled_mapping(build_dir, device)):
        kernelize(mod, mode=Mode.TRAINING, device=device)
    assert mod.forward.__func__.__qualname__ == "Gemma3nRMSNorm.forward"
    calls = _Calls(geglu.__name__, monkeypatch)
    x, _, dy = _data((3, 7, 48), dtype, dtype, 1.0, seed, device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = mod(xa), ref(xb)
    y.backward(dy)
    y_ref.backward(dy)
    assert calls.take() == ({"rmsnorm.ops.scaled_host_forward": 1} if name == "cpu"
                            else {"rmsnorm.kernels.forward": 1, "rmsnorm.kernels.backward": 1})
    dw = mod.weight.grad if with_scale else None
    if name == "cpu":
        assert torch.equal(y, y_ref) and torch.equal(xa.grad, xb.grad)
        assert not with_scale or torch.equal(dw, ref.weight.grad)
        return
    w = mod.weight.detach() if with_scale else torch.ones(48, device=device)
    assert_fwd_bound(y.detach(), x, w, EPS, 0.0, what=f"seed {seed}")
    assert_bwd_bound(xa.grad, dw, x, w, dy, EPS, 0.0, what=f"seed {seed}")


def test_scaled_layer_keeps_the_hosts_math_for_other_dtypes(norm_impl, geglu, build_dir, monkeypatch):
    name, device = norm_impl
    mod, ref = _scaled_pair(device, torch.float64, _seed("scaled-f64"), True)
    with use_kernel_mapping(_scaled_mapping(build_dir, device)):
        kernelize(mod, mode=Mode.INFERENCE, device=device)
    calls = _Calls(geglu.__name__, monkeypatch)
    x = torch.randn(3, 48, dtype=torch.float64, device=device)
    assert torch.equal(mod(x), ref(x)) and calls.take() == {"rmsnorm.ops.scaled_host_forward": 1}


@pytest.mark.gpu
def test_gpu_scaled_layer_in_a_cuda_graph(geglu, build_dir):
    """A norm without weight first called inside a CUDA graph capture makes no tensor there (it runs the host's
    math); called once outside, the captured graph runs the kernel. Both replays equal their eager runs."""
    geglu.rmsnorm.ops._UNIT_SCALES.clear()
    mod, ref = _scaled_pair("cuda", torch.bfloat16, _seed("scaled-graph"), False)
    with use_kernel_mapping(_scaled_mapping(build_dir, "cuda")):
        kernelize(mod, mode=Mode.INFERENCE, device="cuda")
    x = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    results = []
    for warm in (False, True):
        if warm:
            with torch.no_grad():
                eager = mod(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            y = mod(x)
        g.replay()
        torch.cuda.synchronize()
        results.append(y.clone())
        assert (("cuda" in {k[-1].type for k in geglu.rmsnorm.ops._UNIT_SCALES}) == warm)
    with torch.no_grad():
        assert torch.equal(results[0], ref(x))  # the host's math
        assert torch.equal(results[1], eager)  # the kernel, as outside the graph


# ----------------------------------------------------------------------------------------------------------------
# GPU: the bound at real sizes (marker gpu; skipped without CUDA)
# ----------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [(16384, 2560), (1, 2560), (8, 2048, 8, 256), (4096, 16384), (3, 13823), (7, 1), (5, 20000),
              (2048, 5376)]


def _gpu_dtypes(shape):
    n = math.prod(shape)
    return [torch.bfloat16] if n > 2**25 else DTYPES


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_forward_bound_and_no_worse_than_eager(geglu, shape):
    for dtype in _gpu_dtypes(shape):
        seed = _seed("gpu-fwd", shape, dtype)
        x, w, _ = _data(shape, dtype, dtype, 1.0, seed, "cuda")
        if len(shape) == 4:  # q_norm rows: [B, S, H, hd] viewed as [B, H, S, hd]
            x = x.transpose(1, 2)
        y = geglu.rms_norm(x, w, EPS)
        ye = host(x, w)
        what = f"{dtype} seed {seed}"
        assert_fwd_bound(y, x, w, what=what)
        frac, excess = no_worse_than_eager(y, ye, ref64(x, w), dtype)
        assert frac <= WORSE_FRACTION[dtype] and excess <= WORSE_EXCESS_ULP32, (
            f"{what}: farther from fp64 than eager in {frac:.3g} of the elements, by up to {excess:.3g} fp32 ulps")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_backward_bound_and_determinism(geglu, shape):
    for dtype in _gpu_dtypes(shape):
        seed = _seed("gpu-bwd", shape, dtype)
        x, w, dy = _data(shape, dtype, dtype, 1.0, seed, "cuda")
        runs = []
        for _ in range(2):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            geglu.rms_norm(xr, wr, EPS).backward(dy)
            runs.append((xr.grad, wr.grad))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "not deterministic"
        assert_bwd_bound(runs[0][0], runs[0][1], x, w, dy, what=f"{dtype} seed {seed}")
        dx_op, dw_op = geglu.ops.rms_norm_backward.default(dy, x, w, EPS, 1.0)  # rstd recomputed
        assert_bwd_bound(dx_op, dw_op, x, w, dy, what=f"op path, {dtype} seed {seed}")


# ----------------------------------------------------------------------------------------------------------------
# the kernels compile for the H200 (sm_90) without a GPU
# ----------------------------------------------------------------------------------------------------------------

_AOT = r'''
import importlib, json, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class TargetOnly:  # what JITFunction.warmup asks of the driver; nothing is launched
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")
    def is_active(self): return True


driver.set_active(TargetOnly())
import torch
import kernels

pkg = kernels.get_local_kernel(Path(sys.argv[1])).__name__
kt = importlib.import_module(pkg + ".rmsnorm.kernels")
importlib.import_module(pkg + ".runtime.launch")._SM_COUNT[0] = 132  # the H200's SMs, for the plans
cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
dev = torch.device("cuda", 0)
out = []


def usage(ck):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cubin").write_bytes(ck.asm["cubin"])
        res = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, check=True).stdout
    line = next(l for l in res.splitlines() if "REG:" in l)
    return {k: int(v) for k, v in (f.split(":") for f in line.split() if f.split(":")[0] in ("REG", "STACK", "LOCAL"))}


for dt in (torch.bfloat16, torch.float32):
    for M, D in [(16384, 2560), (131072, 256), (16384, 5376), (4096, 16384), (3, 20000), (7, 1)]:
        for flag in (True, False):
            x, w, y, r = torch.empty(M, D, dtype=dt), torch.empty(D, dtype=dt), torch.empty(M, D, dtype=dt), torch.empty(M)
            common = dict(D=D, EPS=kt.f32(1e-6), INV_D=kt.inv_d(D), OFFSET=1.0, enable_fp_fusion=False, grid=(1,))
            grid, bm, bd, nw, looped = kt.fwd_plan(M, D, dev)
            if looped:
                ck = kt._fwd_looped_kernel.warmup(x, w, y, r, D, D, CHUNK=bd, SAVE_RSTD=flag, num_warps=nw, **common)
            else:
                ck = kt._fwd_kernel.warmup(x, w, y, r, M, D, D, BLOCK_M=bm, BLOCK_D=bd, SAVE_RSTD=flag, num_warps=nw,
                                           **common)
            out.append(dict(kind="fwd", dtype=str(dt), M=M, D=D, flag=flag, **usage(ck)))
            grid, bm, bd, nw, looped = kt.bwd_plan(M, D, dev)
            args = (y, x, w, r, y, torch.empty(grid[0], D), M, D, D, D)
            if looped:
                ck = kt._bwd_looped_kernel.warmup(*args, CHUNK=bd, HAS_RSTD=flag, HAS_DW=flag, num_warps=nw, **common)
            else:
                ck = kt._bwd_kernel.warmup(*args, BLOCK_M=bm, BLOCK_D=bd, HAS_RSTD=flag, HAS_DW=flag, num_warps=nw,
                                           **common)
            out.append(dict(kind="bwd", dtype=str(dt), M=M, D=D, flag=flag, **usage(ck)))
ck = kt._dw_kernel.warmup(torch.empty(8, 2560), torch.empty(2560, dtype=torch.bfloat16), 8, D=2560, BLOCK_G=32,
                          BLOCK_C=128, num_warps=4, enable_fp_fusion=False, grid=(1,))
out.append(dict(kind="dw", dtype="torch.bfloat16", M=8, D=2560, flag=True, **usage(ck)))
print(json.dumps(out))
'''


def test_kernels_compile_for_sm90_without_spills(build_dir, tmp_path):
    """Every kernel with the plans of the benchmark's shapes compiles for sm_90 (Triton's bundled ptxas, no GPU
    needed), and keeps its registers: no stack or local memory, except the backward at rows of 16384 (x, dy and
    the dw partial of 16 elements each per thread, in 32 warps), which spills a little."""
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bindir / "ptxas").is_file() or not (bindir / "cuobjdump").is_file():
        pytest.skip("this Triton has no bundled ptxas / cuobjdump")
    script = tmp_path / "aot.py"
    script.write_text(_AOT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    r = subprocess.run([sys.executable, str(script), str(build_dir)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * 6 * 2 * 2 + 1
    for row in rows:
        spills = row["STACK"] + row["LOCAL"]
        if row["kind"] == "bwd" and row["D"] == 16384 and row["flag"]:
            continue
        assert spills == 0, row
