"""What GeGLUMLP's per-shape timing decides (fused gate/up inference path or not) at the benchmark shapes, with the
times it compared, next to do_bench medians of both paths in interleaved rounds. Dev tool.

    python benchmarks/fused_decision.py [--build-dir build]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    fm = importlib.import_module(geglu.__name__ + "._fused_mlp")
    real = fm._fused_is_faster

    def traced(fused, regular, *a, **k):
        times = {"fused": [], "regular": []}
        for _ in range(3):  # back to back, L2 warm: what a loop of MLP calls alone would see
            for name, fn in (("fused", fused), ("regular", regular)):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(2):
                    fn()
                e.record()
                e.synchronize()
                times[name].append(s.elapsed_time(e) / 2 * 1e3)
        print("  back-to-back pairs (us):", {k: [round(t) for t in v] for k, v in times.items()})
        return real(fused, regular, *a, **k)

    fm._fused_is_faster = traced
    for M, D, H in ((8192, 2304, 9216), (8192, 4096, 14336)):
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, D, **bf)
        wg, wu, wd = (torch.randn(H, D, **bf) * D ** -0.5, torch.randn(H, D, **bf) * D ** -0.5,
                      torch.randn(D, H, **bf) * H ** -0.5)
        print(f"{M}x{D}x{H}:")
        with torch.no_grad():
            y = fm.inference_forward(x, wg, wu, wd, "tanh")
            print(f"  decision: fused={dict(fm._DECISIONS)}")
            paths = {"fused": lambda: fm.fused_geglu_mlp_forward(x, wg, wu, wd, "tanh"),
                     "regular": lambda: fm._regular(x, wg, wu, wd, "tanh")}
            res = {k: [] for k in paths}
            for _ in range(5):
                for k, fn in paths.items():
                    res[k].append(_median_us(fn, rep_ms=100))
            print("  do_bench medians over 5 interleaved rounds (us):", {k: round(sorted(v)[2], 1) for k, v in res.items()},
                  "all:", {k: [round(t) for t in v] for k, v in res.items()})
        del x, wg, wu, wd, y
        fm._DECISIONS.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
