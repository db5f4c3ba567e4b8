"""GPU sweep at real sizes (marker `gpu`; skipped without CUDA): every implementation available in the loaded
variant (compiled CUDA library and Triton), bit-exact against eager PyTorch on the same GPU."""

import pytest
import torch

from ._reference import APPROX, DTYPES, eager_grads, randn

pytestmark = pytest.mark.gpu

# (M, d): decode rows, prefill shapes of Gemma/Llama widths, d not a multiple of 8, a single column.
SWEEP = [(1, 14336), (16, 14336), (64, 14336), (4096, 9216), (3, 13823), (1000, 4097), (7, 1), (2, 24576),
         (8192, 14336), (16384, 24576)]


def _skip_huge(M, d, dtype):
    if M * d > 2**27 and dtype == torch.float32:
        pytest.skip("fp32 at the largest sizes: covered by bf16/fp16, keeps the sweep short")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,d", SWEEP)
def test_forward_bit_exact(impl, geglu, M, d, dtype, approximate):
    _skip_huge(M, d, dtype)
    gate = randn(M, d, dtype=dtype, device="cuda", scale=3)
    up = randn(M, d, dtype=dtype, device="cuda")
    out = torch.full_like(gate, float("nan"))
    geglu.geglu(gate, up, approximate, out=out)
    ref = torch.nn.functional.gelu(gate, approximate=approximate) * up
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,d", [(1, 14336), (64, 14336), (3, 13823), (1000, 4097), (4096, 9216), (8192, 14336)])
def test_backward_bit_exact(impl, geglu, M, d, dtype, approximate):
    _skip_huge(M, d, dtype)
    gate = randn(M, d, dtype=dtype, device="cuda", scale=3)
    up = randn(M, d, dtype=dtype, device="cuda")
    dy = randn(M, d, dtype=dtype, device="cuda")
    d_gate, d_up = geglu.geglu_backward(dy, gate, up, approximate)
    ref_g, ref_u = eager_grads(gate, up, dy, approximate)
    assert torch.equal(d_up, ref_u), f"d_up: {(d_up != ref_u).sum().item()} of {d_up.numel()} differ"
    assert torch.equal(d_gate, ref_g), f"d_gate: {(d_gate != ref_g).sum().item()} of {d_gate.numel()} differ"


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("d", [4097, 14336])
def test_packed_and_strided_rows(impl, geglu, d, act_first):
    x = randn(2, 300, 2 * d, dtype=torch.bfloat16, device="cuda", scale=3).requires_grad_()
    y = geglu.geglu_packed(x, "tanh", act_first=act_first)
    a, b = x.detach().chunk(2, dim=-1)
    gate, up = (a, b) if act_first else (b, a)
    assert torch.equal(y, torch.nn.functional.gelu(gate, approximate="tanh") * up)
    dy = randn(*y.shape, dtype=y.dtype, device="cuda")
    y.backward(dy)
    ref_g, ref_u = eager_grads(gate, up, dy, "tanh")
    ref = torch.cat([ref_g, ref_u] if act_first else [ref_u, ref_g], dim=-1)
    assert torch.equal(x.grad, ref)
    # row-strided split inputs with an odd element offset (unaligned base pointers)
    wide = randn(64, 2 * d + 3, dtype=torch.float16, device="cuda", scale=3)
    g, u = wide[:, 1:d + 1], wide[:, d + 2:2 * d + 2]
    assert torch.equal(geglu.geglu(g, u), torch.nn.functional.gelu(g) * u)


def test_inplace_backward_gpu(impl, geglu):
    gate = randn(512, 14336, dtype=torch.bfloat16, device="cuda", scale=3)
    up = randn(512, 14336, dtype=torch.bfloat16, device="cuda")
    dy = randn(512, 14336, dtype=torch.bfloat16, device="cuda")
    ref_g, ref_u = eager_grads(gate, up, dy, "none")
    geglu.ops.geglu_backward_(dy, gate, up, "none")
    assert torch.equal(gate, ref_g) and torch.equal(up, ref_u)


