"""Hub layers through kernels' own kernelize: the layer rules hold (kernels validates them on load), outputs and
gradients equal the host's eager computation, and a non-GELU activation keeps the host's own math."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ._reference import randn

kernels = pytest.importorskip("kernels")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping  # noqa: E402


class GeluTanh(nn.Module):  # the name transformers gives gelu_pytorch_tanh's class
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


GeluTanh.__name__ = "GELUTanh"


@use_kernel_forward_from_hub("GeGLUMLP")
class GatedMLP(nn.Module):
    """The shape of transformers' Gemma/Llama MLP."""

    def __init__(self, d, h, act):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@use_kernel_forward_from_hub("GeluAndMul")
class PackedGelu(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d]) * x[..., d:]


@use_kernel_forward_from_hub("GeluTanhAndMul")
class PackedGeluTanh(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _mapping(build_dir, *names):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {n: {device: LocalLayerRepository(repo_path=build_dir, layer_name=n)} for n in names}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_calls(geglu, monkeypatch):
    """The names of the pointwise implementation entries that ran (``_run_fwd`` / ``_run_bwd``: every CPU and Triton
    call goes through them; on CUDA the compiled library's lean paths do not, so tests assert on CPU)."""
    ops = importlib.import_module(geglu.__name__ + ".pointwise.ops")
    calls = []
    for name in ("_run_fwd", "_run_bwd"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    return calls


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), GeluTanh()], ids=["erf", "tanh", "GELUTanh"])
def test_mlp_inference_and_training(build_dir, act, kernel_calls):
    device = _device()
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP(16, 40, act), GatedMLP(16, 40, act)).to(device)
    ref_model = nn.Sequential(GatedMLP(16, 40, act), GatedMLP(16, 40, act)).to(device)
    ref_model.load_state_dict(model.state_dict())
    x = randn(3, 5, 16, dtype=torch.float32, device=device)

    with use_kernel_mapping(_mapping(build_dir, "GeGLUMLP")):
        kernelize(model, mode=Mode.TRAINING, device=device)
    assert model[0].forward.__func__.__qualname__.endswith("GeGLUMLP.forward")

    y, y_ref = model(x), ref_model(x)
    assert torch.equal(y, y_ref)
    if device == "cpu":  # the training step ran as our node, with our forward kernel in each MLP
        assert type(y.grad_fn).__name__ == "GeGLUMLPFunctionBackward" and kernel_calls == ["_run_fwd"] * 2
    dy = randn(*y.shape, dtype=torch.float32, device=device)
    y.backward(dy)
    y_ref.backward(dy)
    if device == "cpu":
        assert kernel_calls.count("_run_bwd") == 2
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))
    if device == "cpu":
        assert kernel_calls.count("_run_fwd") == 4
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


def test_non_gelu_activation_keeps_host_math(build_dir, kernel_calls):
    device = _device()
    model = GatedMLP(8, 24, nn.SiLU()).to(device)
    x = randn(4, 8, dtype=torch.float32, device=device)
    ref = model(x)
    with use_kernel_mapping(_mapping(build_dir, "GeGLUMLP")):
        kernelize(model, mode=Mode.INFERENCE, device=device)
    assert model.forward.__func__.__qualname__.endswith("GeGLUMLP.forward")  # swapped, but falls back inside
    assert torch.equal(model(x), ref)
    assert not kernel_calls


