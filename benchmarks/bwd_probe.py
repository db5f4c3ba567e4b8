"""The training step with the fused kernels (issue 7): does dY @ Wd with the dGeGLU in its epilogue (d_h never in
memory) beat cuBLAS's dY @ Wd + our pointwise dGeGLU, and does the gate/up GEMM writing g, u and h beat cuBLAS's two
GEMMs + our pointwise GeGLU? Then the whole training step of GeGLUMLP's node (_mlp.py) with combinations of
FUSED_FORWARD / FUSED_BACKWARD / ACCUMULATE_DX / SAVE_DERIVATIVE against eager's step (and with --compile against
torch.compile's, also as the median of per-round ratios), and every path's error against an fp32 reference.

Dev tool (device); bf16, tanh; every time is a do_bench median (L2 flushed), interleaved over rounds, medians of
rounds. The fused backward works in place over g and u, so their values change from call to call (they shrink
towards zero; the GEMM's operands dY and Wd stay random); they are restored between rounds.

    python benchmarks/bwd_probe.py [--build-dir build] [--shapes 8192x2304x9216 8192x4096x14336] [--rounds 5]
                                   [--no-sweep] [--compile]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import _median, _median_us, cublas_tflops  # noqa: E402


def _rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    ap.add_argument("--shapes", nargs="+", default=["8192x2304x9216", "8192x4096x14336"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-sweep", action="store_true", help="the default backward config only")
    ap.add_argument("--compile", action="store_true", help="also time the step of eager's MLP under torch.compile")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, a tiny shape: checks the script")
    args = ap.parse_args()
    if args.smoke:
        _smoke(args)
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    if args.smoke:
        geglu.set_backend("triton")
        importlib.import_module(geglu.__name__ + "._fused_mlp").DECODE_MAX_M = 0
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    pw = importlib.import_module(geglu.__name__ + "._custom_ops")
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    if not args.smoke:
        peak = cublas_tflops(torch)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; cuBLAS bf16 8192^3: {peak:.0f} TFLOP/s",
              flush=True)
    for shape in args.shapes:
        _shape(args, shape, kt, pw, mlp)
        torch.cuda.empty_cache()


def _smoke(args):
    """Run the script's logic on CPU under the Triton interpreter at a tiny shape (wall-clock timings)."""
    import os
    import time

    global _median_us
    os.environ["TRITON_INTERPRET"] = "1"
    args.shapes, args.rounds, args.device = ["96x32x48"], 1, "cpu"

    def _median_us(fn, rep_ms=0):  # noqa: F811
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6


