"""Host cost of one call at decode size (1 x 14336 bf16), back to back: where the microseconds go.
Dev tool for the low-overhead work; prints µs per call for each layer of the call path.

    python benchmarks/launch_overhead.py [--build-dir build]
"""
import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kerneltools.bench import graph_call_us, per_call_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", type=Path, default=Path("build"))
    args = ap.parse_args()
    import kernels

    geglu = kernels.get_local_kernel(args.build_dir)
    tr = importlib.import_module(geglu.__name__ + "._triton")
    co = importlib.import_module(geglu.__name__ + "._custom_ops")
    g = torch.randn(1, 14336, device="cuda").bfloat16()
    out = torch.empty_like(g)
    c = dict(K_BETA_TANH=tr.K_BETA_TANH, K_KAPPA=tr.K_KAPPA, K_ALPHA=tr.K_ALPHA)
    grid = (1, 14)
    rows = {
        "eager F.gelu(g)*u": lambda: F.gelu(g, approximate="tanh") * g,
        "empty_like": lambda: torch.empty_like(g),
        "triton raw launch, fusion kwarg": lambda: tr._geglu_fwd_kernel[grid](
            g, g, out, 1, 14336, 14336, 14336, 14336, TANH=True, BLOCK_M=1, BLOCK_N=1024, num_warps=4,
            enable_fp_fusion=False, **c),
        "triton raw launch, no kwargs": lambda: tr._geglu_fwd_kernel[grid](
            g, g, out, 1, 14336, 14336, 14336, 14336, TANH=True, BLOCK_M=1, BLOCK_N=1024, **c),
        "triton geglu_fwd()": lambda: tr.geglu_fwd(out, g, g, True),
    }
    rows["torch.mul(g, u) (one aten op)"] = lambda: torch.mul(g, g)
    if geglu.HAS_CUDA_LIB:
        op = geglu.ops.geglu_fwd.default
        rows["cuda op (OpOverload)"] = lambda: op(out, g, g, True)
        direct = importlib.import_module(geglu.__name__ + "._direct")
        if direct.AVAILABLE:
            rows["cuda C entry (ctypes), out given"] = lambda: direct.fwd(out, g, g, True, True)
            # Where the entry point's microseconds go: ctypes alone, the stream query, one data_ptr, and the
            # launch with every argument precomputed.
            dev, gp, op_ = g.get_device(), g.data_ptr(), out.data_ptr()
            stream = direct._stream(dev)
            rows["ctypes call, no work (error_string)"] = lambda: direct._err(0)
            rows["current stream query"] = lambda: direct._stream(dev)
            rows["tensor.data_ptr()"] = lambda: g.data_ptr()
            rows["C entry, ints precomputed"] = lambda: direct._fwd(2, op_, 14336, gp, 14336, gp, 14336, 1, 14336,
                                                                   1, dev, stream)
    rows["python call of a no-op lambda"] = lambda: None
    gg = g.clone().requires_grad_()
    dy = torch.randn_like(g)
    rows["autograd eager fwd+bwd"] = lambda: torch.autograd.grad(F.gelu(gg, approximate="tanh") * gg, [gg], dy)
    rows["autograd eager fwd"] = lambda: F.gelu(gg, approximate="tanh") * gg
    for name in ("cuda", "triton"):
        if name == "cuda" and not geglu.HAS_CUDA_LIB:
            continue
        geglu.set_backend(name)
        rows[f"{name}: _forward_into"] = lambda: co._forward_into(out, g, g, "tanh")
        rows[f"{name}: geglu(out=)"] = lambda: geglu.geglu(g, g, "tanh", out=out)
        rows[f"{name}: geglu()"] = lambda: geglu.geglu(g, g, "tanh")
        rows[f"{name}: autograd geglu() fwd"] = lambda: geglu.geglu(gg, gg, "tanh")
        rows[f"{name}: autograd geglu() fwd+bwd"] = lambda: torch.autograd.grad(geglu.geglu(gg, gg, "tanh"), [gg], dy)
        for label, fn in list(rows.items()):
            if label.startswith(name + ":"):
                print(f"{label:<40} {per_call_us(fn):8.2f} us/call")
    geglu.set_backend("auto")
    for label, fn in rows.items():
        if ":" not in label:
            print(f"{label:<40} {per_call_us(fn):8.2f} us/call")
    # Decode under a CUDA graph (transformers' static cache + "reduce-overhead"): 100 calls captured, replayed;
    # per call = GPU time plus the graph's per-node cost, the host out of it.
    for label, fn in (("graph: ours geglu()", lambda: geglu.geglu(g, g, "tanh")),
                      ("graph: eager F.gelu(g)*u", lambda: F.gelu(g, approximate="tanh") * g)):
        print(f"{label:<40} {graph_call_us(fn):8.2f} us/call")
    launch_floor()


def launch_floor():
    """The host's floor without Python (benchmarks/launch_floor.cu), when nvcc is available."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("launch floor: nvcc not found, skipped")
        return
    src = Path(__file__).with_name("launch_floor.cu")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "launch_floor"
        subprocess.run([nvcc, "-O2", "-o", str(exe), str(src)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
