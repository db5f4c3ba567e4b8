// GeGLU CUDA kernels: out = gelu(gate) * up, forward and backward, exact-erf and tanh GELU.
//
// The host interface below is plain C++ (no CUDA or torch types) so that the stable-ABI binding
// (torch-ext/torch_binding.cpp, compiled by the host compiler) and the kernels (geglu_kernels.cu, compiled
// by nvcc) share it. The device-side math (eager PyTorch's formulas, operation for operation) is in the
// __CUDACC__ section; docs/design.md "Numerics" and docs/cuda.md describe it.
#pragma once

#include <cstdint>

namespace geglu {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A 2-D [rows, cols] view: element (i, j) lives at data + i * row_stride + j (in elements).
struct View2D {
  void* data;
  int64_t row_stride;
};

// Launch status: 0 on success, otherwise a CUDA error code (see error_string).
using Status = int;

// out = T(float(T(gelu(gate))) * float(up)); eager PyTorch's rounding. rows == 0 or cols == 0: no-op.
// Every output element is written by the thread that reads the same element of the inputs, after reading it,
// so `out` may alias `gate` or `up` exactly (same data and row stride). Partial overlaps are the caller's bug.
Status geglu_fwd(DType dtype, View2D out, View2D gate, View2D up, int64_t rows, int64_t cols, bool tanh,
                 void* stream);

// d_up = T(grad * T(h)), d_gate = T(T(grad * up) * gelu'(gate)); eager autograd's rounding.
// d_gate may alias gate and d_up may alias up exactly (in-place backward): same rule as above.
Status geglu_bwd(DType dtype, View2D d_gate, View2D d_up, View2D grad, View2D gate, View2D up, int64_t rows,
                 int64_t cols, bool tanh, void* stream);

const char* status_string(Status status);

// Force the launch plan of every later launch, for tuning and tests: `threads` (32..256, a multiple of 32) with
// either `unroll` 1, 2 or 4 vectors per tensor per thread and `stages` 0 (one tile per block), or `stages` 2 or 4
// (the cp.async pipeline) and `unroll` 1. threads == 0 restores the built-in choice. An invalid plan returns
// cudaErrorInvalidValue and changes nothing. Process-wide, no CUDA call.
Status set_launch_plan(int threads, int unroll, int stages);

}  // namespace geglu

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace geglu {
namespace device {

// ---- element conversions: exactly c10's (round to nearest even, cvt.rn) ------------------------------------

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
  // Two floats -> two T packed in one 32-bit word (float: not packed; unused).
};

template <>
struct Elem<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(Pair p) { return __half22float2(p); }
};

template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(Pair p) { return __bfloat1622float2(p); }
};

// ---- GELU: eager PyTorch's expressions (ATen/native/cuda/ActivationGeluKernel.cu), same operation order, ----
// ---- so that nvcc's FMA contraction makes the same choices. opmath is float. Do not "simplify".        ----

// Constants are computed as eager computes them: in double, then converted to float.
constexpr float kAlpha = M_SQRT1_2;                           // exact gelu
constexpr float kBetaTanh = M_SQRT2 * M_2_SQRTPI * float(0.5);  // tanh gelu and its derivative
constexpr float kKappa = 0.044715;
constexpr float kBetaErf = M_2_SQRTPI * M_SQRT1_2 * float(0.5);  // exact gelu derivative (pdf scale)

__device__ __forceinline__ float gelu_erf(float x) {
  return x * float(0.5) * (float(1) + ::erff(x * kAlpha));
}

__device__ __forceinline__ float gelu_tanh(float x) {
  auto x_cube = x * x * x;
  auto inner = kBetaTanh * (x + kKappa * x_cube);
  return float(0.5) * x * (float(1) + ::tanhf(inner));
}

template <bool kTanh>
__device__ __forceinline__ float gelu(float x) {
  if constexpr (kTanh) {
    return gelu_tanh(x);
  } else {
    return gelu_erf(x);
  }
}

