"""The Triton kernels under the interpreter equal a step-by-step emulation of eager's rounding sequence, bit for bit.

tests/kernel/_emulation.py computes eager's GeGLU the way eager's CUDA kernels do (fp32 math in eager's operation
order, the GELU rounded to the storage dtype before the product, the backward's ``d_h = T(dy * up)`` rounded before
``gelu_backward``), with the transcendental values the interpreter uses (fp64 rounded to fp32). Comparisons
against fp64 or a ulp bound reward being *more* accurate, so they cannot see a missing rounding; this one can:
what is asserted is equality of every bit pattern (``-0.0 != +0.0``). On a GPU, CUDA's erff/tanhf/expf replace the
interpreter's functions and bit-exactness with eager itself is checked instead (test_gpu.py, test_triton_ptx.py).
"""

import importlib

import numpy as np
import pytest
import torch

from . import _emulation as emu
from ._reference import APPROX, DTYPES, randn

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation models the Triton interpreter (CPU)"),
    # the interpreter's fp64 exp overflows to inf for the large test values (tanh saturates to +-1, as on the GPU)
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def tri(geglu):
    return importlib.import_module(geglu.__name__ + ".pointwise.kernels")


def _special(dtype):
    """Values where rounding and branches matter: signed zeros, both tails, GELU's minimum, tiny and large."""
    v = [0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 0.5, -0.5, -0.75, 1.0, -1.0, 2.0, -3.0, -4.5, -6.0, -9.0, 5.0, 10.0,
         -10.0, 30.0, -30.0]
    return torch.tensor(v, dtype=torch.float32).to(dtype)


def _gate(m, n, dtype, device):
    g = randn(m, n, dtype=dtype, device=device, scale=3)
    s = _special(dtype)
    g.view(-1)[: s.numel()] = s.to(device)
    return g


def test_emulation_constants_are_the_kernels(tri):
    for name in ("K_BETA_TANH", "K_KAPPA", "K_ALPHA", "K_BETA_ERF", "K_3KAPPA"):
        assert float(getattr(emu, name)) == getattr(tri, name), name


def test_fma32_rounds_once():
    """fma32 is the correctly rounded a*b+c: checked against exact rational arithmetic on random and crafted
    operands (ties and cancellations, where a product rounded before the sum gives other bits)."""
    from fractions import Fraction

    rng = np.random.default_rng(torch.initial_seed() % 2**32)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(2000) * 1e-6)).astype(np.float32)  # cancellation
    c[:1000] = rng.standard_normal(1000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 1000)
    a[0], b[0], c[0] = np.float32(1 + 2**-23), np.float32(1 - 2**-23), np.float32(-1)  # exact result -2^-46
    got = emu.fma32(a, b, c)
    separate = (a * b + c).astype(np.float32)
    assert (got != separate).any(), "the operands never tell a fused from a separate multiply-add"
    for x, y, z, r in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        lo = np.float32(float(exact))  # nearest fp64, then fp32: checked below against the exact neighbours
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert r == best, (x, y, z, r, best)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["flat", "rows", "flat-tail"])
def test_forward_kernels(tri, dtype, approximate, layout):
    """_geglu_fwd_flat_kernel (contiguous, with and without a tail) and _geglu_fwd_kernel (row-strided views)."""
    m, n = {"flat": (4, 512), "rows": (5, 70), "flat-tail": (3, 77)}[layout]
    width = n if layout != "rows" else 2 * n + 6
    gate = _gate(m, width, dtype, "cpu")[:, :n]
    up = randn(m, width, dtype=dtype, device="cpu")[:, width - n:]
    out = torch.full((m, width + 4), float("nan"), dtype=dtype)[:, 2:2 + n]
    if layout != "rows":
        gate, up, out = gate.contiguous(), up.contiguous(), out.contiguous()
    tri.geglu_fwd(out, gate, up, approximate == "tanh")
    emu.assert_bitwise(out, emu.forward(gate, up, approximate == "tanh"), f"forward {layout}")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["flat", "rows", "flat-tail"])
