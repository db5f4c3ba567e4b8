"""The fused GEMM kernels (the dense paired gate/up kernel and the MoE experts' grouped one) compile for sm_90
without a GPU: ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the launch's tile configs, tensor
descriptors and options. The interpreter tests run their Python semantics on CPU tensors; this catches what only
the GPU compiler sees (types, layouts, shared memory) in CI. The compiled kernels must use the Hopper instructions
the configs are chosen for: wgmma for the dots, TMA bulk-tensor loads for the tiles.

The compile runs in a subprocess without TRITON_INTERPRET (under it the package defines CPU stand-ins for its PTX),
importing the package's modules from ``torch-ext/geglu`` as a package object without running its ``__init__``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import importlib, json, sys, types
from pathlib import Path

pkg = types.ModuleType("geglu_offline")
pkg.__path__ = [str(Path(sys.argv[1]) / "torch-ext" / "geglu")]
sys.modules["geglu_offline"] = pkg
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

et = importlib.import_module("geglu_offline.experts.kernels")
ft = importlib.import_module("geglu_offline.mlp.kernels")
assert not et.INTERPRET
K = dict(K_BETA_TANH=et.K_BETA_TANH, K_KAPPA=et.K_KAPPA, K_ALPHA=et.K_ALPHA)


def compile_(fn, cfg, const, descs):
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = f"tensordesc<bf16[{', '.join(map(str, descs[name]))}]>"
        elif name == "out_ptr":
            sig[name] = "*bf16"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False))
    ptx = k.asm["ptx"]
    return dict(config=str(cfg), wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                shared=k.metadata.shared)


out = {}
for name, cfg in (("experts LARGE", et.LARGE), ("experts SMALL_M", et.SMALL_M)):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    const = dict(TANH=True, DOT_F32=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FLATTEN=cfg.flatten,
                 FAST_EPI=cfg.fast_epi, **K)
    out[name] = compile_(et._grouped_geglu_kernel, cfg, const, dict(x_desc=[bm, bk], w_desc=[1, 2, bn, bk]))
cfg = ft.PAIRED_LARGE
bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
const = dict(TANH=True, DOT_F32=False, GATE_FIRST=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
             GROUP_M=cfg.group_m, PERSISTENT=cfg.persistent, FLATTEN=cfg.flatten, FAST_EPI=cfg.fast_epi, **K)
descs = dict(x_ptr=[bm, bk], w_ptr=[2, bn, bk], out_ptr=[bm, bn])
out["dense PAIRED_LARGE"] = compile_(ft._paired_gate_up_geglu_kernel, cfg, const, descs)
print(json.dumps(out))
"""


def test_fused_gemm_kernels_compile_for_sm90_with_wgmma_and_tma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.splitlines()[-1])
    assert set(res) == {"experts LARGE", "experts SMALL_M", "dense PAIRED_LARGE"}
    for name, r in res.items():
        assert r["wgmma"] and r["tma"], (name, r)
        assert 0 < r["shared"] <= 227 * 1024, (name, r)  # sm_90's shared memory per block
