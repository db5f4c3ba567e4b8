"""Bit-exactness with eager PyTorch, checked without a GPU: the SASS of our GELU math equals eager's.

Eager's CUDA GELU (ATen/native/cuda/ActivationGeluKernel.cu) is transcribed below, expression for expression,
as scalar device functions; geglu_kernels.cuh's device functions must compile (same nvcc, same flags: no fast
math, default FMA contraction) to the *same machine code*, instruction for instruction. Same instructions on the
same inputs give the same bits, so this pins down the part of bit-exactness that could silently drift: operation
order and nvcc's FMA contraction choices. The rounding between stages (T(h), T(dy * up)) is checked on the GPU
by tests/kernel/test_cuda_gpu.py. The transcription has to be updated if PyTorch changes its formulas.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from ._sass import _split_operands

REPO = Path(__file__).resolve().parents[2]

EAGER_AND_OURS = r"""
#define _USE_MATH_DEFINES
#include <cmath>
#include "geglu_kernels.cuh"

// --- eager PyTorch (opmath_t = float for float, half and bfloat16), transcribed ---
namespace eager {
__device__ float gelu_tanh(float x) {
  constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * float(0.5);
  constexpr float kKappa = 0.044715;
  auto x_cube = x * x * x;
  auto inner = kBeta * (x + kKappa * x_cube);
  return float(0.5) * x * (float(1) + tanhf(inner));
}
__device__ float gelu_erf(float x) {
  constexpr float kAlpha = M_SQRT1_2;
  return x * float(0.5) * (float(1) + erff(x * kAlpha));
}
__device__ float gelu_backward_tanh(float dy, float x) {
  constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * float(0.5);
  constexpr float kKappa = 0.044715;
  auto x_sq = x * x;
  auto x_cube = x_sq * x;
  auto inner = kBeta * (x + kKappa * x_cube);
  auto tanh_inner = tanhf(inner);
  auto left = float(0.5) * x;
  auto right = float(1) + tanh_inner;
  auto left_derivative = float(0.5) * right;
  auto tanh_derivative = float(1) - tanh_inner * tanh_inner;
  auto inner_derivative = kBeta * (float(1) + float(3) * kKappa * x_sq);
  auto right_derivative = left * tanh_derivative * inner_derivative;
  return dy * (left_derivative + right_derivative);
}
__device__ float gelu_backward_erf(float dy, float x) {
  constexpr float kBeta = M_2_SQRTPI * M_SQRT1_2 * float(0.5);
  constexpr float kAlpha = M_SQRT1_2;
  const float cdf = float(0.5) * (float(1) + erff(x * kAlpha));
  const float pdf = expf(float(-0.5) * x * x) * kBeta;
  return dy * (cdf + x * pdf);
}
}  // namespace eager