// gelu_backward(dy, x) of eager: dy * gelu'(x), dy being the already rounded T(grad * up) as a float.
// Also returns gelu(x) (h) from the same transcendental so that the fused backward computes erff/tanhf once:
// eager's forward and backward share the same subexpression (x * kAlpha, resp. inner), bit for bit.
template <bool kTanh>
__device__ __forceinline__ float gelu_and_backward(float x, float dy, float& h) {
  if constexpr (kTanh) {
    // forward: 0.5 * x * (1 + tanh(inner)) with inner = kBeta * (x + kKappa * x*x*x)
    auto x_sq = x * x;
    auto x_cube = x_sq * x;
    auto inner = kBetaTanh * (x + kKappa * x_cube);
    auto tanh_inner = ::tanhf(inner);
    auto left = float(0.5) * x;
    auto right = float(1) + tanh_inner;
    h = left * right;
    auto left_derivative = float(0.5) * right;
    auto tanh_derivative = float(1) - tanh_inner * tanh_inner;
    auto inner_derivative = kBetaTanh * (float(1) + float(3) * kKappa * x_sq);
    auto right_derivative = left * tanh_derivative * inner_derivative;
    return dy * (left_derivative + right_derivative);
  } else {
    auto erf_term = float(1) + ::erff(x * kAlpha);
    h = x * float(0.5) * erf_term;
    const float cdf = float(0.5) * erf_term;
    const float pdf = ::expf(float(-0.5) * x * x) * kBetaErf;
    return dy * (cdf + x * pdf);
  }
}

// ---- work decomposition helpers (host and device, so that tests/kernel/test_cuda_indexing.py can run them) --

// Row/column of a flat vector index. mode 0: one row. mode 1: total <= 2^32 - 1, divide with a 32-bit magic
// multiplier (Granlund-Montgomery's round-up method, as PyTorch's IntDivider; the 33-bit sum is formed in
// 64 bits, so it is exact for every 32-bit numerator). mode 2: 64-bit division (more than 2^32 - 1 vectors).
struct RowDivider {
  int64_t nvec;    // vectors per row
  uint32_t magic;  // mode 1
  uint32_t shift;  // mode 1
  int mode;

  static RowDivider make(int64_t rows, int64_t nvec) {
    RowDivider d{nvec, 0, 0, 0};
    if (rows <= 1) {
      d.mode = 0;
    } else if (static_cast<uint64_t>(rows) * static_cast<uint64_t>(nvec) <= 0xFFFFFFFFull) {
      d.mode = 1;  // then nvec <= 2^31
      uint32_t s = 0;
      while (s < 32 && (uint64_t(1) << s) < static_cast<uint64_t>(nvec)) ++s;
      const uint64_t magic = ((uint64_t(1) << 32) * ((uint64_t(1) << s) - static_cast<uint64_t>(nvec))) /
                                 static_cast<uint64_t>(nvec) + 1;
      d.magic = static_cast<uint32_t>(magic);  // < 2^32 since 2^(s-1) < nvec <= 2^s
      d.shift = s;
    } else {
      d.mode = 2;
    }
    return d;
  }

  __host__ __device__ __forceinline__ void split(int64_t idx, int64_t& row, int64_t& col) const {
    if (mode == 0) {
      row = 0;
      col = idx;
    } else if (mode == 1) {
      const uint32_t n = static_cast<uint32_t>(idx);
#ifdef __CUDA_ARCH__
      const uint32_t t = __umulhi(n, magic);
#else
      const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
      const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(t) + n) >> shift);
      row = q;
      col = static_cast<int64_t>(n - q * static_cast<uint32_t>(nvec));
    } else {
      row = idx / nvec;
      col = idx - row * nvec;
    }
  }
};

// Elements of vector `col` of a row that exist: kVec, fewer for the last (partial) vector of a row.
template <int kVec>
__host__ __device__ __forceinline__ int valid(int64_t col, int64_t cols) {
  const int64_t rest = cols - col * kVec;
  return rest >= kVec ? kVec : static_cast<int>(rest);
}

}  // namespace device
}  // namespace geglu
#endif  // __CUDACC__