def test_packed_layers(build_dir, kernel_calls):
    device = _device()
    model = nn.Sequential(PackedGelu(), PackedGeluTanh()).to(device)
    with use_kernel_mapping(_mapping(build_dir, "GeluAndMul", "GeluTanhAndMul")):
        kernelize(model, mode=Mode.TRAINING, device=device)
    x = randn(2, 3, 64, dtype=torch.bfloat16, device=device, scale=3).requires_grad_()
    y = model(x)
    # The reference is eager on contiguous halves: the CPU promise (eager's own CPU kernels round differently on
    # strided views, and the CPU implementation computes on contiguous copies); on the GPU the layout does not matter.
    x_ref = x.detach().clone().requires_grad_()
    a, b = x_ref.chunk(2, dim=-1)
    h = F.gelu(a.contiguous()) * b.contiguous()
    h1, h2 = h.chunk(2, dim=-1)
    ref = F.gelu(h1.contiguous(), approximate="tanh") * h2.contiguous()
    assert torch.equal(y, ref)
    if device == "cpu":
        assert type(y.grad_fn).__name__ == "GeGLUPackedFunctionBackward" and kernel_calls == ["_run_fwd"] * 2
    dy = randn(*y.shape, dtype=torch.bfloat16, device=device)
    y.backward(dy)
    ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    if device == "cpu":
        assert kernel_calls.count("_run_bwd") == 2


def test_compile_mode_accepted(build_dir):
    """can_torch_compile=True: kernelize accepts Mode.INFERENCE | Mode.TORCH_COMPILE, and the model compiles
    with fullgraph=True."""
    device = _device()
    model = GatedMLP(8, 24, nn.GELU(approximate="tanh")).to(device)
    x = randn(4, 8, dtype=torch.float32, device=device)
    ref = model(x)
    with use_kernel_mapping(_mapping(build_dir, "GeGLUMLP")):
        kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh")], ids=["erf", "tanh"])
def test_small_cuda_training_step_equals_eager_bitwise(build_dir, act):
    """A decode-sized CUDA training step (one autograd node: eager's GEMM calls, our bit-exact kernels) gives the
    output and every gradient (x's too, the sum of two branches) of eager's step bit for bit."""
    torch.manual_seed(0)
    model = GatedMLP(256, 1024, act).to("cuda", torch.bfloat16)
    ref_model = GatedMLP(256, 1024, act).to("cuda", torch.bfloat16)
    ref_model.load_state_dict(model.state_dict())
    with use_kernel_mapping(_mapping(build_dir, "GeGLUMLP")):
        kernelize(model, mode=Mode.TRAINING, device="cuda")
    x = randn(16, 256, dtype=torch.bfloat16, device="cuda").requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model(x), ref_model(x_ref)
    assert torch.equal(y, y_ref)
    dy = randn(*y.shape, dtype=torch.bfloat16, device="cuda")
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name


def test_gelu_approximation_by_class(geglu):
    """transformers' activation classes count by name, classes of those names from elsewhere are learned on their
    first call (and their subclasses then count as them), and nothing else is a GELU."""
    acts = importlib.import_module(geglu.__name__ + "._activations")

    NewGELUActivation = type("NewGELUActivation", (nn.Module,), {"forward": lambda self, x: x})
    GELUActivation = type("GELUActivation", (nn.Module,), {"forward": lambda self, x: x})
    Other = type("ClippedGELUActivation", (nn.Module,), {"forward": lambda self, x: x})
    assert NewGELUActivation not in acts._TANH_TYPES
    assert acts.gelu_approximation(NewGELUActivation()) == "tanh"
    assert NewGELUActivation in acts._TANH_TYPES
    assert acts.gelu_approximation(type("Sub", (NewGELUActivation,), {})()) == "tanh"
    assert acts.gelu_approximation(GELUActivation()) == "none" and GELUActivation in acts._ERF_TYPES
    assert acts.gelu_approximation(Other()) is None and Other not in acts._TANH_TYPES + acts._ERF_TYPES
    assert acts.gelu_approximation(nn.GELU()) == "none" and acts.gelu_approximation(nn.GELU("tanh")) == "tanh"
    assert acts.gelu_approximation(F.gelu) == "none" and acts.gelu_approximation(nn.SiLU()) is None
    transformers = pytest.importorskip("transformers.activations")
    acts._scan_transformers()  # what loading the module does once transformers' activations are imported
    for name in ("GELUTanh", "NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation"):
        assert getattr(transformers, name) in acts._TANH_TYPES, name
    assert transformers.GELUActivation in acts._ERF_TYPES