using namespace geglu::device;
// forward: gelu alone
__global__ void eager_fwd_tanh(float* o, const float* i) { o[0] = eager::gelu_tanh(i[0]); }
__global__ void ours_fwd_tanh(float* o, const float* i) { o[0] = gelu<true>(i[0]); }
__global__ void eager_fwd_erf(float* o, const float* i) { o[0] = eager::gelu_erf(i[0]); }
__global__ void ours_fwd_erf(float* o, const float* i) { o[0] = gelu<false>(i[0]); }
// backward: gelu'(x) * dy alone (ours also computes h, here unused)
__global__ void eager_bwd_tanh(float* o, const float* i) { o[0] = eager::gelu_backward_tanh(i[1], i[0]); }
__global__ void ours_bwd_tanh(float* o, const float* i) { float h; o[0] = gelu_and_backward<true>(i[0], i[1], h); }
__global__ void eager_bwd_erf(float* o, const float* i) { o[0] = eager::gelu_backward_erf(i[1], i[0]); }
__global__ void ours_bwd_erf(float* o, const float* i) { float h; o[0] = gelu_and_backward<false>(i[0], i[1], h); }
// the h that the fused backward computes next to gelu' is the forward's h
__global__ void eager_h_tanh(float* o, const float* i) { o[0] = eager::gelu_tanh(i[0]); }
__global__ void ours_h_tanh(float* o, const float* i) { gelu_and_backward<true>(i[0], i[1], o[0]); }
__global__ void eager_h_erf(float* o, const float* i) { o[0] = eager::gelu_erf(i[0]); }
__global__ void ours_h_erf(float* o, const float* i) { gelu_and_backward<false>(i[0], i[1], o[0]); }
"""

PAIRS = ["fwd_tanh", "fwd_erf", "bwd_tanh", "bwd_erf", "h_tanh", "h_erf"]


def _tools():
    nvcc = shutil.which("nvcc")
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import triton

            p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            cuobjdump = str(p) if p.is_file() else None
        except ImportError:
            pass
    return nvcc, cuobjdump


def _sass_by_function(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : _Z\d+(\w+?)Pf", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if m and cur:
            funcs[cur].append(re.sub(r"\s+", " ", m.group(1)).replace(".reuse", ""))
    return funcs


# --- a symbolic evaluator for straight-line SASS -----------------------------------------------------------
# Each register holds an expression tree (nested tuples); what a function stores is compared, so register
# allocation, scheduling and how constants are materialised do not matter, but every floating-point
# operation, its operands, rounding modifiers and FMA contraction do.

_REG = re.compile(r"\b(UR\d+|UP\d+|R\d+|P\d+)\b")
_COMMUTATIVE = {"FMUL", "FADD", "FMNMX"}


def _const(bits: int):
    return ("const", bits & 0xFFFFFFFF)


def _float_bits(text: str):
    try:
        if re.fullmatch(r"-?0x[0-9a-f]+", text):
            return _const(int(text, 16))
        if re.fullmatch(r"[-+]?(\d+\.?\d*(e[-+]?\d+)?|inf|nan)", text, re.I):
            return _const(struct.unpack("<I", struct.pack("<f", float(text)))[0])
    except (ValueError, OverflowError):
        pass
    return None


def _evaluate(instrs: list[str]) -> dict:
    regs: dict[str, object] = {"RZ": _const(0), "PT": ("true",), "URZ": _const(0)}
    stores: dict = {}

    def value(operand: str):
        op = operand.strip()
        imm = _float_bits(op)
        if imm is not None:
            return imm
        return ("opnd", _REG.sub(lambda m: repr(regs.get(m.group(0), ("undef", m.group(0)))), op))

    for ins in instrs:
        pred = None
        m = re.match(r"@(!?)(P\d+|PT|UP\d+)\s+(.*)", ins)
        if m:
            pred, ins = (m.group(1), regs.get(m.group(2), ("undef", m.group(2)))), m.group(3)
        opcode, _, rest = ins.partition(" ")
        ops = _split_operands(rest)
        base = opcode.split(".")[0]
        if base in ("EXIT", "BRA", "NOP", "RET"):
            continue
        if base in ("STG", "ST", "STS"):
            stores[value(ops[0])] = value(ops[1])
            continue
        if base in ("FSETP", "ISETP"):
            dsts, srcs = ops[:2], ops[2:]
        else:
            dsts, srcs = ops[:1], ops[1:]
        if opcode == "HFMA2.MMA" and srcs[:2] == ["-RZ", "RZ"]:  # materialises a 32-bit constant from two halves
            lo, hi = (struct.unpack("<H", struct.pack("<e", float(x)))[0] for x in srcs[2:4])
            result = _const(lo | hi << 16)
        elif opcode in ("MOV", "IMAD.MOV.U32", "IMAD.MOV") and _float_bits(srcs[-1]) is not None:
            result = _float_bits(srcs[-1])
        elif base == "MOV":
            result = value(srcs[0])
        else:
            args = [value(x) for x in srcs]
            if base in _COMMUTATIVE:
                args = sorted(args, key=repr)
            elif base in ("FFMA", "HFMA2"):
                args = sorted(args[:2], key=repr) + args[2:]
            result = (opcode, *args)
        for i, dst in enumerate(dsts):
            reg = _REG.search(dst)
            if reg is None or dst in ("PT", "RZ"):
                continue
            name = reg.group(0)
            new = (result, i) if len(dsts) > 1 else result
            regs[name] = ("sel", pred, new, regs.get(name, ("undef", name))) if pred else new
    return stores


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_gelu_sass_is_eagers(tmp_path, arch):
    nvcc, cuobjdump = _tools()
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    src = tmp_path / "eq.cu"
    src.write_text(EAGER_AND_OURS)
    cubin = tmp_path / "eq.cubin"
    subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", f"-I{REPO / 'geglu'}", str(src), "-o",
                    str(cubin)], check=True, capture_output=True)
    funcs = _sass_by_function(subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                                             text=True).stdout)
    for pair in PAIRS:
        eager, ours = funcs[f"eager_{pair}"], funcs[f"ours_{pair}"]
        assert any(i.startswith(("FFMA", "FMUL")) for i in eager), f"{pair}: no float math found"
        e, o = _evaluate(eager), _evaluate(ours)
        assert len(e) == 1, f"{pair}: expected one store, got {len(e)}"
        assert o == e, f"{arch} {pair}: our computation differs from eager's:\n" + "\n".join(
            f"{a:60s} | {b}" for a, b in zip(eager, ours)
        )
