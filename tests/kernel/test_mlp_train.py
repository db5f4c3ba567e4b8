"""GeGLUMLP's training step as one autograd node (torch-ext/geglu/mlp/ops.py), through kernels' kernelize: output and
every gradient equal the host's eager step bit for bit (CPU here, CUDA on the device), frozen weights and inputs,
saved-tensor hooks (checkpointing, offloading), the refusal of a second backward, the fallback under autocast, and
on the GPU the backward's peak memory against eager's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._reference import randn
from .test_layers import GatedMLP, GeluTanh

kernels = pytest.importorskip("kernels")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402

NODE = "GeGLUMLPFunctionBackward"


def _pair(build_dir, device, dtype, act, d=48, h=136, seed=0):
    """(kernelized model, eager reference) with the same random weights."""
    torch.manual_seed(seed)
    model = GatedMLP(d, h, act).to(device, dtype)
    ref = GatedMLP(d, h, act).to(device, dtype)
    ref.load_state_dict(model.state_dict())
    mapping = {"GeGLUMLP": {device: LocalLayerRepository(repo_path=build_dir, layer_name="GeGLUMLP")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.TRAINING, device=device)
    assert model.forward.__func__.__qualname__.endswith("GeGLUMLP.forward")
    return model, ref


def _grads(model, x, dy):
    y = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = ([x] if x.requires_grad else []) + params
    return y, torch.autograd.grad(y, inputs, dy)


# CPU: small; CUDA: [M, H] above runtime.backend.NODE_EAGER_BELOW (2^21), where the node runs under 'auto' (the
# Triton kernels), and a small step with the compiled library forced (GEGLU backend 'cuda').
CASES = [pytest.param("cpu", (37,), 136, None, id="cpu-2d"), pytest.param("cpu", (3, 11), 136, None, id="cpu-3d"),
         pytest.param("cuda", (2100,), 1024, None, id="cuda-2d", marks=pytest.mark.gpu),
         pytest.param("cuda", (3, 700), 1024, None, id="cuda-3d", marks=pytest.mark.gpu),
         pytest.param("cuda", (2, 9), 136, "cuda", id="cuda-small-lib", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,shape,h,backend", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", [nn.GELU(), GeluTanh()], ids=["erf", "tanh"])
def test_training_step_equals_eager_bitwise(build_dir, geglu, device, shape, h, backend, dtype, act):
    model, ref = _pair(build_dir, device, dtype, act, h=h)
    x = randn(*shape, 48, dtype=dtype, device=device, scale=2).requires_grad_()
    dy = randn(*shape, 48, dtype=dtype, device=device)
    if backend:
        geglu.set_backend(backend)
    try:
        y, grads = _grads(model, x, dy)
    finally:
        geglu.set_backend("auto")
    assert type(y.grad_fn).__name__ == NODE  # the one-node path ran
    y_ref, grads_ref = _grads(ref, x, dy)
    assert type(y_ref.grad_fn).__name__ != NODE
    assert torch.equal(y, y_ref)
    for name, a, b in zip(["x", "gate_proj", "up_proj", "down_proj"], grads, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"gradient of {name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("frozen", [(), ("gate_proj",), ("down_proj",), ("gate_proj", "up_proj", "down_proj")])
def test_frozen_weights_and_input_without_grad(build_dir, frozen):
    model, ref = _pair(build_dir, "cpu", torch.float32, nn.GELU(approximate="tanh"))
    for m in (model, ref):
        for name in frozen:
            getattr(m, name).weight.requires_grad_(False)
    x_needs_grad = len(frozen) == 3  # something must need a gradient
    x = randn(5, 9, 48, dtype=torch.float32, device="cpu").requires_grad_(x_needs_grad)
    dy = randn(5, 9, 48, dtype=torch.float32, device="cpu")
    y, grads = _grads(model, x, dy)
    assert type(y.grad_fn).__name__ == NODE
    _, grads_ref = _grads(ref, x, dy)
    assert len(grads) == len(grads_ref) == 3 - len(frozen) + x_needs_grad
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
    # .backward() leaves .grad only where asked for
    model.zero_grad(set_to_none=True)
    model(x).backward(dy)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert (getattr(model, name).weight.grad is None) == (name in frozen), name


@pytest.mark.parametrize("wrap", ["save_on_cpu", "checkpoint", "identity_hooks"])
def test_saved_tensor_hooks_see_the_activations(build_dir, wrap):
    """With saved-tensor hooks in force the activations go through save_for_backward (the hooks pack them), and the
    gradients still equal eager's."""
    model, ref = _pair(build_dir, "cpu", torch.bfloat16, nn.GELU())
    x = randn(2, 13, 48, dtype=torch.bfloat16, device="cpu", scale=2).requires_grad_()
    dy = randn(2, 13, 48, dtype=torch.bfloat16, device="cpu")
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    def run(m):
        if wrap == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return m(x)
        if wrap == "checkpoint":
            return checkpoint(m, x, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return m(x)

    y, y_ref = run(model), run(ref)
    params = list(model.parameters())
    grads = torch.autograd.grad(y, [x] + params, dy)
    grads_ref = torch.autograd.grad(y_ref, [x] + list(ref.parameters()), dy)
    assert torch.equal(y, y_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
    if wrap == "identity_hooks":
        assert (2 * 13, 136) in packed  # g, u and h were packed by the hook


def test_second_backward_is_refused(build_dir):
    model, _ = _pair(build_dir, "cpu", torch.float32, nn.GELU())
    x = randn(4, 48, dtype=torch.float32, device="cpu").requires_grad_()
    y = model(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        y.sum().backward()


def test_regular_path_where_the_node_does_not_apply(build_dir):
    """Autocast, an activation that is not a GELU, a projection with a bias: the host's ops run (and match)."""
    model, ref = _pair(build_dir, "cpu", torch.float32, nn.GELU())
    x = randn(6, 48, dtype=torch.float32, device="cpu").requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = model(x), ref(x)
    assert type(y.grad_fn).__name__ != NODE and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    silu, silu_ref = _pair(build_dir, "cpu", torch.float32, nn.SiLU())
    y = silu(x)
    assert type(y.grad_fn).__name__ != NODE and torch.equal(y, silu_ref(x))
    model.down_proj = nn.Linear(136, 48).to(torch.float32)
    assert type(model(x).grad_fn).__name__ != NODE


@pytest.mark.gpu
@pytest.mark.parametrize("act", [nn.GELU(), GeluTanh()], ids=["erf", "tanh"])
def test_gpu_backward_peak_memory_below_eager(build_dir, act):
    """The backward keeps at most three [M, H] activation buffers live (eager: four or more); measured as the peak
    allocated during backward above what the forward left."""
    M, D, H = 4096, 512, 4096
    E = M * H * 2  # one [M, H] bf16 buffer
    W = D * H * 2
    model, ref = _pair(build_dir, "cuda", torch.bfloat16, act, d=D, h=H)
    x = randn(M, D, dtype=torch.bfloat16, device="cuda").requires_grad_()
    dy = randn(M, D, dtype=torch.bfloat16, device="cuda")
    peaks = {}
    for name, m in (("ours", model), ("eager", ref)):
        m.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        m(x).backward(dy)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    print(f"\nbackward+forward peak above the inputs: ours {peaks['ours'] / 2**20:.0f} MiB, "
          f"eager {peaks['eager'] / 2**20:.0f} MiB (E = {E / 2**20:.0f} MiB)")
    # ours: g, u, h (3E) + y, dx (small) + three weight gradients; eager holds gelu(g) too and allocates d_h with
    # g, u, h alive.
    assert peaks["ours"] <= 3 * E + 3 * W + 4 * M * D * 2 + (8 << 20)
    assert peaks["ours"] <= peaks["eager"] - E + (8 << 20)


def test_compiled_training_step_takes_the_regular_path(build_dir):
    """Under torch.compile(fullgraph=True) the node is not used (a training step traces the host's ops), and the
    step compiles and gives eager's output and gradients (aot_eager runs the traced ops)."""
    torch.manual_seed(0)
    model = GatedMLP(16, 40, nn.GELU(approximate="tanh"))
    ref = GatedMLP(16, 40, nn.GELU(approximate="tanh"))
    ref.load_state_dict(model.state_dict())
    mapping = {"GeGLUMLP": {"cpu": LocalLayerRepository(repo_path=build_dir, layer_name="GeGLUMLP")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = randn(3, 5, 16, dtype=torch.float32, device="cpu").requires_grad_()
    dy = randn(3, 5, 16, dtype=torch.float32, device="cpu")
    y = compiled(x)
    assert type(y.grad_fn).__name__ != NODE
    grads = torch.autograd.grad(y, [x] + list(model.parameters()), dy)
    y_ref = ref(x)
    grads_ref = torch.autograd.grad(y_ref, [x] + list(ref.parameters()), dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
