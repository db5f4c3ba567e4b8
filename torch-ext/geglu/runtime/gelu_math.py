"""GELU arithmetic for the Triton kernels, bit-identical to eager PyTorch's CUDA kernels on a GPU.

fp32 math in eager's operation order (ATen ActivationGeluKernel.cu), eager's constants rounded to fp32 as C++ rounds
them; erf, tanh and exp are CUDA's ``erff`` / ``tanhf`` / ``expf`` as inline PTX, independent of Triton's libdevice.
Under the interpreter (TRITON_INTERPRET=1) they are computed in fp64 and rounded to fp32, and may differ from CUDA's
by a few fp32 ulp. ``round_to``: fp32 to the storage dtype, round to nearest even.
"""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Eager's constants, as C++ computes them: the product in double, then rounded to float.
_M_SQRT2 = 1.41421356237309504880
_M_2_SQRTPI = 1.12837916709551257390
_M_SQRT1_2 = 0.70710678118654752440
K_BETA_TANH = float(torch.tensor(_M_SQRT2 * _M_2_SQRTPI * 0.5, dtype=torch.float32))
K_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))
K_ALPHA = float(torch.tensor(_M_SQRT1_2, dtype=torch.float32))
K_BETA_ERF = float(torch.tensor(_M_2_SQRTPI * _M_SQRT1_2 * 0.5, dtype=torch.float32))
# `opmath_t(3) * kKappa` is a float product in C++ (rounded to float), not a double one.
K_3KAPPA = float(torch.tensor(3.0, dtype=torch.float32) * torch.tensor(K_KAPPA, dtype=torch.float32))

