"""The fused MLP's epilogue on given fp32 accumulators: `mlp.tiles.geglu_epilogue` (both FAST_EPI modes), called
from a small test kernel on tiles we fill ourselves, so the GEMM's accumulation order plays no part.

* The fast epilogue (FAST_EPI: the GeGLU of the fp32 accumulators, rounded once) has no eager rounding sequence to
  match; its output is compared elementwise with fp64 on the same fp32 inputs within

      |out - ref64| <= ulp_T(ref64) / 2 + 16 * eps_fp32 * S

  (correct rounding to T of a value within a few fp32 ulps of the magnitude S = |x| * |u| of the computation;
  ulp_T at the larger of |out| and |ref64|).
  The inputs lie mostly where the erf and tanh GELUs differ by many ulps of T (x in [-5, -2.5]), and the test
  checks that the other GELU breaks the bound for at least a quarter of the elements: computing tanh where erf was
  asked (or the reverse) fails.
* FAST_EPI off, the rounding sequence is eager's (g and u rounded to T as eager's GEMMs store them, then the
  pointwise GeGLU with eager's rounding): the output is compared bit for bit with an emulation of that sequence,
  tests/kernel/_emulation.py under the interpreter, eager's own fp32 ops on a GPU.
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _emulation as emu
from ._reference import APPROX

HALF = [torch.bfloat16, torch.float16]  # the fused MLP's dtypes
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E32 = torch.finfo(torch.float32).eps
# the interpreter's exp/exp2 overflow to inf in GELU's far tails (the sigmoid and tanh saturate, as on the GPU)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
BM, BN = 16, 32  # test tiles; the tensors are whole tiles (the epilogues' masks are the kernels' business)

# The package's jit functions under test, set by the `tri` fixture: the kernel module is the one `kernels` loaded
# from the build (its name depends on the build), and the test kernels below resolve these globals when they run.
_geglu_epilogue = None


@triton.jit
def _epilogue_kernel(acc_g_ptr, acc_u_ptr, y_ptr, N, TANH: tl.constexpr, FAST_EPI: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc_g = tl.load(acc_g_ptr + offs)
    acc_u = tl.load(acc_u_ptr + offs)
    tl.store(y_ptr + offs, _geglu_epilogue(acc_g, acc_u, y_ptr.dtype.element_ty, TANH, FAST_EPI, K_BETA_TANH,
                                           K_KAPPA, K_ALPHA))


@pytest.fixture(scope="module")
def tri(geglu):
    """The loaded kernel's pointwise kernels module (eager's constants); binds the epilogue under test for the kernels
    above."""
    mod = importlib.import_module(geglu.__name__ + ".mlp.tiles")
    globals()["_geglu_epilogue"] = mod.geglu_epilogue
    return importlib.import_module(geglu.__name__ + ".pointwise.kernels")


def _accumulators(m=2 * BM, n=2 * BN):
    """fp32 accumulators: half of the gates in [-5, -2.5] (where erf and tanh GELU differ by 3-85 %), the rest
    randn * 3 (both tails and the curved middle); ups randn."""
    g = torch.randn(m, n, dtype=torch.float32) * 3
    tail = torch.rand(m, n) < 0.5
    g[tail] = -2.5 - 2.5 * torch.rand(int(tail.sum()))
    return g.to(DEVICE), torch.randn(m, n, dtype=torch.float32).to(DEVICE)


def _run_epilogue(tri, acc_g, acc_u, dtype, tanh, fast):
    m, n = acc_g.shape
    y = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    _epilogue_kernel[(m // BM, n // BN)](acc_g, acc_u, y, n, TANH=tanh, FAST_EPI=fast, BLOCK_M=BM, BLOCK_N=BN,
                                         K_BETA_TANH=tri.K_BETA_TANH, K_KAPPA=tri.K_KAPPA, K_ALPHA=tri.K_ALPHA,
                                         enable_fp_fusion=False)
    return y


def _gelu64(x, tanh):
    return F.gelu(x.double(), approximate="tanh" if tanh else "none")


def _ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |v| (fp64 tensor), subnormals included."""
    fi = torch.finfo(dtype)
    mantissa_bits, min_exponent = round(-math.log2(fi.eps)), round(math.log2(fi.tiny))
    _, e = torch.frexp(v.abs().clamp_min(fi.tiny))  # |v| = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), (e - 1).clamp_min(min_exponent) - mantissa_bits)


def _bound(out, ref64, scale):
    """The stated bound (module docstring), elementwise."""
    ulp = _ulp(torch.maximum(out.double().abs(), ref64.abs()), out.dtype)
    return ulp / 2 + 16 * E32 * scale.double()


def _check_bound(out, ref64, scale, other64, what):
    """out within the bound of ref64; and other64 (the other GELU's value) outside it for >= 1/4 of the
    elements, so that the wrong GELU would not pass."""
    allowed = _bound(out, ref64, scale)
    err = (out.double() - ref64).abs()
    worst = (err / allowed).max().item()
    assert worst <= 1.0, f"{what}: error up to {worst:.3g} x the bound"
    caught = ((other64 - ref64).abs() > 2 * allowed).float().mean().item()
    assert caught >= 0.25, f"{what}: the other GELU breaks the bound for only {caught:.0%} of the elements"


def _eager_fwd(g, u, tanh):
    """T(float(T(gelu_fp32(g))) * float(u)) for g, u in T."""
    if g.is_cuda:
        return F.gelu(g, approximate="tanh" if tanh else "none") * u
    return emu.forward(g, u, tanh)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", HALF)
def test_fast_inference_epilogue(tri, dtype, approximate):
    """FAST_EPI: y = T(gelu(acc_g) * acc_u) within the bound of fp64."""
    tanh = approximate == "tanh"
    acc_g, acc_u = _accumulators()
    y = _run_epilogue(tri, acc_g, acc_u, dtype, tanh, True)
    _check_bound(y.cpu(), (_gelu64(acc_g, tanh) * acc_u.double()).cpu(), (acc_g.abs() * acc_u.abs()).cpu(),
                 (_gelu64(acc_g, not tanh) * acc_u.double()).cpu(), f"fast y {approximate}")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", HALF)
def test_eager_rounding_epilogue(tri, dtype, approximate):
    """FAST_EPI off: the accumulators rounded to T as eager's GEMMs store them, then eager's GeGLU of those, bit
    for bit: y = T(float(T(gelu(T(acc_g)))) * float(T(acc_u)))."""
    tanh = approximate == "tanh"
    acc_g, acc_u = _accumulators()
    y = _run_epilogue(tri, acc_g, acc_u, dtype, tanh, False)
    gT, uT = acc_g.to(dtype), acc_u.to(dtype)
    emu.assert_bitwise(y, _eager_fwd(gT, uT, tanh), f"eager-rounding y {approximate}")
    # the data tells the GELUs apart at T's precision (the bitwise check above would see the other one)
    assert not torch.equal(_eager_fwd(gT, uT, not tanh), y)
