"""Clock and power while the backward's d_h GEMM runs with and without its fused dGeGLU (issue 7): is the Gluon
kernel's epilogue slowing its main loop through the GPU's power limit (lower SM clocks) rather than through the
instructions it issues? Each variant runs back to back for a few seconds while `nvidia-smi` samples the SM clock and
the board power every 50 ms; the table gives each variant's time per call and the medians of the samples taken
during its run (the first half second dropped).

Dev tool (device); bf16, tanh, 8192x2304x9216 by default.

    python benchmarks/ws_power.py [--build-dir build] [--shape 8192x2304x9216] [--seconds 3]
"""
import argparse
import importlib
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shape", default="8192x2304x9216")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    ws = importlib.import_module(geglu.__name__ + "._gluon_bwd")
    pw = importlib.import_module(geglu.__name__ + "._custom_ops")
    M, D, H = map(int, args.shape.split("x"))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(M, D, generator=gen, **bf)
    wd = torch.randn(D, H, generator=gen, **bf) * H ** -0.5
    g0, u0 = (torch.randn(M, H, generator=gen, **bf) for _ in range(2))
    g, u, dh, dg, du = g0.clone(), u0.clone(), *(torch.empty(M, H, **bf) for _ in range(3))
    variants = {
        "cuBLAS d_h = mm(dy, Wd)": lambda: torch.mm(dy, wd, out=dh),
        "pointwise dGeGLU alone": lambda: pw._backward_into(dg, du, dh, g0, u0, "tanh"),
        "cuBLAS d_h + pointwise dGeGLU": lambda: (torch.mm(dy, wd, out=dh),
                                                  pw._backward_into(dg, du, dh, g0, u0, "tanh")),
        "Gluon ws, no epilogue": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, epi_mode=0),
        "Gluon ws, loads/stores only": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, epi_mode=2),
        "Gluon ws, full (exact)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True),
        "Gluon ws, full (fast dGeGLU)": lambda: ws.down_dgeglu_ws(dy, wd, g, u, True, fast=True),
        "Triton fused backward": lambda: kt.down_dgeglu_into(dy, wd, g, u, True, False),
    }
    for fn in variants.values():  # compile
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    spans = {}
    for name, fn in variants.items():
        g.copy_(g0), u.copy_(u0)
        torch.cuda.synchronize()
        t0 = datetime.now()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls = 0
        start.record()
        while (datetime.now() - t0).total_seconds() < args.seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        spans[name] = (t0, datetime.now(), start.elapsed_time(end) * 1e3 / calls)
        time.sleep(1.0)  # let the clock settle between variants
    smi.terminate()
    out = smi.communicate()[0]
    samples = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f"), float(parts[1]), float(parts[2]),
                            float(parts[3])))
        except (ValueError, IndexError):
            continue
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}, bf16, tanh; "
          f"{len(samples)} nvidia-smi samples")
    print(f"  {'variant':<34} {'us/call':>9} {'SM MHz':>7} {'W':>6} {'degC':>5}  samples")
    for name, (t0, t1, us) in spans.items():
        inside = [s for s in samples if (s[0] - t0).total_seconds() > 0.5 and s[0] <= t1]
        if not inside:
            print(f"  {name:<34} {us:9.1f}  (no samples)")
            continue
        med = [statistics.median(s[i] for s in inside) for i in (1, 2, 3)]
        print(f"  {name:<34} {us:9.1f} {med[0]:7.0f} {med[1]:6.0f} {med[2]:5.0f}  {len(inside)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
