"""A small sweep through the compiled ops, for compute-sanitizer (docs/cuda.md):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m kerneltools.sanitize
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m kerneltools.sanitize --quick

PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so memcheck sees an access one element
past a tensor (the caching allocator would hide it inside its pool). Every case covers fp32/fp16/bf16 x exact/tanh
and forward + backward: odd d, M = 1, strided rows (vector and scalar paths), packed halves, unaligned bases,
in-place backward, empty inputs, under several launch plans (one tile per block, cp.async pipeline), and
(without --quick) tensors of more than 2^31 elements (contiguous, and packed halves of a [M, 2d] tensor, i.e.
strided rows). Results are also compared bitwise with eager PyTorch. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F

from .cuda_ops import load_package

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def randn(*shape, dtype):
    return (torch.randn(*shape, device="cuda") * 3).to(dtype)


def same_bits(a, b) -> bool:
    return torch.equal(a.contiguous().view(INT[a.dtype]), b.contiguous().view(INT[b.dtype]))


def eager_fwd(g, u, approx):
    return F.gelu(g, approximate=approx) * u


def eager_bwd(dy, g, u, approx):
    g = g.detach().clone().requires_grad_(True)
    u = u.detach().clone().requires_grad_(True)
    (F.gelu(g, approximate=approx) * u).backward(dy)
    return g.grad, u.grad


def small_cases(dtype):
    """(name, gate, up, grad, out, d_gate, d_up) with fresh data; outputs NaN-poisoned."""
    def nan(*shape):
        return torch.full(shape, float("nan"), device="cuda", dtype=dtype)

    def wide(m, d, pad):
        return randn(m, d + pad, dtype=dtype)[:, :d]

    def unaligned(m, d):
        return randn(m * d + 1, dtype=dtype)[1:].view(m, d)

    for m, d in [(1, 14336), (1, 7), (3, 7), (17, 127), (64, 1000), (0, 64), (8, 0)]:
        yield f"contiguous {m}x{d}", randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), randn(m, d, dtype=dtype), \
            nan(m, d), nan(m, d), nan(m, d)
    for m, d, pad in [(33, 4096, 8), (33, 4095, 5), (2, 9, 3)]:
        yield f"strided {m}x{d} pitch {d + pad}", wide(m, d, pad), wide(m, d, pad), wide(m, d, pad), \
            nan(m, d + pad)[:, :d], nan(m, d + pad)[:, :d], nan(m, d + pad)[:, :d]
    for m, d in [(5, 7), (16, 4096), (3, 127)]:
        x, grad = randn(m, 2 * d, dtype=dtype), nan(m, 2 * d)
        yield f"packed {m}x[{d}|{d}]", x[:, :d], x[:, d:], randn(m, d, dtype=dtype), nan(m, d), grad[:, :d], grad[:, d:]
    for m, d in [(1, 4096), (9, 1000)]:
        yield f"unaligned {m}x{d}", unaligned(m, d), unaligned(m, d), unaligned(m, d), \
            torch.full((m * d + 1,), float("nan"), device="cuda", dtype=dtype)[1:].view(m, d), nan(m, d), nan(m, d)


def run_case(ops, name, g, u, dy, out, dg, du, failures):
    for approx in ("none", "tanh"):
        tanh = approx == "tanh"
        ops.geglu_fwd(out, g, u, tanh)
        ops.geglu_bwd(dg, du, dy, g, u, tanh)
        ref_dg, ref_du = eager_bwd(dy.contiguous(), g.contiguous(), u.contiguous(), approx)
        for what, got, ref in [("out", out, eager_fwd(g.contiguous(), u.contiguous(), approx)),
                               ("d_gate", dg, ref_dg), ("d_up", du, ref_du)]:
            if not same_bits(got, ref):
                failures.append(f"{name} {str(g.dtype)[6:]} {approx}: {what} differs from eager")
    # in place: d_gate over gate, d_up over up
    gi, ui = g.clone(), u.clone()
    ref_dg, ref_du = eager_bwd(dy.contiguous(), g.contiguous(), u.contiguous(), "tanh")
    ops.geglu_bwd(gi, ui, dy, gi, ui, True)
    if not (same_bits(gi, ref_dg) and same_bits(ui, ref_du)):
        failures.append(f"{name} {str(g.dtype)[6:]}: in-place backward differs from eager")


def big_cases(ops, failures):
    d = 8192
    m = (1 << 31) // d + 1
    rows = [0, m // 2, (1 << 31) // d - 1, (1 << 31) // d, m - 1]
    # contiguous, 2^31 + 8192 elements (flattened to one long row)
    g = torch.empty(m, d, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    u = torch.empty(m, d, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.geglu_fwd(out, g, u, False)
    if not same_bits(out[rows], eager_fwd(g[rows], u[rows], "none")):
        failures.append("2^31+ contiguous: out differs from eager")
    del g, u, out
    torch.cuda.empty_cache()
    # packed halves of a [m, 2d] tensor: strided rows, 2^31 + 8192 elements per half
    x = torch.empty(m, 2 * d, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.geglu_fwd(out, x[:, :d], x[:, d:], True)
    if not same_bits(out[rows], eager_fwd(x[rows, :d], x[rows, d:], "tanh")):
        failures.append("2^31+ packed: out differs from eager")
    del x, out
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kerneltools.sanitize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=None, help="build/ holding the compiled variant (default: $GEGLU_BUILD_DIR or build/)")
    p.add_argument("--quick", action="store_true", help="skip the >2^31-element tensors")
    p.add_argument("--plans", nargs="+", default=["auto", "256,1", "256,2", "64,1", "256,p2", "64,p4"],
                   help="launch plans to sweep (geglu.configure(cuda_plan=...) values; auto = the built-in choice)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    package = load_package(args.build_dir)
    ops = importlib.import_module(package.__name__ + "._ops").ops
    torch.manual_seed(0)
    failures: list[str] = []
    t0 = time.monotonic()
    n = 0
    for plan in args.plans:
        with package.configure(cuda_plan=plan):
            for dtype in DTYPES:
                for name, *tensors in small_cases(dtype):
                    run_case(ops, f"[{plan}] {name}", *tensors, failures)
                    n += 1
            torch.cuda.synchronize()
    if not args.quick:
        for plan in ("auto", "256,2"):  # the pipelined and the one-tile-per-block kernels
            with package.configure(cuda_plan=plan):
                big_cases(ops, failures)
                torch.cuda.synchronize()
            n += 2
    torch.cuda.synchronize()
    for f in failures:
        print("MISMATCH", f)
    print(f"sanitize sweep: {n} cases, {len(failures)} mismatches, {time.monotonic() - t0:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