if INTERPRET:
    # Computed in fp64 and rounded: (nearly) correctly rounded fp32 values.
    @triton.jit
    def _erf(x):
        return tl.erf(x.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _exp(x):
        return tl.exp(x.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _tanh(x):
        # 1 - 2 / (exp(2x) + 1): exact at 0 and saturates to +-1 without inf/inf.
        x64 = x.to(tl.float64)
        return (1.0 - 2.0 / (tl.exp(2.0 * x64) + 1.0)).to(tl.float32)

    @triton.jit
    def round_to(x, T: tl.constexpr):
        # The interpreter casts fp32 -> bf16 by truncation; the GPU (and eager) round to nearest even.
        if T == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(T)

else:
    # CUDA's erff, tanhf and expf (libdevice) as nvcc emits them, in PTX. erff's two polynomials (split at
    # |x| < 0x3F8060FE) are both evaluated and the result selected: the same bits as libdevice's branch.
    _ERF_PTX = tl.constexpr("""{
    .reg .pred p;
    .reg .f32 a, s, rs, rb, na, e;
    abs.f32 a, $1;
    mul.f32 s, $1, $1;
    fma.rn.f32 rs, 0f38B1E96A, s, 0fBA574D20;
    fma.rn.f32 rs, rs, s, 0f3BAAD5EA;
    fma.rn.f32 rs, rs, s, 0fBCDC1BE7;
    fma.rn.f32 rs, rs, s, 0f3DE718AF;
    fma.rn.f32 rs, rs, s, 0fBEC093AC;
    fma.rn.f32 rs, rs, s, 0f3E0375D3;
    fma.rn.f32 rs, rs, $1, $1;
    fma.rn.f32 rb, 0f38EB4C3A, a, 0fBAAE005B;
    fma.rn.f32 rb, rb, a, 0f3C09919F;
    fma.rn.f32 rb, rb, a, 0fBD24D99A;
    fma.rn.f32 rb, rb, a, 0f3E235519;
    fma.rn.f32 rb, rb, a, 0f3F69B4F9;
    fma.rn.f32 rb, rb, a, 0f3F210A14;
    neg.f32 na, a;
    fma.rn.f32 rb, rb, na, na;
    ex2.approx.ftz.f32 e, rb;
    sub.f32 e, 0f3F800000, e;
    copysign.f32 e, $1, e;
    setp.ltu.f32 p, a, 0f3F8060FE;
    selp.f32 $0, rs, e, p;
    }""")

    _TANH_PTX = tl.constexpr("""{
    .reg .pred p1, p2;
    .reg .f32 a, e, big, x2, r;
    abs.f32 a, $1;
    mul.f32 e, a, 0f4038AA3B;
    ex2.approx.ftz.f32 e, e;
    add.f32 e, e, 0f3F800000;
    rcp.approx.ftz.f32 e, e;
    fma.rn.f32 e, e, 0fC0000000, 0f3F800000;
    setp.ge.f32 p1, a, 0f41102CB4;
    selp.f32 e, 0f3F800000, e, p1;
    copysign.f32 big, $1, e;
    mul.f32 x2, $1, $1;
    fma.rn.f32 r, 0f3C80F082, x2, 0fBD563CAE;
    fma.rn.f32 r, r, x2, 0f3E085941;
    fma.rn.f32 r, r, x2, 0fBEAAA9ED;
    fma.rn.f32 r, r, x2, 0f00000000;
    fma.rn.f32 r, r, $1, $1;
    setp.ge.f32 p2, a, 0f3F19999A;
    selp.f32 $0, big, r, p2;
    }""")

    _EXP_PTX = tl.constexpr("""{
    .reg .f32 t, j, f, e;
    .reg .b32 i;
    fma.rn.f32 t, $1, 0f3BBB989D, 0f3F000000;
    cvt.sat.f32.f32 t, t;
    fma.rm.f32 j, t, 0f437C0000, 0f4B400001;
    add.f32 f, j, 0fCB40007F;
    neg.f32 f, f;
    fma.rn.f32 f, $1, 0f3FB8AA3B, f;
    fma.rn.f32 f, $1, 0f32A57060, f;
    mov.b32 i, j;
    shl.b32 i, i, 23;
    mov.b32 t, i;
    ex2.approx.ftz.f32 e, f;
    mul.f32 $0, e, t;
    }""")

    @triton.jit
    def _erf(x):
        return tl.inline_asm_elementwise(_ERF_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _exp(x):
        return tl.inline_asm_elementwise(_EXP_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _tanh(x):
        return tl.inline_asm_elementwise(_TANH_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def round_to(x, T: tl.constexpr):
        return x.to(T)  # round to nearest even, as eager


# Kernels launch with enable_fp_fusion=False: every FMA in eager's SASS is an explicit tl.fma, every product / sum it
# leaves separate stays separate.


@triton.jit
def gelu(x, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    if TANH:
        x_cube = x * x * x
        inner = K_BETA_TANH * tl.fma(x_cube, K_KAPPA, x)  # kBeta * (x + kKappa * x_cube)
        h = 0.5 * x * (1.0 + _tanh(inner))
    else:
        h = x * 0.5 * (1.0 + _erf(x * K_ALPHA))
    return h


@triton.jit
def gelu_grad(x, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
               K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    """d gelu / dx, in eager gelu_backward's operation order (without the final multiply by dy)."""
    if TANH:
        x_sq = x * x
        x_cube = x_sq * x
        inner = K_BETA_TANH * tl.fma(x_cube, K_KAPPA, x)
        t = _tanh(inner)
        left = 0.5 * x
        right = 1.0 + t
        tanh_derivative = tl.fma(-t, t, 1.0)  # 1 - t*t, fused as ptxas fuses it
        inner_derivative = K_BETA_TANH * tl.fma(x_sq, K_3KAPPA, 1.0)  # kBeta * (1 + 3*kKappa * x_sq)
        right_derivative = left * tanh_derivative * inner_derivative
        g = tl.fma(right, 0.5, right_derivative)  # left_derivative (0.5 * right) + right_derivative
    else:
        one_plus_erf = 1.0 + _erf(x * K_ALPHA)
        pdf = _exp(-0.5 * x * x) * K_BETA_ERF
        g = tl.fma(one_plus_erf, 0.5, x * pdf)  # cdf (0.5 * (1 + erf)) + x * pdf
    return g
