"""torch.library contract: opcheck on every op, torch.compile(fullgraph=True) without graph breaks, the
namespace coming from _ops.add_op_namespace_prefix."""

import pytest
import torch

from ._reference import eager_fwd, eager_grads, randn


def _op(geglu, name):
    return getattr(geglu.ops, name).default


def _samples(device, requires_grad):
    def t(*shape, scale=1.0):
        return randn(*shape, dtype=torch.float32, device=device, scale=scale).requires_grad_(requires_grad)

    x = t(3, 2 * 16, scale=3)
    return {
        "geglu": [(t(3, 16, scale=3), t(3, 16), "tanh", False), (t(2, 2, 8, scale=3), t(2, 2, 8), "none", False)],
        "geglu_packed": [(x, "none", True, False), (x, "tanh", False, False)],
    }


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_functional_ops(impl, geglu, requires_grad):
    _, device = impl
    for name, arg_sets in _samples(device, requires_grad).items():
        for args in arg_sets:
            torch.library.opcheck(_op(geglu, name), args)


def test_opcheck_mutating_and_backward_ops(impl, geglu):
    _, device = impl

    def t(*shape, scale=1.0):
        return randn(*shape, dtype=torch.bfloat16, device=device, scale=scale)

    g, u, dy = t(4, 24, scale=3), t(4, 24), t(4, 24)
    x = t(4, 48, scale=3)
    cases = [
        ("geglu_out", (torch.empty(4, 24, dtype=torch.bfloat16, device=device), g, u, "none")),
        ("geglu_backward", (dy, g, u, "tanh")),
        ("geglu_backward_", (dy, g.clone(), u.clone(), "tanh")),
        ("geglu_packed_backward", (dy, x, "none", True)),
        ("geglu_packed_backward_", (dy, x.clone(), "none", False)),
    ]
    for name, args in cases:
        torch.library.opcheck(_op(geglu, name), args)


def test_ops_live_in_the_build_namespace(geglu):
    import importlib

    ops_mod = importlib.import_module(geglu.__name__ + "._ops")
    ns = ops_mod.add_op_namespace_prefix("geglu").split("::")[0]
    assert ns == geglu.__name__  # the metadata id is the ops namespace
    for name in ("geglu", "geglu_packed", "geglu_out", "geglu_backward", "geglu_backward_",
                 "geglu_packed_backward", "geglu_packed_backward_"):
        assert hasattr(getattr(torch.ops, ns), name)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_compile_fullgraph_forward_backward(impl, geglu, inplace_backward):
    """No graph break (fullgraph=True) through forward and backward; results equal eager's op."""
    _, device = impl
    torch._dynamo.reset()

    def mlp_like(gate_w, up_w, x):
        g = x @ gate_w
        u = x @ up_w
        return geglu.geglu(g, u, "tanh", inplace_backward=inplace_backward).sum(-1)

    compiled = torch.compile(mlp_like, fullgraph=True, backend="aot_eager")
    x = randn(5, 12, dtype=torch.float32, device=device)
    wg = randn(12, 16, dtype=torch.float32, device=device).requires_grad_()
    wu = randn(12, 16, dtype=torch.float32, device=device).requires_grad_()
    y = compiled(wg, wu, x)
    y.sum().backward()
    wg2, wu2 = wg.detach().clone().requires_grad_(), wu.detach().clone().requires_grad_()
    y2 = mlp_like(wg2, wu2, x)
    y2.sum().backward()
    assert torch.equal(y, y2)
    assert torch.equal(wg.grad, wg2.grad) and torch.equal(wu.grad, wu2.grad)


def test_compile_packed_and_out(impl, geglu):
    _, device = impl
    torch._dynamo.reset()
    x = randn(3, 7, 2 * 20, dtype=torch.float32, device=device, scale=3)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), device=x.device, dtype=x.dtype)
        geglu.gelu_and_mul(out, x)
        return out + geglu.geglu_packed(x, "tanh", act_first=False)

    with torch.no_grad():
        ref = geglu.geglu_packed(x, "none") + geglu.geglu_packed(x, "tanh", act_first=False)
        assert torch.equal(f(x), ref)


@pytest.mark.slow
def test_compile_inductor(geglu):
    """The default backend (Inductor) compiles around the opaque op, forward and backward."""
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate = randn(8, 32, dtype=torch.float32, device=device, scale=3).requires_grad_()
    up = randn(8, 32, dtype=torch.float32, device=device).requires_grad_()
    f = torch.compile(lambda g, u: geglu.geglu(g * 2, u, "none") * 3, fullgraph=True)
    y = f(gate, up)
    dy = randn(8, 32, dtype=torch.float32, device=device)
    y.backward(dy)
    ref = eager_fwd(gate.detach() * 2, up.detach(), "none") * 3
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    ref_g, ref_u = eager_grads(gate.detach() * 2, up.detach(), dy * 3, "none")
    torch.testing.assert_close(gate.grad, ref_g * 2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(up.grad, ref_u, rtol=1e-6, atol=1e-6)


def test_fast_apply_is_function_apply_without_its_wrapper(geglu):
    """runtime.library.fast_apply: the C++ apply that Function.apply ends in. If PyTorch moves it, this fails and
    names the one place to change."""
    import importlib

    library = importlib.import_module(geglu.__name__ + ".runtime.library")

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(x, k):
            return x * k

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.k = inputs[1]

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.k, None

    try:
        fast = library.fast_apply(Twice)
    except (AttributeError, TypeError) as e:
        pytest.fail(f"torch {torch.__version__} has no C++ Function.apply where runtime.library.fast_apply looks for "
                    f"it ({e}); make fast_apply return Function.apply there.")
    x = torch.randn(5, requires_grad=True)
    y = fast(x, 3.0)
    assert type(y.grad_fn).__name__ == "TwiceBackward" and torch.equal(y, Twice.apply(x, 3.0))
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_every_python_op_is_defined_one_way():
    """Every Python operator of the package is defined by runtime.library.op with ``add_op_namespace_prefix("name")``
    written at the call site (kernel-builder's torch-ops-check looks for that form); nothing uses
    torch.library.custom_op or another Library."""
    import ast
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "torch-ext" / "geglu"
    sites = 0
    for path in sorted(pkg.rglob("*.py")):
        src = path.read_text()
        assert "custom_op(" not in src and "Library(" not in src or path.name == "library.py", path
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "op":
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "add_op_namespace_prefix" \
                    and isinstance(arg.args[0], ast.Constant), f"{path.name}:{node.lineno}"
                sites += 1
    assert sites == 13, sites  # pointwise 7, rmsnorm 2, mlp 3, rope 1
