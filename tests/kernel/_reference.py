"""Eager references and comparison rules shared by the kernel tests."""

import torch
import torch.nn.functional as F

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]
E32 = torch.finfo(torch.float32).eps


# Eager's CPU kernels switch between vectorised and scalar math by memory layout (CUDA's do not), so the eager
# reference is computed on contiguous copies: the layout the CPU implementation computes on.


def eager_fwd(gate, up, approximate):
    return F.gelu(gate.contiguous(), approximate=approximate) * up.contiguous()


def eager_grads(gate, up, dy, approximate):
    """Eager autograd's (d_gate, d_up) for F.gelu(gate) * up."""
    g = gate.detach().contiguous().clone().requires_grad_()
    u = up.detach().contiguous().clone().requires_grad_()
    (F.gelu(g, approximate=approximate) * u).backward(dy.contiguous())
    return g.grad, u.grad


def fp64_fwd(gate, up, approximate):
    return F.gelu(gate.double(), approximate=approximate) * up.double()


def fp64_grads(gate, up, dy, approximate):
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    (F.gelu(g, approximate=approximate) * u).backward(dy.double())
    return g.grad, u.grad


def randn(*shape, dtype, device, scale=1.0):
    """Fresh random data; scale 3 spreads gates over GELU's curved region and both tails. Drawn from torch's global
    generator, which tests/conftest.py seeds for each test (a failure reports the GEGLU_TEST_SEED that replays it)."""
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _interpreter_deviation(ref, scale):
    """The interpreter's stated deviation from ``ref``, per element and without the subnormal term:
    ``4 * (eps_fp32 * scale + eps_T * |ref|)`` (see :func:`interpreter_bound`)."""
    return 4 * (E32 * scale.double() + torch.finfo(ref.dtype).eps * ref.double().abs())


def interpreter_bound(result, ref, scale):
    """The stated bound for the Triton interpreter on CPU, where erf/tanh/exp come from Python/numpy rather than
    CUDA's libdevice (a few fp32 ulp apart, which near GELU's tails is large relative to the tiny result):

        |result - ref| <= 4 * (eps_fp32 * scale + eps_T * |ref| + tiny_T)

    with ``scale`` the magnitude of the inputs' product (|gate|*|up| for the forward). Measured worst ratio on
    random data: 1.5 (of 4)."""
    err = (result.double() - ref.double()).abs()
    allowed = _interpreter_deviation(ref, scale) + 4 * torch.finfo(ref.dtype).tiny
    worst = (err / allowed).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"interpreter bound exceeded: worst error is {worst:.3g} x the bound"


def assert_matches_eager(impl_name, result, ref, scale):
    """Bit-exact where the implementation is (CPU implementation; every GPU kernel), else the stated bound."""
    assert result.dtype == ref.dtype and result.shape == ref.shape
    if impl_name == "triton" and result.device.type == "cpu":
        interpreter_bound(result, ref, scale)
    else:
        assert torch.equal(result, ref), (
            f"not bit-exact: {(result != ref).sum().item()} of {ref.numel()} differ, "
            f"max |diff| {(result.double() - ref.double()).abs().max().item():.3g}"
        )


def assert_close_to_fp64(result, eager, ref64, slack=1.02, impl_name=None, scale=None):
    """Our error against fp64 is no worse than eager's own (rounding in the output dtype). On the Triton
    interpreter (``impl_name`` "triton" on CPU), whose erf/tanh/exp are not eager's, the norm of the interpreter's
    stated deviation from eager (:func:`interpreter_bound`, over the inputs' magnitude ``scale``) is allowed on top:
    with a handful of elements, eager's own error cannot absorb it (a (1, 8) fp32 tanh forward measured 4.1e-7
    against eager's 3.1e-7, relative)."""
    ours = (result.double() - ref64).norm().item()
    theirs = (eager.double() - ref64).norm().item()
    norm = ref64.norm().item() + 1e-30
    allowed = theirs * slack + 1e-7 * norm
    if impl_name == "triton" and result.device.type == "cpu":
        allowed += _interpreter_deviation(eager, scale).norm().item()
    assert ours <= allowed, f"relative error {ours / norm:.3g} vs eager's {theirs / norm:.3g}"
