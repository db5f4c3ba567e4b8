"""Compiles the package's Triton kernels for NVIDIA GPUs without a GPU (triton.compile for a GPUTarget), for
tests/kernel/test_triton_ptx.py. Run as a script, in a process where TRITON_INTERPRET is unset (under the
interpreter `pointwise/kernels.py` defines its CPU stand-ins for erf/tanh/exp instead of CUDA's PTX):

    python tests/kernel/_triton_offline.py OUT_DIR 80,90,100

Writes OUT_DIR/<tag>.ptx and OUT_DIR/<tag>.cubin for

* ``kernel-<name>-<dtype>-<erf|tanh>-sm<arch>``: the four pointwise kernels as the launcher runs them (its tile
  plan, enable_fp_fusion=False, 16-byte aligned arguments), every dtype, at the first arch;
* ``probe-<fwd|bwd>-<erf|tanh>-sm<arch>``: one-element kernels computing ``_gelu(x)`` and ``dy * _gelu_grad(x)``
  (what the kernels compute per element between their loads and roundings) for the SASS comparison with eager's
  CUDA code, at every arch;

and OUT_DIR/manifest.json listing them, with pointwise/kernels.py's inline PTX for erf, tanh and exp.
"""

import importlib
import json
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PACKAGE = Path(__file__).resolve().parents[2] / "torch-ext" / "geglu"

# the package's pointwise kernels and the GELU arithmetic they share, imported as submodules of a stand-in package
# (its __init__, which needs the built _ops, is not run)
_pkg = types.ModuleType("geglu_triton_offline")
_pkg.__path__ = [str(PACKAGE)]
sys.modules[_pkg.__name__] = _pkg
tri = importlib.import_module("geglu_triton_offline.pointwise.kernels")
if tri.INTERPRET:
    sys.exit("TRITON_INTERPRET=1 is set: runtime/gelu_math.py would define the interpreter's functions, not CUDA's PTX")

gm = importlib.import_module("geglu_triton_offline.runtime.gelu_math")
_gelu, _gelu_grad = gm.gelu, gm.gelu_grad


@triton.jit
def probe_fwd(o_ptr, i_ptr, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr,
              K_ALPHA: tl.constexpr):
    x = tl.load(i_ptr)
    tl.store(o_ptr, _gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA))


@triton.jit
def probe_bwd(o_ptr, i_ptr, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr,
              K_ALPHA: tl.constexpr, K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    x = tl.load(i_ptr)
    dy = tl.load(i_ptr + 1)
    tl.store(o_ptr, dy * _gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA))


FWD_K = dict(K_BETA_TANH=tri.K_BETA_TANH, K_KAPPA=tri.K_KAPPA, K_ALPHA=tri.K_ALPHA)
BWD_K = dict(FWD_K, K_BETA_ERF=tri.K_BETA_ERF, K_3KAPPA=tri.K_3KAPPA)
TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compile_kernel(fn, arch: int, ptr_type: str, constexprs: dict, num_warps: int):
    """fn for cuda:arch as the launcher specialises it: pointers of ptr_type, 32-bit integers, every runtime
    argument 16-byte aligned / divisible by 16, no FMA contraction (enable_fp_fusion=False, as `_launch`)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = ptr_type if name.endswith("_ptr") else "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def main(out: Path, archs: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    manifest = []

    def save(tag, compiled, **meta):
        (out / f"{tag}.ptx").write_text(compiled.asm["ptx"])
        (out / f"{tag}.cubin").write_bytes(compiled.asm["cubin"])
        manifest.append(dict(tag=tag, **meta))

    cpu = torch.device("cpu")  # the plan for a device without SM count: 8 "SMs"; the tile shapes are the same
    for dtype, tname in TRITON_DTYPE.items():
        es = torch.empty((), dtype=dtype).element_size()
        block, flat_warps = tri.FLAT_TILES[2 if es <= 2 else 4]
        block_m, block_n, warps = tri._tiles(8192, 8192, es, cpu, 3)
        for tanh in (False, True):
            flavour = "tanh" if tanh else "erf"
            kernels = [
                ("fwd_flat", tri._geglu_fwd_flat_kernel, dict(TANH=tanh, BLOCK=block, EVEN=True, WIDE=False, **FWD_K),
                 flat_warps),
                ("bwd_flat", tri._geglu_bwd_flat_kernel, dict(TANH=tanh, BLOCK=block, EVEN=True, WIDE=False, **BWD_K),
                 flat_warps),
                ("fwd_rows", tri._geglu_fwd_kernel, dict(TANH=tanh, BLOCK_M=block_m, BLOCK_N=block_n, **FWD_K), warps),
                ("bwd_rows", tri._geglu_bwd_kernel, dict(TANH=tanh, BLOCK_M=block_m, BLOCK_N=block_n, **BWD_K), warps),
            ]
            for name, fn, consts, nw in kernels:
                tag = f"kernel-{name}-{tname}-{flavour}-sm{archs[0]}"
                elements = consts["BLOCK"] if "BLOCK" in consts else consts["BLOCK_M"] * consts["BLOCK_N"]
                save(tag, compile_kernel(fn, archs[0], f"*{tname}", consts, nw), kind="kernel", kernel=name,
                     dtype=tname, tanh=tanh, arch=archs[0], elements_per_thread=elements // (32 * nw))
    for arch in archs:
        for tanh in (False, True):
            flavour = "tanh" if tanh else "erf"
            for name, fn, consts in (("fwd", probe_fwd, FWD_K), ("bwd", probe_bwd, BWD_K)):
                tag = f"probe-{name}-{flavour}-sm{arch}"
                save(tag, compile_kernel(fn, arch, "*fp32", dict(TANH=tanh, **consts), 1), kind="probe",
                     probe=name, tanh=tanh, arch=arch)
    ptx = {"erf": gm._ERF_PTX.value, "tanh": gm._TANH_PTX.value, "exp": gm._EXP_PTX.value}
    (out / "manifest.json").write_text(json.dumps({"compiled": manifest, "ptx": ptx}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(a) for a in sys.argv[2].split(",")])
