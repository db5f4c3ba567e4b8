"""Bad input gets an error that names what was wrong and what was expected, on every path (eager, compile)."""

import pytest
import torch


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def test_integer_dtype(geglu):
    g = torch.randint(0, 5, (4, 8))
    with pytest.raises(TypeError, match=r"gate has dtype torch.int64; expected torch.float32, torch.float16 or"):
        geglu.geglu(g, g.clone())


def test_float64_is_named(geglu):
    with pytest.raises(TypeError, match="float64"):
        geglu.geglu_packed(_t(2, 8, dtype=torch.float64))


def test_mismatched_dtypes(geglu):
    with pytest.raises(TypeError, match=r"gate is torch.float32 but up is torch.bfloat16; expected the same dtype"):
        geglu.geglu(_t(4, 8), _t(4, 8, dtype=torch.bfloat16))


def test_shape_mismatch(geglu):
    with pytest.raises(ValueError, match=r"gate has shape \(4, 8\) but up has shape \(4, 9\); expected equal shapes"):
        geglu.geglu(_t(4, 8), _t(4, 9))


def test_odd_packed_last_dim(geglu):
    with pytest.raises(ValueError, match=r"last dimension is 7, which is odd; expected 2\*d"):
        geglu.geglu_packed(_t(3, 7))


def test_different_devices(geglu):
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match=r"gate is on cpu but up is on meta; expected one device"):
        geglu.geglu(_t(4, 8), meta)


def test_non_unit_last_stride(geglu):
    g = _t(8, 4).t()  # last-dim stride 4
    with pytest.raises(ValueError, match=r"gate has stride 4 in its last dimension; expected 1.*contiguous\(\)"):
        geglu.geglu(g, g.contiguous())
    x = _t(6, 3).t()
    with pytest.raises(ValueError, match=r"x has stride 3 in its last dimension"):
        geglu.geglu_packed(x)


def test_zero_dim(geglu):
    with pytest.raises(ValueError, match="0-dim tensor"):
        geglu.geglu(torch.tensor(1.0), torch.tensor(2.0))


def test_bad_approximate(geglu):
    with pytest.raises(ValueError, match=r"approximate='sigmoid' is not supported; expected 'none'.*or 'tanh'"):
        geglu.geglu(_t(2, 4), _t(2, 4), "sigmoid")


def test_out_shape_and_dtype(geglu):
    x = _t(3, 8)
    with pytest.raises(ValueError, match=r"out has shape \(3, 5\); expected \(3, 4\)"):
        geglu.gelu_and_mul(torch.empty(3, 5), x)
    with pytest.raises(TypeError, match=r"x is torch.float32 but out is torch.float16"):
        geglu.gelu_and_mul(torch.empty(3, 4, dtype=torch.float16), x)
    with pytest.raises(ValueError, match=r"gate has shape \(3, 4\) but out has shape \(3, 3\)"):
        geglu.geglu(_t(3, 4), _t(3, 4), out=torch.empty(3, 3))


def test_out_must_be_a_tensor(geglu):
    with pytest.raises(TypeError, match=r"out must be a torch.Tensor \(or None\), got str"):
        geglu.geglu(_t(2, 4), _t(2, 4), out="x")


def test_out_with_autograd_is_refused(geglu):
    g = _t(2, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="out= is for inference"):
        geglu.geglu(g, _t(2, 4), out=torch.empty(2, 4))


def test_errors_under_compile(geglu):
    """The fake implementations run the same checks: torch.compile reports the same message (dynamo wraps the
    ValueError raised while tracing with fake tensors)."""
    torch._dynamo.reset()
    f = torch.compile(lambda g, u: geglu.geglu(g, u), fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError,
                       match=r"got ValueError\('geglu: gate has shape \(4, 8\) but up has shape \(4, 9\)"):
        f(_t(4, 8), _t(4, 9))


def test_backend_choice(geglu):
    with pytest.raises(ValueError, match=r"expected one of auto, cuda, triton"):
        geglu.set_backend("rocm")
    if not geglu.HAS_CUDA_LIB:
        with pytest.raises(RuntimeError, match="no compiled CUDA library"):
            geglu.set_backend("cuda")
    assert geglu.get_backend() == "auto"


@pytest.mark.parametrize("pins", [dict(version=1, revision="main"), dict(version=1, lockfile="kernels.lock"),
                                  dict(revision="main", lockfile="kernels.lock")])
def test_register_transformers_takes_one_pin(geglu, pins):
    """version=, revision= and lockfile= each name the commit to map: two of them are a contradiction, refused
    before anything is registered."""
    pytest.importorskip("kernels")
    names = " and ".join(k for k in ("version", "revision", "lockfile") if k in pins)
    with pytest.raises(ValueError, match=f"{names} each pin repo_id's code; pass one of them"):
        geglu.register_transformers(repo_id="org/geglu", register=False, **pins)
    with pytest.raises(ValueError, match="need repo_id=|pass repo_id= with them"):
        geglu.register_transformers(register=False, **pins)


def test_transformers_kernel_config_takes_one_pin(geglu):
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    with pytest.raises(ValueError, match="version= and revision= each pin repo_id's code; pass one"):
        geglu.transformers_kernel_config(gemma.GemmaForCausalLM, repo_id="org/geglu", version=1, revision="main")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_dim_cuda_tensors_get_the_cpu_error(geglu, dtype):
    """The library's one-call path for small contiguous CUDA tensors validates as the checked path does."""
    g = torch.tensor(1.0, dtype=dtype, device="cuda")
    for call in (lambda t: geglu.geglu(t, t.clone()), lambda t: geglu.geglu_backward(t, t, t)):
        with pytest.raises(ValueError) as on_cuda:
            call(g)
        with pytest.raises(ValueError) as on_cpu:
            call(g.cpu())
        assert str(on_cuda.value) == str(on_cpu.value)