def test_over_2_31_elements(impl, geglu):
    """64-bit offsets: a bf16 tensor of more than 2**31 elements; rows past the 2**31 boundary checked exactly."""
    d = 8192
    M = 2**31 // d + 64
    gate = torch.empty(M, d, dtype=torch.bfloat16, device="cuda").normal_(0, 3)
    up = torch.empty(M, d, dtype=torch.bfloat16, device="cuda").normal_()
    out = geglu.geglu(gate, up, "tanh")
    for rows in (slice(0, 64), slice(M // 2, M // 2 + 64), slice(M - 128, M)):
        ref = torch.nn.functional.gelu(gate[rows], approximate="tanh") * up[rows]
        assert torch.equal(out[rows], ref)
    del out
    dg, du = geglu.geglu_backward(up, gate, up, "tanh")  # dy = up: any data will do
    rows = slice(M - 128, M)
    ref_g, ref_u = eager_grads(gate[rows], up[rows], up[rows], "tanh")
    assert torch.equal(dg[rows], ref_g) and torch.equal(du[rows], ref_u)


def test_cuda_graph_capture(impl, geglu):
    """Forward and backward ops can be captured in a CUDA graph and replayed on new data."""
    gate = randn(256, 4096, dtype=torch.bfloat16, device="cuda", scale=3)
    up = randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    dy = randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(gate)
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    for _ in range(2):  # warm up (compiles Triton kernels) outside capture
        geglu.geglu(gate, up, "tanh", out=out)
        geglu.ops.geglu_backward(dy, gate, up, "tanh")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        geglu.geglu(gate, up, "tanh", out=out)
        g2, u2 = geglu.ops.geglu_backward(dy, gate, up, "tanh")
        dg.copy_(g2)
        du.copy_(u2)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        gate.copy_(randn(256, 4096, dtype=torch.bfloat16, device="cuda", scale=3))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.nn.functional.gelu(gate, approximate="tanh") * up)
        ref_g, ref_u = eager_grads(gate, up, dy, "tanh")
        assert torch.equal(dg, ref_g) and torch.equal(du, ref_u)


@pytest.mark.parametrize("M,d", [(16, 14336), (8192, 14336)])  # 229 K and 117 M elements: either side of 2^26
def test_auto_routing_with_autograd(geglu, M, d):
    """Under 'auto', small CUDA calls that record a gradient run PyTorch's own ops (host-bound sizes), larger ones
    the fused kernels' autograd node; either way the values and gradients are eager's, bit for bit."""
    import importlib

    backend = importlib.import_module(geglu.__name__ + ".runtime.backend")
    geglu.set_backend("auto")
    gate = randn(M, d, dtype=torch.bfloat16, device="cuda", scale=3).requires_grad_()
    up = randn(M, d, dtype=torch.bfloat16, device="cuda").requires_grad_()
    dy = randn(M, d, dtype=torch.bfloat16, device="cuda")
    ref_g, ref_u = eager_grads(gate, up, dy, "tanh")  # before: the in-place backward writes over gate and up
    ref_y = torch.nn.functional.gelu(gate, approximate="tanh") * up
    y = geglu.geglu(gate, up, "tanh", inplace_backward=True)
    small = M * d < backend.AUTOGRAD_EAGER_BELOW
    assert (type(y.grad_fn).__name__ == "MulBackward0") == small, type(y.grad_fn).__name__
    assert torch.equal(y, ref_y)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    assert torch.equal(dg, ref_g) and torch.equal(du, ref_u)
    geglu.set_backend("cuda")  # an explicit backend always runs the kernels
    y = geglu.geglu(gate.detach().clone().requires_grad_(), up, "tanh")
    assert type(y.grad_fn).__name__ != "MulBackward0"
    geglu.set_backend("auto")


@pytest.mark.parametrize("act_first", [True, False])
def test_auto_routing_of_packed_autograd_is_the_hosts_graph(geglu, act_first):
    """Under 'auto', a small packed call that records a gradient runs the host's own graph: the halves from
    ``chunk`` (the autograd nodes ModernBERT's MLP records), not two slices, whose backward would fill a
    zero [..., 2d] gradient per half and add them. Values and the packed gradient are the host's bit for bit."""
    from kerneltools.bench.model.profiling import _autograd_nodes

    geglu.set_backend("auto")
    x = randn(8, 128, 2 * 1152, dtype=torch.bfloat16, device="cuda", scale=3).requires_grad_()
    y = geglu.geglu_packed(x, "none", act_first=act_first)
    xr = x.detach().clone().requires_grad_()
    a, b = xr.chunk(2, dim=-1)
    ref = torch.nn.functional.gelu(a) * b if act_first else a * torch.nn.functional.gelu(b)
    nodes, host = _autograd_nodes(y), _autograd_nodes(ref)
    assert nodes == host and "SliceBackward0" not in nodes, (nodes, host)
    assert torch.equal(y, ref)
    dy = randn(*y.shape, dtype=y.dtype, device="cuda")
    y.backward(dy)
    ref.backward(dy)
    assert torch.equal(x.grad, xr.grad)


def test_triton_direct_launch_after_the_first(geglu):
    """The second Triton launch of a specialisation goes through the compiled kernel's launcher (no JIT binding),
    with the same results: forward and backward, flat and row-strided."""
    import importlib

    tr = importlib.import_module(geglu.__name__ + ".runtime.launch")
    geglu.set_backend("triton")
    try:
        x = randn(64, 2 * 4096, dtype=torch.bfloat16, device="cuda", scale=3)
        gate, up = x[:, :4096], x[:, 4096:]  # row-strided halves: the 2-D kernels
        gc, uc = gate.contiguous(), up.contiguous()  # the flat kernels
        dy = randn(64, 4096, dtype=torch.bfloat16, device="cuda")
        tr._DIRECT_LAUNCH.clear()
        for _ in range(3):
            for g, u in ((gate, up), (gc, uc)):
                assert torch.equal(geglu.geglu(g, u, "none"), torch.nn.functional.gelu(g) * u)
                dg, du = geglu.geglu_backward(dy, g, u, "none")
                ref_g, ref_u = eager_grads(g, u, dy, "none")
                assert torch.equal(dg, ref_g) and torch.equal(du, ref_u)
        assert tr._direct_ok and len(tr._DIRECT_LAUNCH) == 4, tr._DIRECT_LAUNCH.keys()
        assert not tr._hooks_set()
    finally:
        geglu.set_backend("auto")
