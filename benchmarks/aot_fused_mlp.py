"""Compile the fused gate/up GEMM for sm_90a without a GPU and report what ptxas made of each tile config:
registers, spills, shared memory, wgmma count, and whether ptxas serialized the wgmma pipeline (warnings C7510-
C7520, e.g. C7515 "non wgmma instructions defining accumulator registers", C7511 "insufficient register
resources"): a serialized config waits for every wgmma and cannot approach cuBLAS, so it is caught here for free
instead of in device time.

Uses the Triton on sys.path (install the device's version, e.g. 3.6.0, into a folder first:
``pip install --no-deps --target /tmp/tr36 triton==3.6.0`` and pass ``--triton-path /tmp/tr36``), its bundled ptxas
and cuobjdump, and a stand-in driver that only names the target (cuda sm_90); nothing is launched.

    python benchmarks/aot_fused_mlp.py [--triton-path DIR] [--save] [--kernel fwd|paired|bwd|all] [--config LABEL]
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-path", default=None, help="folder holding the triton package to compile with")
    ap.add_argument("--shape", default="8192x4096x14336", help="MxDxH (only divisibility matters)")
    ap.add_argument("--config", default=None, help="only the config with this label")
    ap.add_argument("--kernel", default="all", choices=["fwd", "bwd", "paired", "ws-bwd", "ws-fwd", "all"],
                    help="fwd: gate/up GEMM + GeGLU (two dots); paired: the same with one dot over both weights; "
                         "bwd: dY @ Wd + dGeGLU (+ h); ws-bwd: the same as a warp-specialised Gluon kernel "
                         "(_gluon_bwd.py); ws-fwd: the gate/up GEMM + GeGLU with its epilogue in its own warps "
                         "(_gluon_fwd.py)")
    ap.add_argument("--save", action="store_true", help="also the training variants (write [g|u], paired also "
                    "[gelu(g)|u*gelu'(g)]; bwd: also h)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--approximate", default="tanh", choices=["tanh", "none"])
    ap.add_argument("--verbose", action="store_true", help="print compile errors in full")
    ap.add_argument("--out", type=Path, default=None, help="keep PTX / SASS here")
    args = ap.parse_args(argv)
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _TargetOnly:  # what JITFunction.warmup asks of the driver; nothing runs
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(_TargetOnly())
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    sys.path.insert(0, str(ROOT))
    from kerneltools.build import build

    bdir = Path(tempfile.mkdtemp(prefix="geglu-aot-"))
    build(ROOT, bdir, variants=["cuda"], log=lambda *a: None)
    variant = bdir / "torch-cuda"
    sys.path.insert(0, str(ROOT))
    from kerneltools.cuda_ops import _import_variant  # what kernels' loader does, without kernels

    mod = _import_variant(variant)
    kt = importlib.import_module(mod.__name__ + "._fused_mlp_triton")
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = args.out or Path(tempfile.mkdtemp(prefix="geglu-aot-out-"))
    out.mkdir(parents=True, exist_ok=True)

    M, D, H = (int(v) for v in args.shape.split("x"))
    bf = getattr(torch, args.dtype)
    x, wg, wu = torch.empty(M, D, dtype=bf), torch.empty(H, D, dtype=bf), torch.empty(H, D, dtype=bf)
    h, gu = torch.empty(M, H, dtype=bf), torch.empty(M, 2 * H, dtype=bf)
    print(f"triton {triton.__version__}, sm_90a, {M}x{D}x{H} {args.dtype} {args.approximate}")
    dy, wd = torch.empty(M, D, dtype=bf), torch.empty(D, H, dtype=bf)

    def desc(t, blk):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), blk)

    def compile_fwd(cfg, save):
        g_view, u_view = (gu[:, :H], gu[:, H:]) if save else (h, h)
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        tensors = ((x, [bm, bk]), (wg, [bn, bk]), (wu, [bn, bk]), (h, [bm, bn]), (g_view, [bm, bn]),
                   (u_view, [bm, bn]))
        kargs = [desc(t, b) if cfg.tma else t for t, b in tensors]
        return kt._gate_up_geglu_kernel.warmup(
            *kargs, M, H, D, x.stride(0), wg.stride(0), wu.stride(0), h.stride(0), g_view.stride(0),
            u_view.stride(0), TANH=args.approximate == "tanh", SAVE=save, TMA=cfg.tma, DOT_F32=False,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            FAST_EPI=cfg.fast_epi,
            K_BETA_TANH=kt.K_BETA_TANH, K_KAPPA=kt.K_KAPPA, K_ALPHA=kt.K_ALPHA,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **kt._maxnreg(cfg), grid=(1,))

    def compile_bwd(cfg, write_h):
        g_view, u_view = gu[:, :H], gu[:, H:]
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        pn = bn // cfg.epi_split
        tensors = ((dy, [bm, bk]), (wd, [bk, bn]), (g_view, [bm, pn]), (u_view, [bm, pn]), (h, [bm, pn]))
        kargs = [desc(t, b) if cfg.tma else t for t, b in tensors]
        return kt._down_dgeglu_kernel.warmup(
            *kargs, M, H, D, dy.stride(0), wd.stride(0), g_view.stride(0), u_view.stride(0), h.stride(0),
            TANH=args.approximate == "tanh", WRITE_H=write_h, TMA=cfg.tma, DOT_F32=False, EPI_SPLIT=cfg.epi_split,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            K_BETA_TANH=kt.K_BETA_TANH, K_KAPPA=kt.K_KAPPA, K_ALPHA=kt.K_ALPHA, K_BETA_ERF=kt.K_BETA_ERF,
            K_3KAPPA=kt.K_3KAPPA, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=False, **kt._maxnreg(cfg), grid=(1,))

    w_pair = torch.empty(2, H, D, dtype=bf)  # the two weights, as the paired kernel's 3-D descriptor sees them

    def compile_paired(cfg, save):
        g_view, u_view = (gu[:, :H], gu[:, H:]) if save else (h, h)
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        kargs = [desc(x, [bm, bk]), desc(w_pair, [2, bn, bk]), desc(h, [bm, bn]), desc(g_view, [bm, bn]),
                 desc(u_view, [bm, bn])]
        return kt._paired_gate_up_geglu_kernel.warmup(
            *kargs, M, H, D, TANH=args.approximate == "tanh", SAVE=save, DOT_F32=False, GATE_FIRST=True,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            FAST_EPI=cfg.fast_epi, K_BETA_TANH=kt.K_BETA_TANH, K_KAPPA=kt.K_KAPPA, K_ALPHA=kt.K_ALPHA,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **kt._maxnreg(cfg),
            grid=(1,))

    def compile_ws_bwd(cfg, mode):
        epi_mode, loop_chunks, chunk, cw, regs, fast = mode  # regs: the consumers' setmaxnreg
        gb = importlib.import_module(mod.__name__ + "._gluon_bwd")
        g_, u_ = gu[:, :H], gu[:, H:]
        dy_d, wd_d = gb.descriptors(dy, wd, cfg.block_m, cfg.block_n, cfg.block_k)
        return gb._down_dgeglu_ws_kernel.warmup(
            dy_d, wd_d, g_, u_, M, H, D, g_.stride(0), u_.stride(0), TANH=args.approximate == "tanh",
            STAGES=cfg.num_stages, GROUP_M=cfg.group_m, CHUNK=chunk, CONSUMER_REGS=regs, PRODUCER_REGS=40 if cw == 4 else 24,
            K_BETA_TANH=kt.K_BETA_TANH, K_KAPPA=kt.K_KAPPA, K_ALPHA=kt.K_ALPHA, K_BETA_ERF=kt.K_BETA_ERF,
            K_3KAPPA=kt.K_3KAPPA, EPI_MODE=epi_mode, LOOP_CHUNKS=loop_chunks,
            FAST=fast, EVEN=M % cfg.block_m == 0 and H % cfg.block_n == 0, num_warps=cw, enable_fp_fusion=False, grid=(1,))

    def compile_ws_fwd(cfg, mode):
        save, chunk, epi_warps, epi_regs = mode
        gf = importlib.import_module(mod.__name__ + "._gluon_fwd")
        x_d, wg_d, wu_d = gf.descriptors(x, wg, wu, cfg.block_m, cfg.block_n, cfg.block_k)
        g_, u_ = (gu[:, :H], gu[:, H:]) if save else (h, h)
        return gf._gate_up_geglu_ws_kernel.warmup(
            x_d, wg_d, wu_d, h, g_, u_, M, H, D, h.stride(0), g_.stride(0), u_.stride(0),
            TANH=args.approximate == "tanh", SAVE=save, STAGES=cfg.num_stages, GROUP_M=cfg.group_m, CHUNK=chunk,
            EVEN=M % cfg.block_m == 0 and H % cfg.block_n == 0, EPI_WARPS=epi_warps, EPI_REGS=epi_regs, PRODUCER_REGS=24,
            K_BETA_TANH=kt.K_BETA_TANH, K_KAPPA=kt.K_KAPPA, K_ALPHA=kt.K_ALPHA, num_warps=8, maxnreg=gf.MAXNREG,
            grid=(1,))

    jobs = []
    if args.kernel == "ws-fwd":
        for save in ((False, True) if args.save else (False,)):
            for chunk, warps, regs in ((16, 2, 152), (16, 2, 120), (32, 2, 152), (16, 2, 168)):
                jobs.append((f"ws-fwd {'train' if save else 'infer'} CHUNK {chunk} epi w{warps} r{regs} 128x256x64 s3",
                             kt.Config(128, 128, 64, 16, 8, 3), compile_ws_fwd, (save, chunk, warps, regs)))
            for st in (5, 6):
                jobs.append((f"ws-fwd {'train' if save else 'infer'} CHUNK 16 epi w2 r152 128x256x32 s{st}",
                             kt.Config(128, 128, 32, 16, 8, st), compile_ws_fwd, (save, 16, 2, 152)))
    if args.kernel == "ws-bwd":
        for cfg in (kt.Config(128, 128, 64, 8, 4, 4), kt.Config(128, 128, 64, 8, 4, 3)):
            jobs.append((f"ws-bwd dgeglu {cfg.label()}", cfg, compile_ws_bwd, (1, False, 32, 4, 232, False)))
        for chunk in (16, 32):
            jobs.append((f"ws-bwd dgeglu loop_chunks CHUNK {chunk} 128x128x64 s4", kt.Config(128, 128, 64, 8, 4, 4),
                         compile_ws_bwd, (1, True, chunk, 4, 232, False)))
        for bk, st, chunk in ((64, 5, 32), (128, 2, 32)):
            jobs.append((f"ws-bwd dgeglu loop_chunks CHUNK {chunk} 128x128x{bk} s{st}",
                         kt.Config(128, 128, bk, 8, 4, st), compile_ws_bwd, (1, True, chunk, 4, 232, False)))
        for chunk in (32, 64):
            jobs.append((f"ws-bwd dgeglu fast loop_chunks CHUNK {chunk} 128x128x64 s4",
                         kt.Config(128, 128, 64, 8, 4, 4), compile_ws_bwd, (1, True, chunk, 4, 232, True)))
        for chunk, regs in ((16, 120), (32, 120), (16, 112)):
            jobs.append((f"ws-bwd dgeglu 8-warp consumers loop_chunks CHUNK {chunk} r{regs}",
                         kt.Config(128, 128, 64, 8, 8, 4), compile_ws_bwd, (1, True, chunk, 8, regs, False)))
        for mode in (0, 2, 3):
            jobs.append((f"ws-bwd epi_mode {mode} (diagnostics) 128x128x64 s4", kt.Config(128, 128, 64, 8, 4, 4),
                         compile_ws_bwd, (mode, False, 32, 4, 232, False)))
    if args.kernel in ("paired", "all"):
        for save in ((0, 1, 2) if args.save else (0,)):  # the kernel's SAVE: 2 saves the derivative factors
            for cfg in dict.fromkeys(kt.PAIRED_SWEEP):
                kind = ("paired infer", "paired train", "paired train deriv")[save]
                jobs.append((f"{kind} {cfg.label()}", cfg, compile_paired, save))
    if args.kernel in ("fwd", "all"):
        for save in ((False, True) if args.save else (False,)):
            # the two-dot kernel (a config's `pair` flag selects the paired kernel at run time: --kernel paired)
            for cfg in dict.fromkeys(c._replace(pair=False) for c in [kt.LARGE, kt.MEDIUM] + list(kt.SWEEP)):
                jobs.append((f"{'fwd train' if save else 'fwd infer'} {cfg.label()}", cfg, compile_fwd, save))
    if args.kernel in ("bwd", "all"):
        for write_h in ((False, True) if args.save else (False,)):  # write_h: the op's path; without: the node's
            for cfg in dict.fromkeys([kt.BWD_LARGE, kt.BWD_MEDIUM] + list(kt.BWD_SWEEP)):
                jobs.append((f"bwd dgeglu{'+h' if write_h else ''} {cfg.label()}", cfg, compile_bwd, write_h))
    bad = 0
    for label, cfg, fn, flag in jobs:
        if args.config and cfg.label() != args.config:
            continue
        try:
            k = fn(cfg, flag)
        except Exception as e:
            msg = str(e).strip().splitlines()
            print(f"{label:<56} FAILED {type(e).__name__}: {msg[-1][:160] if msg else ''}")
            if args.verbose:
                cause = e
                while cause is not None:
                    print(f"--- {type(cause).__name__}: {cause}")
                    cause = cause.__cause__ or cause.__context__
            bad += 1
            continue
        tag = re.sub(r"[^A-Za-z0-9]+", "_", label)
        (out / f"{tag}.ptx").write_text(k.asm["ptx"])
        (out / f"{tag}.cubin").write_bytes(k.asm["cubin"])
        r = subprocess.run([str(bindir / "ptxas"), "-v", "--gpu-name", "sm_90a", str(out / f"{tag}.ptx"),
                            "-o", "/dev/null"], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", r.stderr)
        spill = re.search(r"(\d+) bytes spill stores", r.stderr)
        serial = re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are "
                            r"serialized due to ([^.]*?) in the function", r.stderr)
        sass = subprocess.run([str(bindir / "cuobjdump"), "--dump-sass", str(out / f"{tag}.cubin")],
                              capture_output=True, text=True).stdout
        (out / f"{tag}.sass").write_text(sass)
        verdict = "SERIALIZED " + "; ".join(f"{c}: {why}" for c, why in serial) if serial else "pipelined"
        bad += bool(serial)
        n_ins = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        print(f"{label:<56} {regs.group(1) if regs else '?':>3} regs  spills {spill.group(1) if spill else '?':>3} B"
              f"  smem {k.metadata.shared // 1024:>3} KiB  HGMMA {sass.count('HGMMA'):>2}  {n_ins:>5} SASS  {verdict}",
              flush=True)
    print(f"PTX/SASS in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
