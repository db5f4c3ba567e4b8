"""A refused call leaves its out= buffer as it was: every check runs before anything is written. Each buffer is
poisoned with NaN, the call must raise the stated error, and the buffer must keep every bit (compared as integers,
so NaN payloads count), on each backend, through the public functions, the op and torch.compile."""

import pytest
import torch

from ._emulation import assert_bitwise
from ._reference import randn


def _poisoned(*shape, dtype=torch.float32, device="cpu", stride2=False):
    if stride2:  # last-dim stride 2: a strided out= the checks refuse
        return torch.full(shape[:-1] + (2 * shape[-1],), float("nan"), dtype=dtype, device=device)[..., ::2]
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _refused(call, out, exc, match):
    before = out.clone()
    with pytest.raises(exc, match=match):
        call()
    assert_bitwise(out, before, "out= after a refused call")


def test_split_form(impl, geglu):
    _, device = impl
    g, u = randn(3, 4, dtype=torch.float32, device=device), randn(3, 4, dtype=torch.float32, device=device)
    cases = [
        # (gate, up, approximate, out, exception, message)
        (g, u, "none", _poisoned(3, 4, device=device, stride2=True), ValueError,
         r"out has stride 2 in its last dimension; expected 1"),
        (g.to(torch.int64), u, "none", _poisoned(3, 4, device=device), TypeError, r"gate has dtype torch\.int64"),
        (g, u, "none", _poisoned(3, 4, dtype=torch.float16, device=device), TypeError,
         r"gate is torch\.float32 but out is torch\.float16"),
        (g, u, "tanh", _poisoned(3, 3, device=device), ValueError,
         r"gate has shape \(3, 4\) but out has shape \(3, 3\)"),
        (g, u[:, :3], "none", _poisoned(3, 4, device=device), ValueError,
         r"gate has shape \(3, 4\) but up has shape \(3, 3\)"),
        (g, u, "sigmoid", _poisoned(3, 4, device=device), ValueError, r"approximate='sigmoid' is not supported"),
        (g.to("meta"), u.to("meta"), "none", _poisoned(3, 4, device=device), ValueError,
         rf"gate is on meta but out is on {device}"),
        (g.clone().requires_grad_(), u, "none", _poisoned(3, 4, device=device), RuntimeError,
         r"out= is for inference and does not record a gradient"),
    ]
    for gate, up, approximate, out, exc, match in cases:
        _refused(lambda: geglu.geglu(gate, up, approximate, out=out), out, exc, match)


def test_packed_forms(impl, geglu):
    _, device = impl
    x = randn(3, 8, dtype=torch.float32, device=device)
    cases = [
        (geglu.gelu_and_mul, x, _poisoned(3, 5, device=device), ValueError,
         r"out has shape \(3, 5\); expected \(3, 4\)"),
        (geglu.gelu_tanh_and_mul, x, _poisoned(3, 4, dtype=torch.bfloat16, device=device), TypeError,
         r"x is torch\.float32 but out is torch\.bfloat16"),
        (geglu.gelu_and_mul, x[:, :7], _poisoned(3, 3, device=device), ValueError,
         r"last dimension is 7, which is odd"),
        (geglu.gelu_and_mul, x.to(torch.float64), _poisoned(3, 4, device=device), TypeError,
         r"x has dtype torch\.float64"),
        (geglu.gelu_tanh_and_mul, x, _poisoned(3, 4, device=device, stride2=True), ValueError,
         r"out has stride 2 in its last dimension"),
        (geglu.gelu_and_mul, x.clone().requires_grad_(), _poisoned(3, 4, device=device), RuntimeError,
         r"out= is for inference"),
    ]
    for fn, inp, out, exc, match in cases:
        _refused(lambda: fn(out, inp), out, exc, match)
    out = _poisoned(3, 4, device=device)
    _refused(lambda: geglu.geglu_packed(x, "sigmoid", out=out), out, ValueError, r"approximate='sigmoid'")


def test_through_the_op(impl, geglu):
    """geglu_out called as a torch.library op (the dispatcher's path: what torch.compile and tracing run)."""
    _, device = impl
    op = geglu.ops.geglu_out.default
    g, u = randn(4, 6, dtype=torch.bfloat16, device=device), randn(4, 6, dtype=torch.bfloat16, device=device)
    out = _poisoned(4, 6, dtype=torch.bfloat16, device=device)
    _refused(lambda: op(out, g, u, "sigmoid"), out, ValueError, r"approximate='sigmoid' is not supported")
    _refused(lambda: op(out, g, u[:, :5], "none"), out, ValueError, r"gate has shape \(4, 6\) but up has shape")
    out16 = _poisoned(4, 6, dtype=torch.float16, device=device)
    _refused(lambda: op(out16, g, u, "none"), out16, TypeError, r"gate is torch\.bfloat16 but out is torch\.float16")


def test_under_compile(geglu):
    """torch.compile reports the fake implementation's check (wrapped by dynamo) before any kernel runs."""
    torch._dynamo.reset()
    f = torch.compile(lambda g, u, o: geglu.geglu(g, u, out=o), fullgraph=True, backend="aot_eager")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g, u = randn(4, 8, dtype=torch.float32, device=device), randn(4, 9, dtype=torch.float32, device=device)
    out = _poisoned(4, 8, device=device)
    _refused(lambda: f(g, u, out), out, torch._dynamo.exc.TorchRuntimeError,
             r"got ValueError\('geglu: gate has shape \(4, 8\) but up has shape \(4, 9\)")
