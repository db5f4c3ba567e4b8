"""Host cost of a GeGLU forward+backward at decode size with autograd (1 x 14336 bf16): eager, ours, a trivial
Python autograd.Function, with and without the autograd engine's device threads, and a cProfile of ours (engine
threads off, so that the backward runs on the profiled thread). Dev tool for the low-overhead work.

    python benchmarks/autograd_overhead.py [--build-dir build]
"""
import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import per_call_us  # noqa: E402


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return torch.mul(a, b)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    g = torch.randn(1, 14336, device="cuda").bfloat16().requires_grad_()
    u = torch.randn(1, 14336, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(1, 14336, device="cuda").bfloat16()
    rows = {
        "eager fwd+bwd": lambda: torch.autograd.grad(F.gelu(g, approximate="tanh") * u, [g, u], dy),
        "ours fwd+bwd": lambda: torch.autograd.grad(geglu.geglu(g, u, "tanh"), [g, u], dy),
        "torch.mul fwd+bwd": lambda: torch.autograd.grad(torch.mul(g, u), [g, u], dy),
        "Python Function(mul) fwd+bwd": lambda: torch.autograd.grad(Twice.apply(g, u), [g, u], dy),
        "eager fwd": lambda: F.gelu(g, approximate="tanh") * u,
        "ours fwd": lambda: geglu.geglu(g, u, "tanh"),
    }
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, fn in rows.items():
            print(f"{name:<34} engine threads {'on ' if threads else 'off'} {per_call_us(fn, 1000):8.2f} us/call")
    torch.autograd.set_multithreading_enabled(False)
    fn = rows["ours fwd+bwd"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue())


if __name__ == "__main__":
    main()
