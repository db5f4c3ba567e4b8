"""Why forward+backward of the MLP at M=16 (16x4096x14336) took ~1250 µs for ours, Liger and torch.compile but
599 µs for eager: times each variant and each backward GEMM. Dev tool.

    python benchmarks/mlp_small_m.py [--build-dir build]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median_us, mlp_impls  # noqa: E402


def _no_grad(mod, x):
    with torch.no_grad():
        return mod(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    M, D, H = 16, 4096, 14336
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, D, **bf).requires_grad_()
    wg, wu = (torch.randn(H, D, **bf) * 0.02).requires_grad_(), (torch.randn(H, D, **bf) * 0.02).requires_grad_()
    wd = (torch.randn(D, H, **bf) * 0.02).requires_grad_()
    dy = torch.randn(M, D, **bf)
    params = [x, wg, wu, wd]

    def mlp(act):
        return lambda: torch.autograd.grad(F.linear(act(F.linear(x, wg), F.linear(x, wu)), wd), params, dy)

    variants = {
        "eager": mlp(lambda g, u: F.gelu(g, approximate="tanh") * u),
        "ours": mlp(lambda g, u: geglu.geglu(g, u, "tanh")),
        "ours inplace_backward": mlp(lambda g, u: geglu.geglu(g, u, "tanh", inplace_backward=True)),
    }
    # The layers as the benchmark times them: transformers' Gemma MLP, and the same module with our hub layer's
    # forward (what kernelize installs).
    impls = mlp_impls(geglu, D, H)
    for name in ("eager", "ours"):
        mod = impls[name]
        mod_params = list(mod.parameters()) + [x]
        variants[f"layer {name}"] = (lambda mod=mod, mod_params=mod_params:
                                     torch.autograd.grad(mod(x), mod_params, dy))
        variants[f"layer {name}, no_grad fwd"] = lambda mod=mod: _no_grad(mod, x)
    # Host-bound and noisy (±30 % between runs): interleaved rounds, each variant's median over the rounds, and
    # ours/eager per round (the pairs ran seconds apart, under the same clocks and host load).
    rounds = {name: [] for name in variants}
    for _ in range(15):
        for name, fn in variants.items():
            rounds[name].append(_median_us(fn, rep_ms=40))
    for name, ts in rounds.items():
        ref = name.replace("ours", "eager") if name.startswith("layer") else "eager"
        ratios = sorted(t / e for t, e in zip(ts, rounds[ref]))
        print(f"{name:<32} {sorted(ts)[len(ts) // 2]:9.1f} us (median of {len(ts)} rounds; "
              f"per round vs {ref}: median {ratios[len(ratios) // 2]:.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f})")
    g = torch.randn(M, H, **bf)
    for label, fn in {
        "dW = g^T @ x (contiguous g)": lambda: g.t() @ x.detach(),
        "dW = (g^T).contiguous() @ x": lambda: g.t().contiguous() @ x.detach(),
        "mm out [H,D] via torch.mm(g.t(), x)": lambda: torch.mm(g.t(), x.detach()),
    }.items():
        print(f"{label:<40} {_median_us(fn):9.1f} us")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name in ("layer eager", "layer ours"):
        for _ in range(3):
            variants[name]()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                variants[name]()
            torch.cuda.synchronize()
        print(f"--- {name}: 5 x fwd+bwd, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        print(f"--- {name}: by GPU time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
