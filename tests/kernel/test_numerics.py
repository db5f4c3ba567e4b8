"""Forward and backward against eager PyTorch (bit-exact, or the stated interpreter bound) and fp64, for every
input form, dtype and GELU flavour, on small shapes (CPU: CPU implementation and Triton interpreter)."""

import pytest
import torch

from ._reference import (APPROX, DTYPES, assert_close_to_fp64, assert_matches_eager, eager_fwd, eager_grads,
                         fp64_fwd, fp64_grads, randn)

SHAPES = [(1, 8), (7, 33), (4, 3, 96), (2, 5, 130)]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_split(impl, geglu, shape, dtype, approximate):
    name, device = impl
    gate = randn(*shape, dtype=dtype, device=device, scale=3)
    up = randn(*shape, dtype=dtype, device=device)
    out = geglu.geglu(gate, up, approximate)
    ref = eager_fwd(gate, up, approximate)
    assert_matches_eager(name, out, ref, gate.abs() * up.abs())
    assert_close_to_fp64(out, ref, fp64_fwd(gate, up, approximate), impl_name=name, scale=gate.abs() * up.abs())


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_packed(impl, geglu, dtype, approximate, act_first):
    name, device = impl
    x = randn(3, 4, 2 * 45, dtype=dtype, device=device, scale=3)
    a, b = x.chunk(2, dim=-1)
    gate, up = (a, b) if act_first else (b, a)
    out = geglu.geglu_packed(x, approximate, act_first=act_first)
    ref = eager_fwd(gate, up, approximate)
    assert out.shape == (3, 4, 45) and out.is_contiguous()
    assert_matches_eager(name, out, ref, gate.abs() * up.abs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_compatible_functions(impl, geglu, dtype):
    """gelu_and_mul(out, x) / gelu_tanh_and_mul(out, x), as kernels-community/activation calls them."""
    name, device = impl
    x = randn(6, 2 * 40, dtype=dtype, device=device, scale=3)
    for fn, approximate in ((geglu.gelu_and_mul, "none"), (geglu.gelu_tanh_and_mul, "tanh")):
        out = torch.full((6, 40), float("nan"), dtype=dtype, device=device)
        assert fn(out, x) is out
        assert_matches_eager(name, out, eager_fwd(x[:, :40], x[:, 40:], approximate), x[:, :40].abs() * x[:, 40:].abs())


def test_strided_rows_without_copy(impl, geglu):
    """Row-strided views (a slice of a wider tensor, chunk of 3-D) are read in place and give eager's result."""
    name, device = impl
    wide = randn(9, 200, dtype=torch.bfloat16, device=device, scale=3)
    gate, up = wide[:, 10:74], wide[:, 100:164]  # row stride 200, unit last dim
    assert gate.stride() == (200, 1)
    ref = eager_fwd(gate, up, "tanh")
    assert_matches_eager(name, geglu.geglu(gate, up, "tanh"), ref, gate.abs() * up.abs())

    x = randn(2, 5, 2 * 24, dtype=torch.float16, device=device, scale=3)
    g3, u3 = x.chunk(2, dim=-1)
    assert not g3.is_contiguous()
    assert_matches_eager(name, geglu.geglu(g3, u3), eager_fwd(g3, u3, "none"), g3.abs() * u3.abs())

    # leading dims that do not flatten to one row stride (a transposed batch): still right (copied). Eager's CPU
    # kernels themselves switch between vectorised and scalar math by layout, so the reference is eager on the
    # same values laid out contiguously (what the kernel reads).
    t = randn(6, 4, 32, dtype=torch.float32, device=device, scale=3).transpose(0, 1)
    t2 = randn(4, 6, 32, dtype=torch.float32, device=device)
    ref = eager_fwd(t.contiguous(), t2, "none")
    assert_matches_eager(name, geglu.geglu(t, t2), ref, t.abs() * t2.abs())


def test_out_into_strided_view(impl, geglu):
    name, device = impl
    gate = randn(5, 16, dtype=torch.float32, device=device, scale=3)
    up = randn(5, 16, dtype=torch.float32, device=device)
    buf = torch.full((5, 40), float("nan"), device=device)
    out = buf[:, 8:24]
    geglu.geglu(gate, up, "tanh", out=out)
    assert_matches_eager(name, out, eager_fwd(gate, up, "tanh"), gate.abs() * up.abs())
    assert torch.isnan(buf[:, :8]).all() and torch.isnan(buf[:, 24:]).all(), "wrote outside the out view"


def test_empty_rows(impl, geglu):
    _, device = impl
    gate = torch.empty(0, 64, device=device, dtype=torch.bfloat16)
    out = geglu.geglu(gate, gate.clone())
    assert out.shape == (0, 64)
    x = torch.empty(2, 0, 128, device=device, requires_grad=True)
    y = geglu.geglu_packed(x)
    assert y.shape == (2, 0, 64)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_split(impl, geglu, dtype, approximate):
    name, device = impl
    gate = randn(6, 70, dtype=dtype, device=device, scale=3).requires_grad_()
    up = randn(6, 70, dtype=dtype, device=device).requires_grad_()
    dy = randn(6, 70, dtype=dtype, device=device)
    geglu.geglu(gate, up, approximate).backward(dy)
    ref_g, ref_u = eager_grads(gate, up, dy, approximate)
    G, U, D = gate.detach().abs(), up.detach().abs(), dy.abs()
    assert_matches_eager(name, gate.grad, ref_g, D * U * (1 + G * G))
    assert_matches_eager(name, up.grad, ref_u, D * G)
    g64, u64 = fp64_grads(gate, up, dy, approximate)
    assert_close_to_fp64(gate.grad, ref_g, g64, impl_name=name, scale=D * U * (1 + G * G))
    assert_close_to_fp64(up.grad, ref_u, u64, impl_name=name, scale=D * G)


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_packed(impl, geglu, dtype, act_first):
    name, device = impl
    x = randn(2, 3, 2 * 50, dtype=dtype, device=device, scale=3).requires_grad_()
    dy = randn(2, 3, 50, dtype=dtype, device=device)
    geglu.geglu_packed(x, "tanh", act_first=act_first).backward(dy)
    a, b = x.detach().chunk(2, dim=-1)
    gate, up = (a, b) if act_first else (b, a)
    ref_g, ref_u = eager_grads(gate, up, dy, "tanh")
    ref = torch.cat([ref_g, ref_u] if act_first else [ref_u, ref_g], dim=-1)
    G, U, D = gate.abs(), up.abs(), dy.abs()
    scale = torch.cat([D * U * (1 + G * G), D * G] if act_first else [D * G, D * U * (1 + G * G)], dim=-1)
    assert_matches_eager(name, x.grad, ref, scale)


@pytest.mark.parametrize("packed", [False, True])
def test_inplace_backward(impl, geglu, packed):
    """inplace_backward=True gives the same gradients, written over the saved activations (no new buffers)."""
    _, device = impl
    runs = []
    for inplace in (False, True):
        torch.manual_seed(1)
        if packed:
            leaf = randn(5, 2 * 48, dtype=torch.bfloat16, device=device, scale=3).requires_grad_()
            saved = leaf * 1  # a non-leaf activation, like a projection's output
            y = geglu.geglu_packed(saved, "tanh", inplace_backward=inplace)
        else:
            leaf = randn(5, 48, dtype=torch.bfloat16, device=device, scale=3).requires_grad_()
            up = randn(5, 48, dtype=torch.bfloat16, device=device)
            saved = leaf * 1
            y = geglu.geglu(saved, up, "tanh", inplace_backward=inplace)
        before = saved.detach().clone()
        y.backward(randn(*y.shape, dtype=y.dtype, device=device))
        runs.append((leaf.grad, before, saved.detach().clone()))
    (grad_copy, before, after_copy), (grad_inplace, _, after_inplace) = runs
    assert torch.equal(grad_copy, grad_inplace)
    assert torch.equal(after_copy, before), "the default backward modified its saved input"
    assert torch.equal(after_inplace, grad_inplace), "in-place backward did not write the gradient over the input"
