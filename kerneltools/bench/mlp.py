"""The whole Gemma-style MLP (bf16, tanh GeGLU): eager, torch.compile, Liger's LigerGEGLUMLP and our GeGLUMLP layer;
forward and forward+backward times, % of cuBLAS's rate in the same run, ratio to eager in adjacent pairs, peak memory.

    python -m kerneltools bench --mlp-only [--build-dir build] [--out DIR]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .common import cublas_tflops, median, median_us, pair_schedule, peak_mib

MLP_SHAPES = [(8192, 2304, 9216), (8192, 4096, 14336), (16, 4096, 14336)]


def _no_grad_call(torch, mod, x):
    with torch.no_grad():
        return mod(x)


def mlp_impls(geglu, D: int, H: int) -> dict:
    """The same Gemma-style MLP (bf16, tanh GeGLU, shared weights) as eager, torch.compile, Liger's LigerGEGLUMLP
    (when installed) and ours (the hub layer's forward bound to the module, as kernelize does)."""
    import torch
    from torch import nn

    class GatedMLP(nn.Module):  # transformers' Gemma MLP
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(D, H, bias=False)
            self.up_proj = nn.Linear(D, H, bias=False)
            self.down_proj = nn.Linear(H, D, bias=False)
            self.act_fn = nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    base = GatedMLP().to("cuda", torch.bfloat16)
    impls = {"eager": base, "torch.compile": torch.compile(base, dynamic=False)}
    try:
        from liger_kernel.transformers.geglu import LigerGEGLUMLP  # type: ignore

        class Cfg:
            hidden_size, intermediate_size, hidden_act = D, H, "gelu_pytorch_tanh"

        liger = LigerGEGLUMLP(Cfg()).to("cuda", torch.bfloat16)
        liger.load_state_dict(base.state_dict(), strict=False)
        impls["liger"] = liger
    except Exception as e:  # not installed
        print(f"(Liger not available: {e})", file=sys.stderr)
    ours = GatedMLP().to("cuda", torch.bfloat16)
    ours.load_state_dict(base.state_dict())
    ours.forward = geglu.layers.GeGLUMLP.forward.__get__(ours)
    impls["ours"] = ours
    if geglu.get_config().fused_mlp:  # ours without the fused inference path, as its own row; training is the same
        unfused = GatedMLP().to("cuda", torch.bfloat16)
        unfused.load_state_dict(base.state_dict())
        layer_forward = geglu.layers.GeGLUMLP.forward.__get__(unfused)

        def unfused_forward(x):
            with geglu.configure(fused_mlp=False):
                return layer_forward(x)

        unfused.forward = unfused_forward
        impls[UNFUSED_ROW] = unfused
    return impls


UNFUSED_ROW = "ours, GEGLU_FUSED_MLP=0"


def run_mlp(build_dir: Path, shapes=MLP_SHAPES, log=print) -> dict:
    """The whole MLP (bf16, tanh GeGLU): eager, torch.compile, Liger's LigerGEGLUMLP and our GeGLUMLP layer;
    forward and forward+backward median times, % of the cuBLAS FLOP rate measured here, peak memory."""
    import torch
    import kernels

    geglu = kernels.get_local_kernel(build_dir)
    peak_tflops = cublas_tflops(torch)
    log(f"cuBLAS bf16 8192^3: {peak_tflops:.0f} TFLOP/s")
    rows = []
    fm = importlib.import_module(geglu.__name__ + ".mlp.inference")
    for M, D, H in shapes:
        impls = mlp_impls(geglu, D, H)
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        xg = x.clone().requires_grad_()
        dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        flops_f = 6 * M * D * H
        # GEMM-bound timings drift with the GPU's clocks (seen: the same cuBLAS kernels 6% apart between two
        # runs), and host-bound rows (M <= 64) shift by 15 % with their place in a round (the same ops measured
        # 1.15x eager in the middle of a round with compile and Liger, 0.97x in a round without them). So each
        # implementation is timed in a pair with eager, right next to it, the pair's order alternating; every
        # time is kept for the medians, and each pair gives a ratio to eager.
        timings = {name: ([], []) for name in impls}
        ratios = {name: ([], []) for name in impls}
        others = [name for name in impls if name != "eager"]
        rounds = 3 if M > 64 else 11  # decode-sized rows are host-bound and noisier (±30 %)
        for pair in pair_schedule(others, rounds):
            name = pair[1] if pair[0] == "eager" else pair[0]
            got = {}
            for n in pair:
                mod = impls[n]
                params = [p for p in mod.parameters()] + [xg]
                t_f = median_us(lambda: _no_grad_call(torch, mod, x), rep_ms=100)
                t_fb = None
                if n != UNFUSED_ROW:  # its training path is "ours"
                    t_fb = median_us(lambda: torch.autograd.grad(mod(xg), params, dy), rep_ms=100)
                got[n] = (t_f, t_fb)
                timings[n][0].append(t_f)
                if t_fb is not None:
                    timings[n][1].append(t_fb)
            ratios[name][0].append(got[name][0] / got["eager"][0])
            if got[name][1] is not None:
                ratios[name][1].append(got[name][1] / got["eager"][1])
        for name, mod in impls.items():
            params = [p for p in mod.parameters()] + [xg]

            def fwd_bwd():
                torch.autograd.grad(mod(xg), params, dy)

            t_f = median(timings[name][0])
            t_fb = median(timings[name][1]) if timings[name][1] else None
            vs_f = round(median(ratios[name][0]), 3) if name != "eager" else 1.0
            vs_fb = (round(median(ratios[name][1]), 3) if ratios[name][1] else None) if name != "eager" else 1.0
            fwd_peak = peak_mib(torch, lambda: _no_grad_call(torch, mod, x))
            peak = peak_mib(torch, fwd_bwd) if t_fb is not None else None
            rows.append(dict(M=M, D=D, H=H, impl=name, fwd_us=round(t_f, 1),
                             fwd_bwd_us=round(t_fb, 1) if t_fb else None,
                             fwd_pct_cublas=round(100 * flops_f / (t_f * 1e-6) / 1e12 / peak_tflops, 1),
                             fwd_bwd_pct_cublas=(round(100 * 3 * flops_f / (t_fb * 1e-6) / 1e12 / peak_tflops, 1)
                                                 if t_fb else None),
                             fwd_vs_eager=vs_f, fwd_bwd_vs_eager=vs_fb,
                             fwd_peak_mib=round(fwd_peak, 1), peak_mib=round(peak, 1) if peak is not None else None))
            log(f"MLP {M}x{D}x{H} {name}: fwd {t_f:.1f}us fwd+bwd {t_fb or float('nan'):.1f}us "
                f"peak fwd {fwd_peak:.0f} MiB, fwd+bwd {peak or float('nan'):.0f} MiB")
        log(f"MLP {M}x{D}x{H} ours: the shipped rule takes the "
            f"{'fused' if fm.fused_rule(M, D, H, x.device) else 'regular'} path")
        del impls, x, xg, dy
        torch.cuda.empty_cache()
    return dict(cublas_tflops=round(peak_tflops, 1), rows=rows)


def mlp_markdown(res: dict) -> str:
    def cell(v):
        return "—" if v is None else v

    lines = ["", f"## Whole MLP (bf16, tanh), cuBLAS 8192^3 at {res['cublas_tflops']} TFLOP/s in the same run", "",
             "Each implementation is timed in a pair with eager (the pair's order alternating), 3 rounds (11 at "
             "M <= 64, host-bound); times are medians of all its do_bench medians; peak = "
             "memory allocated above the inputs during one forward (no grad) or forward+backward. "
             "'ours' takes the fused gate/up GEMM in inference where it times faster; "
             f"'{UNFUSED_ROW}' is ours without it (forward only: training is the same path). "
             "'/ eager' = the median over the pairs of its time divided by eager's in the same pair.", "",
             "| M x D x H | impl | fwd µs | fwd % cuBLAS | fwd / eager | fwd+bwd µs | fwd+bwd % cuBLAS "
             "| fwd+bwd / eager | peak extra MiB (fwd) | peak extra MiB (fwd+bwd) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['M']}x{r['D']}x{r['H']} | {r['impl']} | {r['fwd_us']} | {r['fwd_pct_cublas']} | "
                     f"{cell(r.get('fwd_vs_eager'))} | {cell(r['fwd_bwd_us'])} | {cell(r['fwd_bwd_pct_cublas'])} | "
                     f"{cell(r.get('fwd_bwd_vs_eager'))} | {cell(r.get('fwd_peak_mib'))} | {cell(r['peak_mib'])} |")
    return "\n".join(lines) + "\n"
