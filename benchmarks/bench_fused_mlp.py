"""Device benchmark of the fused GeGLU MLP (torch-ext/geglu/_fused_mlp.py) against cuBLAS and eager PyTorch.

One command, one table per shape, markdown + json under --out:

    python3 benchmarks/bench_fused_mlp.py --out $OUT            [--quick] [--approximate tanh|none]

Per shape (bf16; M x D x H):
  * cuBLAS: x @ Wg^T and x @ Wu^T as two GEMMs (what the fused kernel replaces), and as one GEMM against a packed
    [2H, D] weight; the 8192^3 bf16 GEMM rate measured in the same run;
  * the fused kernel alone (inference: writes h; training: also [g | u]) with the default config, and a sweep of
    tile configs (µs, TFLOP/s, % of the two-cuBLAS-GEMM rate, registers / spills / shared memory, a sanity error
    check); the best config is then installed for the MLP rows;
  * the whole MLP, forward (no_grad) and forward+backward: eager, cuBLAS + our pointwise GeGLU (today's
    GeGLUMLP path), fused (default config) and fused (best swept config); peak extra memory of forward+backward
    and the activation memory held between forward and backward.
Times are medians of triton.testing.do_bench (L2 flushed between runs). Needs no `kernels` package: the Triton
(noarch) variant is built from this checkout into a temporary folder and imported directly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"  # "cpu" with --smoke (Triton interpreter: checks the script, not speed)
SHAPES = [(8192, 2304, 9216), (8192, 4096, 14336), (16, 4096, 14336)]
TARGETS_US = {(8192, 4096, 14336): 4100.0, (8192, 2304, 9216): 1540.0}  # fused MLP forward (eager: 4389 / -)


def load_package(build_dir: Path | None):
    """The kernel package (Triton variant) as a module: from --build-dir/torch-cuda, or freshly built."""
    if build_dir is None:
        sys.path.insert(0, str(ROOT))
        from kerneltools.build import build

        build_dir = Path(tempfile.mkdtemp(prefix="geglu-build-"))
        build(ROOT, build_dir, variants=["cuda"], log=lambda *a: None)
    variant = build_dir / "torch-cuda"
    sys.path.insert(0, str(ROOT))
    from kerneltools.cuda_ops import _import_variant  # what kernels' loader does, without kernels

    mod = _import_variant(variant)
    return mod


def bench_us(fn, rep_ms=200) -> float:
    import triton

    if DEV == "cpu":
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def cublas_tflops() -> float:
    n = 8192 if DEV == "cuda" else 64
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    t = bench_us(lambda: a @ b, rep_ms=500)
    return 2 * n ** 3 / (t * 1e-6) / 1e12


def rel_err(a, ref) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def peak_and_held(fwd_bwd, fwd_keep):
    """(peak extra MiB during forward+backward, MiB held between forward and backward)."""
    if DEV == "cpu":
        fwd_bwd()
        return 0.0, 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    y = fwd_keep()
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / 2 ** 20
    del y
    return round(peak, 1), round(held, 1)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def kernel_info(kt) -> str:
    """Registers / spills / shared memory of the last launch, and whether ptxas serialized its wgmma pipeline
    (Triton's bundled ptxas run on the kernel's PTX; see benchmarks/aot_fused_mlp.py)."""
    k = getattr(kt, "last_compiled", None)
    if k is None:
        return ""
    regs = getattr(k, "n_regs", "?")
    spills = getattr(k, "n_spills", "?")
    shared = getattr(getattr(k, "metadata", None), "shared", None)
    info = f"{regs} regs, {spills} spills" + (f", {shared // 1024} KiB smem" if isinstance(shared, int) else "")
    try:
        import re
        import subprocess

        import triton

        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        cap = torch.cuda.get_device_capability()
        arch = f"sm_{cap[0]}{cap[1]}" + ("a" if cap[0] == 9 else "")
        r = subprocess.run([str(ptxas), "-v", "--gpu-name", arch, f.name, "-o", "/dev/null"], capture_output=True,
                           text=True, timeout=120)
        os.unlink(f.name)
        codes = sorted(set(re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", r.stderr)))
        info += ", wgmma SERIALIZED (" + ",".join(codes) + ")" if codes else ", wgmma pipelined"
    except Exception as e:  # no ptxas, no PTX: leave the verdict out
        info += f", ptxas check skipped ({type(e).__name__})"
    return info


def run_shape(geglu, fm, kt, M, D, H, approximate, quick, log):
    tanh = approximate == "tanh"
    dt = torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(0)

    def r(*shape, scale):
        return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(dt)

    x = r(M, D, scale=1.0)
    wg, wu = r(H, D, scale=D ** -0.5), r(H, D, scale=D ** -0.5)
    wd = r(D, H, scale=H ** -0.5)
    dy = r(M, D, scale=1.0)
    res = dict(M=M, D=D, H=H, approximate=approximate)
    flops_gu = 4 * M * D * H  # the two gate/up GEMMs

    # --- cuBLAS references for the gate/up GEMMs ---
    g_out, u_out = torch.empty(M, H, device=DEV, dtype=dt), torch.empty(M, H, device=DEV, dtype=dt)
    wgu = torch.cat([wg, wu])
    gu_out = torch.empty(M, 2 * H, device=DEV, dtype=dt)
    t2 = bench_us(lambda: (torch.mm(x, wg.t(), out=g_out), torch.mm(x, wu.t(), out=u_out)))
    t1 = bench_us(lambda: torch.mm(x, wgu.t(), out=gu_out))
    h_pw = torch.empty(M, H, device=DEV, dtype=dt)
    tpw = bench_us(lambda: geglu.geglu(g_out, u_out, approximate, out=h_pw))
    res.update(cublas_2gemm_us=round(t2, 1), cublas_2gemm_tflops=round(flops_gu / (t2 * 1e-6) / 1e12, 1),
               cublas_packed_us=round(t1, 1), pointwise_us=round(tpw, 1))
    log(f"\n== {M}x{D}x{H} bf16 {approximate}: cuBLAS gate+up 2 GEMMs {t2:.1f} us ({res['cublas_2gemm_tflops']} "
        f"TFLOP/s), packed 1 GEMM {t1:.1f} us, + our pointwise {tpw:.1f} us")
    ref_h = geglu.geglu(x @ wg.t(), x @ wu.t(), approximate)  # cuBLAS + pointwise: what the epilogue reproduces

    # --- the fused kernel alone: default config, then the sweep ---
    def fused_kernel(cfg, save):
        return lambda: kt.gate_up_geglu(x, wg, wu, tanh, save, cfg)

    default_cfg = kt.choose_config(M, D, H, dt, False)
    configs = list(dict.fromkeys([default_cfg] + ([] if quick else list(kt.SWEEP))))
    if M <= 64:
        configs = [c for c in configs if c.block_m <= 64] or [kt.MEDIUM]
        configs += [kt.Config(64, 64, 128, 1, 4, 4), kt.Config(64, 128, 64, 1, 4, 4)]
    sweep = []
    for cfg in configs:
        row = dict(config=cfg.label(), cfg=cfg._asdict())
        try:
            h, _ = fused_kernel(cfg, False)()
            _sync()
            row["info"] = kernel_info(kt)
            row["rel_err_vs_cublas_pw"] = rel_err(h, ref_h)
            t = bench_us(fused_kernel(cfg, False))
            row.update(us=round(t, 1), tflops=round(flops_gu / (t * 1e-6) / 1e12, 1),
                       pct_cublas=round(100 * t2 / t, 1))
            ok = row["rel_err_vs_cublas_pw"] < 1e-2
            row["ok"] = ok
            log(f"  {cfg.label():<44} {t:9.1f} us {row['tflops']:6.1f} TFLOP/s {row['pct_cublas']:6.1f}% of cuBLAS "
                f"err {row['rel_err_vs_cublas_pw']:.1e}{'' if ok else ' WRONG'}  [{row['info']}]")
        except Exception as e:  # compile errors, out of shared memory, unsupported features
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log(f"  {cfg.label():<44} failed: {row['error']}")
        sweep.append(row)
        _empty_cache()
    good = [s for s in sweep if s.get("us") is not None and s.get("ok")]
    best = min(good, key=lambda s: s["us"]) if good else None
    res["sweep"] = sweep
    res["default_config"] = default_cfg.label()
    if best:
        res["best_config"] = best["config"]
        res["best_fused_us"] = best["us"]
        res["best_pct_cublas"] = best["pct_cublas"]
    # training mode (also writes [g | u]) for the default and best configs
    train = {}
    for cfg in dict.fromkeys([default_cfg] + ([kt.Config(**best["cfg"])] if best else [])):
        try:
            t = bench_us(fused_kernel(cfg, True))
            train[cfg.label()] = round(t, 1)
            log(f"  save=True {cfg.label():<35} {t:9.1f} us ({100 * t2 / t:.1f}% of cuBLAS gate+up)")
        except Exception as e:
            train[cfg.label()] = f"{type(e).__name__}"
    res["fused_train_us"] = train

    # --- backward: dY @ Wd with the dGeGLU (and h) in its epilogue vs cuBLAS + our pointwise backward ---
    dh_out = torch.empty(M, H, device=DEV, dtype=dt)
    gu_ref = torch.cat([x @ wg.t(), x @ wu.t()], 1)
    t_dh = bench_us(lambda: torch.mm(dy, wd, out=dh_out))
    gu_pw = gu_ref.clone()
    t_pwb = bench_us(lambda: geglu.ops.geglu_packed_backward_(dh_out, gu_pw, approximate, True))
    t_h = bench_us(lambda: geglu.geglu(gu_ref[:, :H], gu_ref[:, H:], approximate, out=h_pw))
    res.update(bwd_cublas_dh_us=round(t_dh, 1), bwd_pointwise_us=round(t_pwb, 1), bwd_recompute_h_us=round(t_h, 1))
    log(f"  backward: cuBLAS dY@Wd {t_dh:.1f} us + pointwise dGeGLU {t_pwb:.1f} us (+ h recompute {t_h:.1f} us)")
    ref_gu = gu_ref.clone()
    geglu.ops.geglu_packed_backward_(dy @ wd, ref_gu, approximate, True)
    ref_hb = geglu.geglu(gu_ref[:, :H], gu_ref[:, H:], approximate)
    bsweep = []
    bconfigs = list(dict.fromkeys([kt.choose_bwd_config(M, D, H, dt, True)] + ([] if quick else list(kt.BWD_SWEEP))))
    if M <= 64:
        bconfigs = [c for c in bconfigs if c.block_m <= 64] or [kt.BWD_MEDIUM]
    gu_w = gu_ref.clone()
    for cfg in bconfigs:
        row = dict(config=cfg.label(), cfg=cfg._asdict())
        try:
            gu_w.copy_(gu_ref)
            hb = kt.down_dgeglu(dy, wd, gu_w, tanh, True, cfg)
            _sync()
            row["info"] = kernel_info(kt)
            row["rel_err_vs_cublas_pw"] = max(rel_err(gu_w, ref_gu), rel_err(hb, ref_hb))
            row["ok"] = row["rel_err_vs_cublas_pw"] < 2e-2
            t = bench_us(lambda: kt.down_dgeglu(dy, wd, gu_w, tanh, True, cfg))
            row.update(us=round(t, 1), tflops=round(2 * M * D * H / (t * 1e-6) / 1e12, 1),
                       pct_cublas=round(100 * t_dh / t, 1), vs_cublas_pw=round(100 * (t_dh + t_pwb) / t, 1))
            log(f"  bwd {cfg.label():<40} {t:9.1f} us {row['tflops']:6.1f} TFLOP/s {row['pct_cublas']:6.1f}% of "
                f"cuBLAS dY@Wd, {row['vs_cublas_pw']:6.1f}% of cuBLAS+pointwise err {row['rel_err_vs_cublas_pw']:.1e}"
                f"{'' if row['ok'] else ' WRONG'}  [{row['info']}]")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log(f"  bwd {cfg.label():<40} failed: {row['error']}")
        bsweep.append(row)
        _empty_cache()
    bgood = [r for r in bsweep if r.get("us") is not None and r.get("ok")]
    bbest = min(bgood, key=lambda r: r["us"]) if bgood else None
    res["bwd_sweep"] = bsweep
    if bbest:
        res["bwd_best_config"] = bbest["config"]
    del dh_out, gu_ref, gu_pw, gu_w, ref_gu, ref_hb

    # --- the whole MLP ---
    def eager_mlp(x, wg, wu, wd):
        return F.linear(F.gelu(F.linear(x, wg), approximate=approximate) * F.linear(x, wu), wd)

    def pw_mlp(x, wg, wu, wd):  # today's GeGLUMLP: cuBLAS projections + our pointwise op (in-place backward)
        return F.linear(geglu.geglu(F.linear(x, wg), F.linear(x, wu), approximate, inplace_backward=True), wd)

    def fused_mlp(x, wg, wu, wd):
        return fm.fused_geglu_mlp_forward(x, wg, wu, wd, approximate)

    decode = M <= fm.DECODE_MAX_M  # the op falls back to cuBLAS + pointwise there
    impls = [("eager", eager_mlp), ("cuBLAS + our pointwise", pw_mlp),
             ("fused op (decode fallback)" if decode else "fused (default config)", fused_mlp)]
    if best and best["config"] != default_cfg.label() and not decode:
        impls.append(("fused (best config)", fused_mlp))
    if bbest and not decode:
        impls.append(("fused + fused bwd (best configs)", fused_mlp))
    leaves = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    mlp = []
    with torch.no_grad():
        ref32 = eager_mlp(x.float(), wg.float(), wu.float(), wd.float())
    for name, fn in impls:
        if name.startswith("fused (best config)") or name.startswith("fused + fused bwd"):
            if best:
                for save in (False, True):
                    kt.TUNED[(kt.m_bucket(M), D, H, dt, save)] = kt.Config(**best["cfg"])
        fm.FUSED_BACKWARD = name.startswith("fused + fused bwd")
        if fm.FUSED_BACKWARD:
            for wh in (False, True):
                kt.BWD_TUNED[(kt.m_bucket(M), D, H, dt, wh)] = kt.Config(**bbest["cfg"])

        def fwd():
            with torch.no_grad():
                return fn(x, wg, wu, wd)

        def fwd_bwd():
            return torch.autograd.grad(fn(*leaves), leaves, dy)

        def fwd_keep():
            return fn(*leaves)

        y = fwd()
        err = rel_err(y, ref32)
        del y
        tf, tfb = bench_us(fwd), bench_us(fwd_bwd)
        peak, held = peak_and_held(fwd_bwd, fwd_keep)
        row = dict(impl=name, fwd_us=round(tf, 1), fwd_bwd_us=round(tfb, 1), peak_mib=peak, held_mib=held,
                   rel_err_fp32=err)
        mlp.append(row)
        log(f"  MLP {name:<24} fwd {tf:9.1f} us  fwd+bwd {tfb:9.1f} us  peak +{peak:8.1f} MiB  held {held:8.1f} MiB"
            f"  err vs fp32 {err:.2e}")
        _empty_cache()
    kt.TUNED.clear()
    kt.BWD_TUNED.clear()
    fm.FUSED_BACKWARD = False
    res["mlp"] = mlp
    tgt = TARGETS_US.get((M, D, H))
    if tgt:
        fused_best = min(r["fwd_us"] for r in mlp if r["impl"].startswith("fused"))
        res["target_fwd_us"] = tgt
        res["target_met"] = fused_best <= tgt
        log(f"  target fused MLP forward <= {tgt:.0f} us: best {fused_best:.1f} us -> "
            f"{'met' if fused_best <= tgt else 'NOT met'}")
    del x, wg, wu, wd, dy, leaves, g_out, u_out, wgu, gu_out, h_pw, ref_h
    _empty_cache()
    return res


def to_markdown(result: dict) -> str:
    L = [f"# Fused GeGLU MLP benchmark", "",
         f"{result['device']}, torch {result['torch']}, triton {result['triton']}; cuBLAS bf16 8192^3: "
         f"{result['cublas_tflops']} TFLOP/s (same run). Medians of triton.testing.do_bench.", ""]
    for r in result["shapes"]:
        L += [f"## {r['M']} x {r['D']} x {r['H']} (bf16, {r['approximate']})", "",
              f"cuBLAS gate+up: two GEMMs {r['cublas_2gemm_us']} µs ({r['cublas_2gemm_tflops']} TFLOP/s), one packed "
              f"GEMM {r['cublas_packed_us']} µs; our pointwise GeGLU {r['pointwise_us']} µs.", "",
              "| fused kernel config | µs | TFLOP/s | % of cuBLAS 2-GEMM rate | rel err vs cuBLAS+pointwise | "
              "regs / spills / smem |", "|---|---|---|---|---|---|"]
        for s in r["sweep"]:
            if "error" in s:
                L.append(f"| {s['config']} | failed: {s['error']} | | | | |")
            else:
                L.append(f"| {s['config']} | {s['us']} | {s['tflops']} | {s['pct_cublas']} | "
                         f"{s['rel_err_vs_cublas_pw']:.1e}{'' if s['ok'] else ' WRONG'} | {s['info']} |")
        L += ["", f"Backward: cuBLAS dY@Wd {r['bwd_cublas_dh_us']} µs + pointwise dGeGLU {r['bwd_pointwise_us']} µs "
              f"(h recompute alone {r['bwd_recompute_h_us']} µs) vs the fused dY@Wd + dGeGLU + h kernel (it also "
              f"recomputes h, so the forward keeps [g|u] only):", "",
              "| bwd kernel config | µs | TFLOP/s | % of cuBLAS dY@Wd | % of cuBLAS dY@Wd + pointwise | rel err | "
              "regs / spills / smem |", "|---|---|---|---|---|---|---|"]
        for b in r.get("bwd_sweep", []):
            if "error" in b:
                L.append(f"| {b['config']} | failed: {b['error']} | | | | | |")
            else:
                L.append(f"| {b['config']} | {b['us']} | {b['tflops']} | {b['pct_cublas']} | {b['vs_cublas_pw']} | "
                         f"{b['rel_err_vs_cublas_pw']:.1e}{'' if b['ok'] else ' WRONG'} | {b['info']} |")
        L += ["", f"Default config: {r['default_config']}; best: {r.get('best_config', '-')}. Training mode "
              f"(also writes [g|u]): " + ", ".join(f"{k}: {v} µs" for k, v in r["fused_train_us"].items()), "",
              "| MLP | fwd µs | fwd+bwd µs | peak extra MiB (fwd+bwd) | held fwd->bwd MiB | rel err vs fp32 |",
              "|---|---|---|---|---|---|"]
        for m in r["mlp"]:
            L.append(f"| {m['impl']} | {m['fwd_us']} | {m['fwd_bwd_us']} | {m['peak_mib']} | {m['held_mib']} | "
                     f"{m['rel_err_fp32']:.2e} |")
        if "target_fwd_us" in r:
            L += ["", f"Target: fused MLP forward <= {r['target_fwd_us']:.0f} µs: "
                      f"{'met' if r['target_met'] else 'not met'}."]
        L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="folder for fused_mlp.md and fused_mlp.json")
    ap.add_argument("--build-dir", type=Path, default=None, help="an existing build tree (else built here)")
    ap.add_argument("--approximate", default="tanh", choices=["tanh", "none"])
    ap.add_argument("--quick", action="store_true", help="default config only (no tile sweep)")
    ap.add_argument("--sweep", choices=["tiles", "epilogue"], default="tiles",
                    help="which forward config list to sweep: SWEEP (tiles) or EPILOGUE_SWEEP")
    ap.add_argument("--no-bwd-sweep", action="store_true", help="the backward's default config only")
    ap.add_argument("--shapes", nargs="*", default=None, help="MxDxH ... (default: the three benchmark shapes)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU under the Triton interpreter: checks this script, not speed")
    args = ap.parse_args(argv)
    global DEV
    if args.smoke:
        DEV = "cpu"
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    geglu = load_package(args.build_dir)
    fm = importlib.import_module(geglu.__name__ + "._fused_mlp")
    kt = importlib.import_module(geglu.__name__ + "._fused_mlp_triton")
    if args.smoke:
        geglu.set_backend("triton")
        fm.DECODE_MAX_M = 16
        kt.SWEEP[:] = [kt.Config(16, 16, 16, 2, 1, 1, tma=False), kt.Config(16, 16, 16, 2, 1, 1, persistent=True)]
        args.shapes = args.shapes or ["32x32x48", "16x32x48"]
    if args.sweep == "epilogue":
        kt.SWEEP[:] = kt.EPILOGUE_SWEEP
    if args.no_bwd_sweep:
        kt.BWD_SWEEP[:] = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    result = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__,
                  cublas_tflops=round(cublas_tflops(), 1), shapes=[])
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
          f"cuBLAS bf16 8192^3: {result['cublas_tflops']} TFLOP/s", flush=True)
    for M, D, H in shapes:
        result["shapes"].append(run_shape(geglu, fm, kt, M, D, H, args.approximate, args.quick,
                                          lambda *a: print(*a, flush=True)))
        if args.out:  # after every shape: a run cut short by a time limit still leaves its finished shapes
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fused_mlp.md").write_text(to_markdown(result))
            (args.out / "fused_mlp.json").write_text(json.dumps(result, indent=1, default=str))
    print("\n" + to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
