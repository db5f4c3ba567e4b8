"""Triton GeGLU kernels (forward and backward, exact and tanh GELU, fp32/fp16/bf16).

Numerics follow eager PyTorch's CUDA kernels (ATen/native/cuda/ActivationGeluKernel.cu and the `mul` kernel) step
by step: fp32 math in eager's operation order, the GELU rounded to the storage dtype before the product, the
product computed in fp32 and rounded; eager's constants rounded to fp32 the way C++ rounds them. On a GPU the
transcendental functions are CUDA's own `erff`, `tanhf` and `expf` (what eager calls) written out as the PTX that
nvcc 13 emits for them, so the result does not depend on the libdevice version the installed Triton bundles, and
the forward is bit-identical to `F.gelu(gate, approximate=...) * up`.

Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) libdevice is not available; erf comes from Python's
`math.erf` rounded to fp32 and tanh/exp from numpy, which may differ from CUDA's by a few fp32 ulp: the tests state
and check that bound.

Layout: every tensor is 2-D `[M, N]` with an arbitrary row stride and a unit-stride last dim, so the halves of a
packed `[M, 2N]` tensor and chunk views go in without a copy. Offsets are 64-bit. A program handles a
BLOCK_M x BLOCK_N tile; the last dim is vectorised to 16-byte accesses whenever strides allow it (Triton
specialises integer arguments divisible by 16).
"""

import os

import torch
import triton
import triton.language as tl

from . import _aot, _config

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
    def _round(x, T: tl.constexpr):
        # The interpreter casts fp32 -> bf16 by truncation; the GPU (and eager) round to nearest even.
        if T == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(T)

else:
    # CUDA's erff, tanhf and expf (libdevice, CUDA 13), as nvcc emits them for sm_90, in PTX: identical
    # instructions to eager's kernels whatever libdevice the installed Triton bundles, and no FMA contraction
    # across the call boundary that nvcc would not do.
    # erff evaluates one of two polynomials by |x| < 1.00295 (0x3F8060FE); both are evaluated here and the result
    # selected (the same instructions for each branch as libdevice, so the same bits): fewer instructions than
    # selecting each coefficient, and the forward erf GELU is instruction-bound at full bandwidth.
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
    def _round(x, T: tl.constexpr):
        return x.to(T)  # round to nearest even, as eager


# The arithmetic around the transcendental functions reproduces the machine code nvcc + ptxas make of eager's
# C++ (checked in the SASS, `cuobjdump -sass`, not only the PTX: ptxas contracts some plain mul/add pairs that
# nvcc left separate, e.g. tanh's `1 - t*t`): kernels launch with enable_fp_fusion=False, and every FMA in
# eager's SASS is written as tl.fma, every product/sum it leaves alone stays separate.


@triton.jit
def _gelu(x, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    if TANH:
        x_cube = x * x * x
        inner = K_BETA_TANH * tl.fma(x_cube, K_KAPPA, x)  # kBeta * (x + kKappa * x_cube)
        h = 0.5 * x * (1.0 + _tanh(inner))
    else:
        h = x * 0.5 * (1.0 + _erf(x * K_ALPHA))
    return h


@triton.jit
def _gelu_grad(x, TANH: tl.constexpr, K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
               K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    """d gelu / dx, in eager gelu_backward's operation order (without the final multiply by dy)."""
    if TANH:
        x_sq = x * x
        x_cube = x_sq * x
        inner = K_BETA_TANH * tl.fma(x_cube, K_KAPPA, x)
        t = _tanh(inner)
        left = 0.5 * x
        right = 1.0 + t
        tanh_derivative = tl.fma(-t, t, 1.0)  # 1 - t*t: nvcc's PTX keeps mul + sub, ptxas fuses them (FFMA)
        inner_derivative = K_BETA_TANH * tl.fma(x_sq, K_3KAPPA, 1.0)  # kBeta * (1 + 3*kKappa * x_sq)
        right_derivative = left * tanh_derivative * inner_derivative
        g = tl.fma(right, 0.5, right_derivative)  # left_derivative (0.5 * right) + right_derivative
    else:
        one_plus_erf = 1.0 + _erf(x * K_ALPHA)
        pdf = _exp(-0.5 * x * x) * K_BETA_ERF
        g = tl.fma(one_plus_erf, 0.5, x * pdf)  # cdf (0.5 * (1 + erf)) + x * pdf
    return g


@triton.jit
def _geglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, M, N, stride_g, stride_u, stride_o,
                      TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    h = _gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)
    # eager: gelu() returns a tensor of the storage dtype, then mul computes in fp32 and rounds.
    T = out_ptr.dtype.element_ty
    h = _round(h, T).to(tl.float32)
    out = h * u.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], _round(out, T), mask=mask)


