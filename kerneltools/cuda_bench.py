"""Time the compiled ops against the device-to-device copy bandwidth (the floor), on a GPU.

    python -m kerneltools.cuda_bench                       # default shapes, bf16, both GELUs
    python -m kerneltools.cuda_bench --plans auto 256,2 256,1 256,p2 256,p4 128,p4 --shapes 8192x14336
    python -m kerneltools.cuda_bench --plans 256,2          # one forced launch plan

Bytes counted: forward reads gate and up and writes out (3 tensors), backward reads grad, gate, up and writes
d_gate, d_up (5). "% copy" divides the achieved bytes/s by a large torch copy's (read + write) bytes/s, measured
in the same process. Each time is the median of --reps launches, L2 flushed before each (events around the op
only). Eager PyTorch (F.gelu(g) * u and its autograd) is timed for reference.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.nn.functional as F

from .cuda_ops import load_package

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHAPES = ["8192x14336", "8192x24576", "8192x9216", "32768x4096", "1024x14336", "16x14336", "1x14336"]


def median_ms(fn, reps: int, flush: torch.Tensor) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(flush: torch.Tensor, reps: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(1)  # 1 GiB, well past L2
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, flush)
    return 2 * src.numel() / (ms * 1e-3)


def bench(ops, shapes, dtype, reps, eager: bool, plan: str) -> None:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth(flush, reps)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read + write); plan {plan}; {dtype}")
    header = f"{'shape':>12} {'gelu':>5} | {'fwd us':>8} {'TB/s':>5} {'%copy':>6} | {'bwd us':>8} {'TB/s':>5} {'%copy':>6}"
    if eager:
        header += f" | {'eager fwd':>9} {'eager bwd':>9}"
    print(header)
    esize = torch.empty((), dtype=dtype).element_size()
    for shape in shapes:
        m, d = (int(x) for x in shape.lower().split("x"))
        g = (torch.randn(m, d, device="cuda") * 3).to(dtype)
        u = (torch.randn(m, d, device="cuda") * 3).to(dtype)
        dy = (torch.randn(m, d, device="cuda") * 3).to(dtype)
        out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        for approx in ("none", "tanh"):
            t = approx == "tanh"
            fwd = median_ms(lambda: ops.geglu_fwd(out, g, u, t), reps, flush)
            bwd = median_ms(lambda: ops.geglu_bwd(dg, du, dy, g, u, t), reps, flush)
            fb, bb = 3 * m * d * esize, 5 * m * d * esize
            row = (f"{shape:>12} {approx:>5} | {fwd * 1e3:8.1f} {fb / fwd / 1e9:5.2f} {100 * fb / fwd / 1e-3 / bw:5.1f}% |"
                   f" {bwd * 1e3:8.1f} {bb / bwd / 1e9:5.2f} {100 * bb / bwd / 1e-3 / bw:5.1f}%")
            if eager:
                gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()

                def eager_bwd():
                    torch.autograd.grad(F.gelu(gr, approximate=approx) * ur, (gr, ur), dy)

                ef = median_ms(lambda: F.gelu(g, approximate=approx) * u, reps, flush)
                eb = median_ms(eager_bwd, reps, flush)  # includes its forward recompute
                row += f" | {ef * 1e3:9.1f} {eb * 1e3:9.1f}"
            print(row, flush=True)
        del g, u, dy, out, dg, du


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kerneltools.cuda_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=None)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="MxD shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-eager", action="store_true", help="skip the eager PyTorch reference timings")
    p.add_argument("--plans", nargs="+", default=None,
                   help="launch plans to compare (geglu.configure(cuda_plan=...) values: 256,2 = one tile per block, 2 vectors per "
                        "thread; 256,p4 = cp.async pipeline, 4 stages; auto = the built-in choice)")
    args = p.parse_args(argv)
    package = load_package(args.build_dir)
    ops = importlib.import_module(package.__name__ + "._ops").ops
    plans = args.plans or [package.get_config().cuda_plan or "auto"]
    for plan in plans:
        with package.configure(cuda_plan=plan):
            bench(ops, args.shapes, DTYPES[args.dtype], args.reps, eager=not args.no_eager and plan == plans[0],
                  plan=plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
