"""Gemma's RMSNorm references and the stated bounds (docs/rmsnorm.md), shared by tests/kernel/test_rmsnorm.py and
tests/tools/test_transformers_rmsnorm.py."""

import math
import zlib

import pytest
import torch

E32 = torch.finfo(torch.float32).eps
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def seed_of(*params) -> int:
    return zlib.crc32(repr(params).encode())


def data(shape, dtype, wdtype=None, scale=1.0, seed=0, device="cpu", wscale=0.5):
    """x ~ N(0, scale^2), w ~ N(0, wscale^2) (Gemma's weights are small offsets from 0), dy ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    w = (torch.randn(D, generator=g) * wscale).to(wdtype or dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x.to(device), w.to(device), dy.to(device)


def host(x, w, eps=EPS, offset=1.0):
    """transformers' Gemma3RMSNorm.forward (with offset for the 1.0), op for op."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (offset + w.float())).type_as(x)


def host_grads(x, w, dy, eps=EPS, offset=1.0):
    xe = x.detach().clone().requires_grad_()
    we = w.detach().clone().requires_grad_()
    y = host(xe, we, eps, offset)
    y.backward(dy)
    return y.detach(), xe.grad, we.grad


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def ref64(x, w, eps=EPS, offset=1.0):
    """The formula in fp64, with eager's fp32 scale fl(offset + w) and fp32 eps."""
    x64 = x.double()
    s = (offset + w.float()).double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + f32(eps))
    return x64 * r * s


def bwd_ref(x, w, dy, eps=EPS, offset=1.0):
    """fp64 (dx, dw) and the scales of their error bounds: dx's r * (|dxn| + |xn| * mean|dxn * xn|), dw's
    sum over rows of |dy * xn|."""
    x64, g = x.double(), dy.double()
    s = (offset + w.float()).double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + f32(eps))
    xn, dxn = x64 * r, g * s
    dx = r * (dxn - xn * (dxn * xn).mean(-1, keepdim=True))
    scale_dx = r * (dxn.abs() + xn.abs() * (dxn * xn).abs().mean(-1, keepdim=True))
    lead = list(range(x.dim() - 1))
    dw = (g * xn).sum(lead) if lead else g * xn
    scale_dw = (g * xn).abs().sum(lead) if lead else (g * xn).abs()
    return dx, dw, scale_dx, scale_dw


def ulp(v, dtype):
    """The spacing of ``dtype`` at |v| (fp64 tensor in, fp64 out), subnormal spacing at the bottom."""
    fi = torch.finfo(dtype)
    a = v.abs().clamp_min(fi.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(a))) * fi.eps


def k_fwd(D: int) -> float:
    """fp32 error allowance of the forward in eps32 * |ref| (measured worst on random data: 2.0 here, CPU)."""
    return 4 + math.log2(max(D, 2)) / 2


def k_bwd(M: int, D: int) -> float:
    """fp32 error allowance of dx and dw in eps32 * scale (measured worst: 1.8 here, CPU, eager included)."""
    return 4 + (math.log2(max(D, 2)) + math.log2(max(M, 2))) / 2


def excess(result, ref, scale, dtype, k):
    """max over elements of (|result - ref| - ulp_T/2) / (k eps32 scale): <= 1 is within the bound."""
    r = result.double()
    err = (r - ref).abs() - 0.5 * ulp(torch.maximum(ref.abs(), r.abs()), dtype)
    if err.numel() == 0:
        return 0.0
    return (err.clamp_min(0) / (k * E32 * scale + 1e-300)).max().item()


def assert_fwd_bound(y, x, w, eps=EPS, offset=1.0, what=""):
    ref = ref64(x, w, eps, offset)
    worst = excess(y, ref, ref.abs(), y.dtype, k_fwd(x.shape[-1]))
    assert worst <= 1.0, f"{what}: forward error {worst:.3g} x the bound"


def assert_bwd_bound(dx, dw, x, w, dy, eps=EPS, offset=1.0, what=""):
    rdx, rdw, sdx, sdw = bwd_ref(x, w, dy, eps, offset)
    k = k_bwd(x.numel() // max(x.shape[-1], 1), x.shape[-1])
    worst_dx = excess(dx, rdx, sdx, dx.dtype, k)
    worst_dw = excess(dw, rdw, sdw, dw.dtype, k) if dw is not None else 0.0  # None: a norm without weight
    assert worst_dx <= 1.0 and worst_dw <= 1.0, f"{what}: dx {worst_dx:.3g}, dw {worst_dw:.3g} x the bound"


def no_worse_than_eager(y, ye, ref, dtype):
    """(fraction of elements where ours is farther from fp64 than eager, largest excess in ulps of fp32)."""
    eo, ee = (y.double() - ref).abs(), (ye.double() - ref).abs()
    if eo.numel() == 0:
        return 0.0, 0.0
    excess = ((eo - ee).clamp_min(0) / ulp(ref, torch.float32)).max().item()
    return (eo > ee).double().mean().item(), excess


# Limits for no_worse_than_eager. Ours and eager differ only through r, the rsqrt of the row sum, which the two
# round differently in some rows; where that moves an output, each is the closer one about half of the time.
# Measured on random data: 16-bit outputs farther in <= 3.1e-5 of the elements (a rounding to the neighbouring
# value of T), fp32 in 7-9 % over many rows and up to 22 % over 3 rows; excess <= 2.9 fp32 ulps.
WORSE_FRACTION = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 0.5}
WORSE_EXCESS_ULP32 = 8.0


@pytest.fixture(params=["triton"] if torch.cuda.is_available() else ["cpu", "triton"])
def norm_impl(request, geglu):
    """(implementation, device) for the norm tests: on a GPU the Triton kernels (the norm has no compiled CUDA
    implementation, so conftest's 'cuda' and 'triton' would run the same code twice); on CPU the CPU implementation
    (backend 'auto') and the Triton kernels under the interpreter (backend 'triton')."""
    name = request.param
    geglu.set_backend("auto" if name == "cpu" or torch.cuda.is_available() else "triton")
    try:
        yield name, ("cuda" if torch.cuda.is_available() else "cpu")
    finally:
        geglu.set_backend("auto")


class Calls:
    """Counts runs of a loaded kernel's norm implementations (wrapped, still called): proof that ours ran.
    ``package``: the loaded kernel's module name (``geglu.__name__``)."""

    NAMES = {"rmsnorm.ops": ("cpu_forward", "cpu_backward", "scaled_host_forward"),
             "rmsnorm.kernels": ("forward", "backward")}

    def __init__(self, package: str, monkeypatch):
        import importlib

        self.n = {}
        for mod_name, fns in self.NAMES.items():
            mod = importlib.import_module(f"{package}.{mod_name}")
            for fn in fns:
                monkeypatch.setattr(mod, fn, self._counted(f"{mod_name}.{fn}", getattr(mod, fn)))

    def _counted(self, key, fn):
        self.n[key] = 0

        def counted(*a, **k):
            self.n[key] += 1
            return fn(*a, **k)

        return counted

    def take(self):
        out = {k: v for k, v in self.n.items() if v}
        self.n = dict.fromkeys(self.n, 0)
        return out