def test_backward_kernels(tri, dtype, approximate, layout):
    """_geglu_bwd_flat_kernel and _geglu_bwd_kernel: d_gate and d_up."""
    m, n = {"flat": (4, 512), "rows": (5, 70), "flat-tail": (3, 77)}[layout]
    width = n if layout != "rows" else 2 * n + 6
    gate = _gate(m, width, dtype, "cpu")[:, :n]
    up = randn(m, width, dtype=dtype, device="cpu")[:, width - n:]
    dy = randn(m, width + 6, dtype=dtype, device="cpu")[:, 3:3 + n]
    if layout != "rows":
        gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    d_gate = torch.full((m, n), float("nan"), dtype=dtype)
    d_up = torch.full((m, n), float("nan"), dtype=dtype)
    tri.geglu_bwd(d_gate, d_up, dy, gate, up, approximate == "tanh")
    ref_g, ref_u = emu.backward(dy, gate, up, approximate == "tanh")
    emu.assert_bitwise(d_up, ref_u, f"d_up {layout}")
    emu.assert_bitwise(d_gate, ref_g, f"d_gate {layout}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_public_functions_on_the_triton_backend(impl, geglu, dtype):
    """geglu / geglu_packed forward and backward, dispatched to Triton: the same bits as the emulation."""
    name, device = impl
    if name != "triton":
        pytest.skip("the emulation is of the Triton kernels")
    for approximate in APPROX:
        tanh = approximate == "tanh"
        gate = _gate(6, 40, dtype, device).requires_grad_()
        up = randn(6, 40, dtype=dtype, device=device).requires_grad_()
        dy = randn(6, 40, dtype=dtype, device=device)
        out = geglu.geglu(gate, up, approximate)
        emu.assert_bitwise(out, emu.forward(gate, up, tanh), f"geglu {approximate}")
        out.backward(dy)
        ref_g, ref_u = emu.backward(dy, gate, up, tanh)
        emu.assert_bitwise(gate.grad, ref_g, f"geglu d_gate {approximate}")
        emu.assert_bitwise(up.grad, ref_u, f"geglu d_up {approximate}")

        x = torch.cat([_gate(3, 24, dtype, device), randn(3, 24, dtype=dtype, device=device)], -1).requires_grad_()
        y = geglu.geglu_packed(x, approximate)
        emu.assert_bitwise(y, emu.forward(x[:, :24], x[:, 24:], tanh), f"geglu_packed {approximate}")
        dy = randn(3, 24, dtype=dtype, device=device)
        y.backward(dy)
        ref_g, ref_u = emu.backward(dy, x.detach()[:, :24], x.detach()[:, 24:], tanh)
        emu.assert_bitwise(x.grad, torch.cat([ref_g, ref_u], -1), f"geglu_packed grad {approximate}")


def test_the_emulated_roundings_are_visible():
    """The test data tells the rounding sequence from its neighbours: without the GELU's rounding (forward) or
    d_h's (backward), or with an extra rounding of the fp32 product, some bf16/fp16 results change."""
    for dtype in (torch.bfloat16, torch.float16):
        for tanh in (False, True):
            gate = _gate(4, 512, dtype, "cpu")
            up = randn(4, 512, dtype=dtype, device="cpu")
            dy = randn(4, 512, dtype=dtype, device="cpu")
            x, u, g = emu.f32(gate), emu.f32(up), emu.f32(dy)
            unrounded_h = emu.round_to(emu.gelu32(x, tanh) * u, dtype)
            assert not torch.equal(unrounded_h, emu.forward(gate, up, tanh))
            ref_g, _ = emu.backward(dy, gate, up, tanh)
            unrounded_dh = emu.round_to((g * u) * emu.gelu_grad32(x, tanh), dtype)
            assert not torch.equal(unrounded_dh, ref_g)