@triton.jit
def _geglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, M, N,
                      stride_dy, stride_g, stride_u, stride_dg, stride_du,
                      TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
                      K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(grad_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    T = dg_ptr.dtype.element_ty
    # mul's backward: d_h = dy * up and d_up = dy * h, each rounded to the storage dtype (h as saved: rounded).
    h = _round(_gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    d_up = dy * h
    d_h = _round(dy * u, T).to(tl.float32)
    # gelu_backward(d_h, x): fp32, rounded once.
    d_gate = d_h * _gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA)
    tl.store(dg_ptr + rows[:, None] * stride_dg + cols[None, :], _round(d_gate, T), mask=mask)
    tl.store(du_ptr + rows[:, None] * stride_du + cols[None, :], _round(d_up, T), mask=mask)


@triton.jit
def _geglu_fwd_flat_kernel(gate_ptr, up_ptr, out_ptr, n,
                           TANH: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
                           K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr):
    """The forward on contiguous tensors seen as one flat row of n elements: no row arithmetic, and no masks when
    BLOCK divides n (EVEN). WIDE: 64-bit offsets (n >= 2^31)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(gate_ptr + offs)
        u = tl.load(up_ptr + offs)
    else:
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0)
    T = out_ptr.dtype.element_ty
    h = _round(_gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    out = _round(h * u.to(tl.float32), T)
    if EVEN:
        tl.store(out_ptr + offs, out)
    else:
        tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _geglu_bwd_flat_kernel(grad_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, n,
                           TANH: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
                           K_BETA_TANH: tl.constexpr, K_KAPPA: tl.constexpr, K_ALPHA: tl.constexpr,
                           K_BETA_ERF: tl.constexpr, K_3KAPPA: tl.constexpr):
    """The backward on contiguous tensors seen as one flat row (see _geglu_fwd_flat_kernel)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        dy = tl.load(grad_ptr + offs).to(tl.float32)
        x = tl.load(gate_ptr + offs).to(tl.float32)
        u = tl.load(up_ptr + offs).to(tl.float32)
    else:
        mask = offs < n
        dy = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    T = dg_ptr.dtype.element_ty
    h = _round(_gelu(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)
    d_up = _round(dy * h, T)
    d_h = _round(dy * u, T).to(tl.float32)
    d_gate = _round(d_h * _gelu_grad(x, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA), T)
    if EVEN:
        tl.store(dg_ptr + offs, d_gate)
        tl.store(du_ptr + offs, d_up)
    else:
        tl.store(dg_ptr + offs, d_gate, mask=mask)
        tl.store(du_ptr + offs, d_up, mask=mask)


_SM_COUNT = {}
_PLANS = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _tiles(M: int, N: int, element_size: int, device: torch.device, tensors: int):
    """Tile shape and warps: 2 x 1024 tiles at 4 warps (16 elements a thread: two 16-byte vectors per tensor) for
    2-byte dtypes; fp32 keeps the bytes per program. Narrower column tiles when the grid would not cover the SMs
    twice."""
    per_program = 2048 if element_size <= 2 else 1024
    block_n = min(_next_pow2(N), 1024)
    block_m = max(1, min(_next_pow2(M), per_program // block_n))
    waves = 2 * _sm_count(device)
    while block_n > 128 and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < waves:
        block_n //= 2
    num_warps = 4 if block_m * block_n >= 1024 else 2 if block_m * block_n >= 256 else 1
    return block_m, block_n, num_warps


def _plan(M: int, N: int, t: torch.Tensor, tensors: int):
    """(grid, tiles) cached per shape: the launch path runs at every call, decode included."""
    key = (M, N, t.element_size(), t.device, tensors)
    plan = _PLANS.get(key)
    if plan is None:
        block_m, block_n, num_warps = _tiles(M, N, t.element_size(), t.device, tensors)
        plan = ((triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n, num_warps)
        if len(_PLANS) < 4096:
            _PLANS[key] = plan
    return plan


# Flat kernels: (elements per program, warps) for 2-byte and 4-byte dtypes.
FLAT_TILES = {2: (2048, 4), 4: (1024, 4)}


def _flat_plan(n: int, t: torch.Tensor):
    key = (n, t.element_size(), t.device, "flat")
    plan = _PLANS.get(key)
    if plan is None:
        block, num_warps = FLAT_TILES[2 if t.element_size() <= 2 else 4]
        sms = _sm_count(t.device)
        while block > 256 and triton.cdiv(n, block) < 2 * sms:
            block //= 2
            num_warps = max(1, min(num_warps, block // 256))
        plan = ((triton.cdiv(n, block),), block, num_warps, n % block == 0, n >= 2**31 - block)
        if len(_PLANS) < 4096:
            _PLANS[key] = plan
    return plan


def _flat(M: int, N: int, *tensors: torch.Tensor) -> bool:
    """All tensors are one contiguous block of M*N elements (rows follow each other without gaps)."""
    if M == 1:
        return True
    for t in tensors:
        if t.stride(0) != N:
            return False
    return True


# --- launching -----------------------------------------------------------------------------------------------------
# A launch runs the kernel this variant ships prebuilt for the device's architecture where there is one (`_aot`: no
# compilation on the user's machine), else Triton's JIT. JITFunction's launch path binds and specialises every
# argument in Python on every call (tens of µs of host time, more than the kernel at small sizes): the first JIT
# launch for a specialisation goes through Triton (which compiles and caches the kernel), later ones call that
# compiled kernel's launcher directly. The key is at least as fine as Triton's specialisation (pointer dtype and
# 16-byte alignment; integer divisibility by 16, == 1 and width), plus the constexprs, warps and device. Any
# surprise from a Triton version (a missing attribute, another launcher signature) turns the direct JIT path off
# for the process and leaves Triton's own launch.

_DIRECT_LAUNCH = {}
_direct_ok = not INTERPRET
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _spec(a):
    if isinstance(a, int):
        return a % 16 == 0, a == 1, -(2**31) <= a < 2**31, 0 <= a < 2**63
    if isinstance(a, float):
        return float
    if isinstance(a, _aot.Desc):
        return a.base.dtype, tuple(a.block)
    return a.dtype, a.data_ptr() % 16 == 0


def _hook_active(hook) -> bool:
    # Triton >= 3.5 keeps a HookChain (never None; empty unless a profiler added a hook); older ones None or a function
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is None or _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


_PREBUILT = {}  # launch key -> the prebuilt kernel's run, or None (none for that launch)


def prebuilt(fn, grid, args, consts, num_warps: int, num_stages: int, device_index: int) -> bool:
    """Launch ``fn``'s prebuilt kernel for these arguments on the current stream; False when this variant has none
    for the device (the caller then uses Triton's JIT). The lookup is remembered per launch key (as `_launch`'s)."""
    if INTERPRET:
        return False
    key = (fn, num_warps, num_stages, device_index, consts, _config.current.prebuilt) + tuple(_spec(a) for a in args)
    run = _PREBUILT.get(key, False)
    if run is False:
        run = _aot.find(fn.__name__, args, consts, num_warps, num_stages, device_index)
        if len(_PREBUILT) < 4096:
            _PREBUILT[key] = run
    if run is None:
        return False
    run(grid, args, _raw_stream(device_index))
    return True


def _launch(fn, grid, args, consts, num_warps: int, device: torch.device) -> None:
    """fn[grid](*args, *consts, num_warps=num_warps, enable_fp_fusion=False), the launch path described above.
    ``args``: the kernel's runtime arguments in order; ``consts``: its constexprs in order, after them."""
    global _direct_ok
    key = None
    if not INTERPRET:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (fn, num_warps, idx, consts, _config.current.prebuilt) + tuple(_spec(a) for a in args)
        hit = _DIRECT_LAUNCH.get(key)
        if hit is not None:
            run, function, meta = hit
            if function is None:  # prebuilt
                run(grid, args, _raw_stream(idx))
                return
            if not _hooks_set():
                run(grid[0], grid[1] if len(grid) > 1 else 1, 1, _raw_stream(idx), function, meta, None, None, None,
                    *args, *consts)
                return
        else:
            aot = _aot.find(fn.__name__, args, consts, num_warps, 3, idx)
            if aot is not None:
                _DIRECT_LAUNCH[key] = (aot, None, None)
                aot(grid, args, _raw_stream(idx))
                return
    compiled = fn[grid](*args, *consts, num_warps=num_warps, enable_fp_fusion=False)
    if key is not None and _direct_ok:
        try:
            _DIRECT_LAUNCH[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        except Exception:  # another Triton's CompiledKernel: keep its own launch path
            _direct_ok = False


def _device_guard(t: torch.Tensor):
    """Triton launches on the current device: switch only when the tensors live elsewhere (the switch costs
    more than a decode-sized kernel)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NULL


def geglu_fwd(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, tanh: bool) -> None:
    """out[M, N] = gelu(gate) * up on 2-D row-strided tensors (the caller validated them)."""
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    consts_tail = (K_BETA_TANH, K_KAPPA, K_ALPHA)
    with _device_guard(gate):
        if _flat(M, N, out, gate, up):
            grid, block, num_warps, even, wide = _flat_plan(M * N, gate)
            _launch(_geglu_fwd_flat_kernel, grid, (gate, up, out, M * N), (tanh, block, even, wide) + consts_tail,
                    num_warps, gate.device)
            return
        grid, block_m, block_n, num_warps = _plan(M, N, gate, 3)
        _launch(_geglu_fwd_kernel, grid, (gate, up, out, M, N, gate.stride(0), up.stride(0), out.stride(0)),
                (tanh, block_m, block_n) + consts_tail, num_warps, gate.device)


def geglu_bwd(d_gate: torch.Tensor, d_up: torch.Tensor, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              tanh: bool) -> None:
    """d_gate, d_up from grad, gate, up (2-D row-strided; d_gate may alias gate and d_up alias up)."""
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    consts_tail = (K_BETA_TANH, K_KAPPA, K_ALPHA, K_BETA_ERF, K_3KAPPA)
    with _device_guard(gate):
        if _flat(M, N, d_gate, d_up, grad, gate, up):
            grid, block, num_warps, even, wide = _flat_plan(M * N, gate)
            _launch(_geglu_bwd_flat_kernel, grid, (grad, gate, up, d_gate, d_up, M * N),
                    (tanh, block, even, wide) + consts_tail, num_warps, gate.device)
            return
        grid, block_m, block_n, num_warps = _plan(M, N, gate, 5)
        _launch(_geglu_bwd_kernel, grid,
                (grad, gate, up, d_gate, d_up, M, N, grad.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0),
                 d_up.stride(0)),
                (tanh, block_m, block_n) + consts_tail, num_warps, gate.device)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullContext()