def _shape(args, shape, kt, pw, mlp):
    dev = getattr(args, "device", "cuda")
    bf = dict(device=dev, dtype=torch.bfloat16)
    M, D, H = map(int, shape.split("x"))
    unit = 2 * M * D * H
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, D, generator=gen, **bf)
    wg, wu = (torch.randn(H, D, generator=gen, **bf) * D ** -0.5 for _ in range(2))
    wd = torch.randn(D, H, generator=gen, **bf) * H ** -0.5
    dy = torch.randn(M, D, generator=gen, **bf)
    g0, u0 = torch.mm(x, wg.t()), torch.mm(x, wu.t())
    g, u, dh, dg_buf, du_buf, h_buf = (torch.empty(M, H, **bf) for _ in range(6))
    restore = lambda: (g.copy_(g0), u.copy_(u0))  # noqa: E731

    # --- correctness of the fused backward: d_g, d_u against an fp32 reference from the same bf16 g, u, dy
    dh32 = dy.float() @ wd.float()
    h32 = F.gelu(g0.float(), approximate="tanh")
    ref_du = dh32 * h32
    gg = g0.float().requires_grad_()
    ref_dg = torch.autograd.grad(F.gelu(gg, approximate="tanh"), gg, dh32 * u0.float())[0]
    dh_c = torch.mm(dy, wd)
    pw._backward_into(dg_buf, du_buf, dh_c, g0, u0, "tanh")
    print(f"\n{M}x{D}x{H}: relative error against fp32 (d_g, d_u): cuBLAS + pointwise "
          f"{_rel(dg_buf, ref_dg):.3e} {_rel(du_buf, ref_du):.3e}", flush=True)
    bconfigs = [kt.choose_bwd_config(M, D, H, torch.bfloat16, False)]
    if not args.no_sweep:
        bconfigs = list(dict.fromkeys(bconfigs + list(kt.BWD_SWEEP)))
    ok_configs = []
    for cfg in bconfigs:
        restore()
        try:
            kt.down_dgeglu_into(dy, wd, g, u, True, False, cfg)
        except Exception as e:  # noqa: BLE001 (out of resources etc.: report and go on)
            print(f"  fused bwd {cfg.label():<44} FAILED: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        ok_configs.append(cfg)
        print(f"  fused bwd {cfg.label():<44} {_rel(g, ref_dg):.3e} {_rel(u, ref_du):.3e}  regs "
              f"{getattr(kt.last_compiled, 'n_regs', '-')} spills {getattr(kt.last_compiled, 'n_spills', '-')}", flush=True)
    cands = {
        "bwd: cuBLAS d_h = mm(dy, Wd)": (lambda: torch.mm(dy, wd, out=dh), unit),
        "bwd: pointwise dGeGLU alone": (lambda: pw._backward_into(dg_buf, du_buf, dh, g0, u0, "tanh"), 0),
        "bwd: cuBLAS d_h + pointwise dGeGLU": (
            lambda: (torch.mm(dy, wd, out=dh), pw._backward_into(dg_buf, du_buf, dh, g0, u0, "tanh")), unit),
    }
    for cfg in ok_configs:
        cands[f"bwd: fused {cfg.label()}"] = (
            lambda cfg=cfg: kt.down_dgeglu_into(dy, wd, g, u, True, False, cfg), unit)
    cands["bwd: fused default, + h (write_h)"] = (lambda: kt.down_dgeglu_into(dy, wd, g, u, True, True), unit)
    ws = _ws_module(kt)
    if ws is not None:
        # the warp-specialised Gluon kernel (_gluon_bwd.py): bits against the Triton kernel, error against fp32
        restore()
        kt.down_dgeglu_into(dy, wd, g, u, True, False)
        tg, tu = g.clone(), u.clone()
        for label, kw in (("chunk loop (default)", {}), ("unrolled chunks", dict(loop_chunks=False)),
                          ("fast dGeGLU", dict(fast=True)), ("deriv (two products)", dict(deriv=True)),
                          ("deriv, 4 stages", dict(deriv=True, stages=4))):
            restore()
            k = ws.down_dgeglu_ws(dy, wd, g, u, True, **kw)
            print(f"  ws bwd (Gluon) {label}: max |ws - triton| d_g {(g.float() - tg.float()).abs().max().item():.3e} "
                  f"d_u {(u.float() - tu.float()).abs().max().item():.3e}; rel err vs fp32 {_rel(g, ref_dg):.3e} "
                  f"{_rel(u, ref_du):.3e}; regs {k.n_regs} spills {k.n_spills}", flush=True)
            cands[f"bwd: ws (Gluon) 128x128x64, {label}"] = (
                lambda kw=kw: ws.down_dgeglu_ws(dy, wd, g, u, True, **kw), unit)
        del tg, tu
    cands["fwd: cuBLAS g, u + pointwise GeGLU"] = (
        lambda: (torch.mm(x, wg.t(), out=dg_buf), torch.mm(x, wu.t(), out=du_buf),
                 pw._forward_into(h_buf, dg_buf, du_buf, "tanh", True)), 2 * unit)
    for cfg in (kt.LARGE, kt.PAIRED_LARGE, kt.FAST_LARGE._replace(fast_epi=True)):
        cands[f"fwd: fused save g,u,h {cfg.label()}"] = (
            lambda cfg=cfg: kt.gate_up_geglu(x, wg, wu, True, True, config=cfg), 2 * unit)
    cands[f"fwd: fused save gelu(g),u*gelu'(g),h {kt.PAIRED_LARGE.label()}"] = (
        lambda: kt.gate_up_geglu(x, wg, wu, True, True, config=kt.PAIRED_LARGE, deriv=True), 2 * unit)

    del dh32, h32, ref_du, ref_dg, gg, dh_c
    torch.cuda.empty_cache()
    times = _rounds(args, cands, restore)
    base_b = _median(times["bwd: cuBLAS d_h = mm(dy, Wd)"])
    base_f = _median(times["fwd: cuBLAS g, u + pointwise GeGLU"])
    print(f"\n{M}x{D}x{H} (GEMM unit 2*M*D*H = {unit / 1e12:.3f} TFLOP); bwd % = of cuBLAS d_h's time, "
          "fwd % = of cuBLAS g, u + pointwise")
    for k, (fn, flops) in cands.items():
        t = _median(times[k])
        rel = f"{100 * base_b / t:6.1f}% of cuBLAS d_h" if k.startswith("bwd") else f"{100 * base_f / t:6.1f}% of cuBLAS+pw"
        _row(k, t, times[k], flops, rel)
    best_bwd = min(ok_configs, key=lambda c: _median(times[f"bwd: fused {c.label()}"]))
    mlp.TRAIN_BWD_CONFIG = best_bwd
    mlp.TRAIN_FWD_CONFIG = kt.PAIRED_LARGE  # the fast epilogue, paired; with save it also writes g and u
    print(f"  step: fused forward {kt.PAIRED_LARGE.label()} (+ save), fused backward {best_bwd.label()} (the "
          "fastest above)", flush=True)

    # --- the whole training step through the node, with each combination of the fused kernels
    cands = {}
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu)] + [wd.clone().requires_grad_()]

    def step(fwd, bwd, acc, deriv, deriv_stages=None):
        def run():
            mlp.FUSED_FORWARD, mlp.FUSED_BACKWARD, mlp.ACCUMULATE_DX, mlp.SAVE_DERIVATIVE = fwd, bwd, acc, deriv
            default_stages = ws.DERIV_STAGES if ws is not None else None
            if deriv_stages:
                ws.DERIV_STAGES = deriv_stages
            try:
                y = mlp.GeGLUMLPFunction.apply(*leaves, "tanh")
                return torch.autograd.grad(y, leaves, dy)
            finally:
                mlp.FUSED_FORWARD = mlp.FUSED_BACKWARD = mlp.ACCUMULATE_DX = mlp.SAVE_DERIVATIVE = False
                if ws is not None:
                    ws.DERIV_STAGES = default_stages
        return run

    def eager_step():
        xx, a, b, c = leaves
        y = F.linear(F.gelu(F.linear(xx, a), approximate="tanh") * F.linear(xx, b), c)
        return torch.autograd.grad(y, leaves, dy)

    # (FUSED_FORWARD, FUSED_BACKWARD, ACCUMULATE_DX, SAVE_DERIVATIVE)
    combos = [(False, False, False, False), (False, False, True, False), (True, False, False, False)]
    if ws is not None:  # FUSED_BACKWARD = "gluon": the warp-specialised Gluon kernel
        combos += [(True, "gluon", False, False), (True, "gluon-fast", False, False), (True, "gluon-fast", True, False),
                   (True, "gluon", False, True), (True, "gluon", True, True)]
    else:  # the Triton fused backward (slower than cuBLAS + our dGeGLU on the H200: bwd-probe.txt runs 1-8)
        combos += [(False, True, False, False), (True, True, False, False), (True, True, True, False)]
    for fwd, bwd, acc, deriv in combos:
        label = (f"step: node fused fwd={int(fwd)} bwd={bwd if isinstance(bwd, str) else int(bwd)}"
                 + " acc-dx" * acc + " deriv" * deriv)
        cands[label] = (step(fwd, bwd, acc, deriv), 9 * unit)
    if ws is not None:  # the deriv kernel's ring at 4 stages (its default is ws.DERIV_STAGES = 5)
        cands["step: node fused fwd=1 bwd=gluon deriv, 4 stages"] = (step(True, "gluon", False, True, 4), 9 * unit)
    cands["step: eager"] = (eager_step, 9 * unit)
    if args.compile:  # the best peer in the benchmark: eager's MLP under torch.compile
        compiled = torch.compile(lambda xx, a, b, c: F.linear(F.gelu(F.linear(xx, a), approximate="tanh")
                                                              * F.linear(xx, b), c))

        def compile_step():
            return torch.autograd.grad(compiled(*leaves), leaves, dy)
        cands["step: torch.compile (eager's MLP)"] = (compile_step, 9 * unit)

    ref = [t.float().requires_grad_() for t in leaves]
    y32 = F.linear(F.gelu(F.linear(ref[0], ref[1]), approximate="tanh") * F.linear(ref[0], ref[2]), ref[3])
    grads32 = torch.autograd.grad(y32, ref, dy.float())
    del y32, ref
    names = ["dx", "dWg", "dWu", "dWd"]
    for label in [k for k in cands if k.startswith("step")]:
        grads = cands[label][0]()
        print(f"  {label:<44} rel err " + " ".join(f"{n} {_rel(a, r):.3e}" for n, a, r in
                                                    zip(names, grads, grads32)), flush=True)
        del grads
    del grads32
    torch.cuda.empty_cache()

    times = _rounds(args, cands, restore, rep_ms=300)
    base_s = _median(times["step: eager"])
    base_c = _median(times["step: torch.compile (eager's MLP)"]) if args.compile else None
    print(f"\n{M}x{D}x{H}: the training step (forward + backward), ratio to eager's step"
          + (" and to torch.compile's" if base_c else ""))
    for k, (fn, flops) in cands.items():
        t = _median(times[k])
        _row(k, t, times[k], flops, f"{t / base_s:6.3f} of eager" + (f" {t / base_c:6.3f} of compile" if base_c else ""))
    if base_c:  # each round's ratio to torch.compile's step in the same round (drift between rounds cancels)
        comp = times["step: torch.compile (eager's MLP)"]
        print(f"\n{M}x{D}x{H}: per-round ratio to torch.compile's step in the same round: median [min, max]")
        for k in cands:
            r = sorted(a / b for a, b in zip(times[k], comp))
            print(f"  {k:<58} {_median(r):6.3f}  [{r[0]:.3f}, {r[-1]:.3f}]", flush=True)
    mlp.TRAIN_BWD_CONFIG = mlp.TRAIN_FWD_CONFIG = None


def _ws_module(kt):
    """The Gluon warp-specialised backward (_gluon_bwd.py) where this Triton has Gluon and the GPU is sm_90."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    try:
        return importlib.import_module(kt.__name__.rsplit(".", 1)[0] + "._gluon_bwd")
    except ImportError as e:
        print(f"  no Gluon backward: {e}")
        return None


def _rounds(args, cands, restore, rep_ms=100):
    times = {k: [] for k in cands}
    for r in range(args.rounds):
        for k, (fn, _) in cands.items():
            restore()
            times[k].append(_median_us(fn, rep_ms=rep_ms))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return times


def _row(k, t, ts, flops, rel):
    spread = (max(ts) - min(ts)) / t * 100
    rate = f"{flops / t / 1e6:6.0f} TFLOP/s" if flops else " " * 14
    print(f"  {k:<58} {t:9.1f} us  {rate}  {rel}  (rounds spread {spread:.1f}%)", flush=True)


if __name__ == "__main__":
    main()
