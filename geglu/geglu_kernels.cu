// GeGLU forward/backward kernels for 2-D [rows, cols] views with arbitrary row strides (docs/cuda.md).
//
// Work decomposition: the rows are cut into "vectors" of kVec elements (16 bytes: 8 fp16/bf16, 4 fp32); a row
// has nvec = ceil(cols / kVec) vectors, the last one partial when kVec does not divide cols (its elements go
// through scalar loads/stores). The rows * nvec vectors are numbered row-major and dealt out to the grid:
// block b owns the kUnroll * blockDim.x consecutive vectors starting at b * kUnroll * blockDim.x, thread t
// takes vectors t, t + blockDim.x, ... (coalesced: a warp reads 512 contiguous bytes per tensor). A thread
// issues all of its kUnroll loads per tensor before it computes, so 2 * kUnroll (forward) or 3 * kUnroll
// (backward) independent 16-byte loads are in flight per thread. Rows of any length fill the grid evenly
// (no partial row tiles), and a single row (decode) spreads over many blocks.
//
// When every row of every tensor starts 16-byte aligned (aligned base pointers, row strides multiple of kVec)
// the kernel uses 16-byte vectors; otherwise kVec = 1 (scalar path, still coalesced). Contiguous tensors are
// flattened to one row by the launcher first, so odd cols only fall back to the scalar path when rows are
// also strided at an odd pitch.
#include "geglu_kernels.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace geglu {
namespace {

constexpr int kMaxThreads = 256;
using device::RowDivider;
using device::valid;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// 16-byte (or scalar) load of `n` elements (n == N: one vector access; 0 < n < N: scalars; rest zero).
template <typename T, int N>
__device__ __forceinline__ void load(Vec<T, N>& dst, const T* p, int n) {
  if (n == N) {
    dst = *reinterpret_cast<const Vec<T, N>*>(p);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst.v[k] = k < n ? p[k] : T(0.0f);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& src, int n) {
  if (n == N) {
    *reinterpret_cast<Vec<T, N>*>(p) = src;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < n) p[k] = src.v[k];
  }
}

// round(x) to T and back: float(T(x)); plus pairwise packing for 16-bit types (one cvt per two elements).
template <typename T, int N>
__device__ __forceinline__ void round_pairs(const float (&x)[N], Vec<T, N>& packed, float (&rounded)[N]) {
  using E = device::Elem<T>;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      packed.v[k] = x[k];
      rounded[k] = x[k];
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      auto p = E::pack(x[k], x[k + 1]);
      *reinterpret_cast<typename E::Pair*>(&packed.v[k]) = p;
      const float2 f = E::unpack(p);
      rounded[k] = f.x;
      rounded[k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      packed.v[k] = E::from_float(x[k]);
      rounded[k] = E::to_float(packed.v[k]);
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&f)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) f[k] = device::Elem<T>::to_float(v.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> from_floats(const float (&f)[N]) {
  Vec<T, N> out;
  float unused[N];
  round_pairs<T, N>(f, out, unused);
  return out;
}

template <typename T>
struct FwdArgs {
  T* out;
  const T* gate;
  const T* up;
  int64_t s_out, s_gate, s_up;  // row strides (elements)
  int64_t cols;
  int64_t total;  // rows * nvec
  RowDivider div;
};

template <typename T>
struct BwdArgs {
  T* d_gate;
  T* d_up;
  const T* grad;
  const T* gate;
  const T* up;
  int64_t s_dgate, s_dup, s_grad, s_gate, s_up;
  int64_t cols;
  int64_t total;
  RowDivider div;
};

template <typename T, int kVec, int kUnroll, bool kTanh>
__global__ void __launch_bounds__(kMaxThreads) geglu_fwd_kernel(const FwdArgs<T> a) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kUnroll * blockDim.x + threadIdx.x;
  Vec<T, kVec> g[kUnroll], u[kUnroll];
  int64_t off_out[kUnroll];
  int n[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t idx = first + static_cast<int64_t>(j) * blockDim.x;
    n[j] = 0;
    if (idx < a.total) {
      int64_t row, col;
      a.div.split(idx, row, col);
      n[j] = valid<kVec>(col, a.cols);
      const int64_t c = col * kVec;
      off_out[j] = row * a.s_out + c;
      load(g[j], a.gate + (row * a.s_gate + c), n[j]);
      load(u[j], a.up + (row * a.s_up + c), n[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (n[j] > 0) {
      float x[kVec], y[kVec], h[kVec], hr[kVec], o[kVec];
      to_floats(g[j], x);
      to_floats(u[j], y);
#pragma unroll
      for (int k = 0; k < kVec; ++k) h[k] = device::gelu<kTanh>(x[k]);
      Vec<T, kVec> unused;
      round_pairs<T, kVec>(h, unused, hr);  // gelu is rounded to T before the product (eager: two kernels)
#pragma unroll
      for (int k = 0; k < kVec; ++k) o[k] = hr[k] * y[k];
      store(a.out + off_out[j], from_floats<T, kVec>(o), n[j]);
    }
  }
}

template <typename T, int kVec, int kUnroll, bool kTanh>
__global__ void __launch_bounds__(kMaxThreads) geglu_bwd_kernel(const BwdArgs<T> a) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kUnroll * blockDim.x + threadIdx.x;
  Vec<T, kVec> dy[kUnroll], g[kUnroll], u[kUnroll];
  int64_t off_dg[kUnroll], off_du[kUnroll];
  int n[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t idx = first + static_cast<int64_t>(j) * blockDim.x;
    n[j] = 0;
    if (idx < a.total) {
      int64_t row, col;
      a.div.split(idx, row, col);
      n[j] = valid<kVec>(col, a.cols);
      const int64_t c = col * kVec;
      off_dg[j] = row * a.s_dgate + c;
      off_du[j] = row * a.s_dup + c;
      load(dy[j], a.grad + (row * a.s_grad + c), n[j]);
      load(g[j], a.gate + (row * a.s_gate + c), n[j]);
      load(u[j], a.up + (row * a.s_up + c), n[j]);
    }
  }
  // All loads of this thread precede all its stores: d_gate/d_up may alias gate/up element for element.
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (n[j] > 0) {
      float fdy[kVec], x[kVec], y[kVec], g1[kVec], g1r[kVec], h[kVec], hr[kVec], dup[kVec], dg[kVec];
      to_floats(dy[j], fdy);
      to_floats(g[j], x);
      to_floats(u[j], y);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g1[k] = fdy[k] * y[k];  // mul backward: grad of gelu(gate) = T(dy * up)
      Vec<T, kVec> unused;
      round_pairs<T, kVec>(g1, unused, g1r);
#pragma unroll
      for (int k = 0; k < kVec; ++k) dg[k] = device::gelu_and_backward<kTanh>(x[k], g1r[k], h[k]);
      round_pairs<T, kVec>(h, unused, hr);  // eager saved T(gelu(gate)) for the product
#pragma unroll
      for (int k = 0; k < kVec; ++k) dup[k] = fdy[k] * hr[k];  // grad of up = T(dy * T(h))
      store(a.d_gate + off_dg[j], from_floats<T, kVec>(dg), n[j]);
      store(a.d_up + off_du[j], from_floats<T, kVec>(dup), n[j]);
    }
  }
}

// ---- launch configuration -------------------------------------------------------------------------------

int sm_count() {
  static std::atomic<int> cache[64];  // per device; 0 = not yet queried
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

struct Launch {
  int threads;
  int unroll;
  int64_t blocks;
};

// GEGLU_CUDA_PLAN=<threads>,<unroll> (threads 32..256, a multiple of 32; unroll 1, 2 or 4) forces one plan:
// for tuning on a new GPU (kerneltools/cuda_bench.py), read once per process.
struct ForcedPlan {
  int threads = 0, unroll = 0;
  ForcedPlan() {
    const char* p = std::getenv("GEGLU_CUDA_PLAN");
    if (!p) return;
    int t = 0, u = 0;
    while (*p >= '0' && *p <= '9' && t < 100000) t = 10 * t + (*p++ - '0');
    if (*p++ != ',') return;
    while (*p >= '0' && *p <= '9' && u < 100000) u = 10 * u + (*p++ - '0');
    if (*p == 0 && t >= 32 && t <= kMaxThreads && t % 32 == 0 && (u == 1 || u == 2 || u == 4)) {
      threads = t;
      unroll = u;
    }
  }
};

// Large problems: 256 threads x 4 vectors per thread (8 or 12 loads of 16 B in flight per thread). Smaller
// ones trade vectors per thread, then threads per block, for blocks, so that at least ~2 blocks per SM (or,
// for decode-sized rows, as many blocks as possible) share the work.
Launch plan(int64_t total) {
  auto blocks = [&](int threads, int unroll) { return (total + int64_t(threads) * unroll - 1) / (int64_t(threads) * unroll); };
  static const ForcedPlan forced;
  if (forced.threads) return {forced.threads, forced.unroll, blocks(forced.threads, forced.unroll)};
  const int64_t sms = sm_count();
  if (blocks(kMaxThreads, 4) >= 2 * sms) return {kMaxThreads, 4, blocks(kMaxThreads, 4)};
  if (blocks(kMaxThreads, 2) >= 2 * sms) return {kMaxThreads, 2, blocks(kMaxThreads, 2)};
  int threads = kMaxThreads;
  while (threads > 64 && blocks(threads, 1) < 2 * sms) threads /= 2;
  return {threads, 1, blocks(threads, 1)};
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Rows that follow each other without a gap in every tensor form one long row (better vector alignment,
// no per-row tails). Returns the effective (rows, cols) and row strides.
template <int kN>
void flatten(int64_t& rows, int64_t& cols, int64_t (&strides)[kN]) {
  if (rows <= 1) {
    for (auto& s : strides) s = cols;
    return;
  }
  for (auto s : strides)
    if (s != cols) return;
  cols *= rows;
  rows = 1;
  for (auto& s : strides) s = cols;
}

template <typename T, int kN>
bool use_vectors(void* const (&ptrs)[kN], const int64_t (&strides)[kN], int64_t rows) {
  constexpr int64_t kVec = 16 / sizeof(T);
  for (int i = 0; i < kN; ++i) {
    if (!aligned16(ptrs[i])) return false;
    if (rows > 1 && strides[i] % kVec != 0) return false;
  }
  return true;
}

template <typename T, int kVec, bool kTanh>
cudaError_t launch_fwd(FwdArgs<T> a, int64_t rows, cudaStream_t stream) {
  const int64_t nvec = (a.cols + kVec - 1) / kVec;
  a.total = rows * nvec;
  a.div = RowDivider::make(rows, nvec);
  const Launch l = plan(a.total);
  if (l.blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(l.blocks)), block(l.threads);
  switch (l.unroll) {
    case 4: geglu_fwd_kernel<T, kVec, 4, kTanh><<<grid, block, 0, stream>>>(a); break;
    case 2: geglu_fwd_kernel<T, kVec, 2, kTanh><<<grid, block, 0, stream>>>(a); break;
    default: geglu_fwd_kernel<T, kVec, 1, kTanh><<<grid, block, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename T, int kVec, bool kTanh>
cudaError_t launch_bwd(BwdArgs<T> a, int64_t rows, cudaStream_t stream) {
  const int64_t nvec = (a.cols + kVec - 1) / kVec;
  a.total = rows * nvec;
  a.div = RowDivider::make(rows, nvec);
  const Launch l = plan(a.total);
  if (l.blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(l.blocks)), block(l.threads);
  switch (l.unroll) {
    case 4: geglu_bwd_kernel<T, kVec, 4, kTanh><<<grid, block, 0, stream>>>(a); break;
    case 2: geglu_bwd_kernel<T, kVec, 2, kTanh><<<grid, block, 0, stream>>>(a); break;
    default: geglu_bwd_kernel<T, kVec, 1, kTanh><<<grid, block, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t fwd_typed(View2D out, View2D gate, View2D up, int64_t rows, int64_t cols, bool tanh,
                      cudaStream_t stream) {
  int64_t strides[3] = {out.row_stride, gate.row_stride, up.row_stride};
  flatten(rows, cols, strides);
  FwdArgs<T> a{};
  a.out = static_cast<T*>(out.data);
  a.gate = static_cast<const T*>(gate.data);
  a.up = static_cast<const T*>(up.data);
  a.s_out = strides[0];
  a.s_gate = strides[1];
  a.s_up = strides[2];
  a.cols = cols;
  void* const ptrs[3] = {out.data, gate.data, up.data};
  constexpr int kVec = 16 / sizeof(T);
  if (use_vectors<T>(ptrs, strides, rows)) {
    return tanh ? launch_fwd<T, kVec, true>(a, rows, stream) : launch_fwd<T, kVec, false>(a, rows, stream);
  }
  return tanh ? launch_fwd<T, 1, true>(a, rows, stream) : launch_fwd<T, 1, false>(a, rows, stream);
}

template <typename T>
cudaError_t bwd_typed(View2D d_gate, View2D d_up, View2D grad, View2D gate, View2D up, int64_t rows,
                      int64_t cols, bool tanh, cudaStream_t stream) {
  int64_t strides[5] = {d_gate.row_stride, d_up.row_stride, grad.row_stride, gate.row_stride, up.row_stride};
  flatten(rows, cols, strides);
  BwdArgs<T> a{};
  a.d_gate = static_cast<T*>(d_gate.data);
  a.d_up = static_cast<T*>(d_up.data);
  a.grad = static_cast<const T*>(grad.data);
  a.gate = static_cast<const T*>(gate.data);
  a.up = static_cast<const T*>(up.data);
  a.s_dgate = strides[0];
  a.s_dup = strides[1];
  a.s_grad = strides[2];
  a.s_gate = strides[3];
  a.s_up = strides[4];
  a.cols = cols;
  void* const ptrs[5] = {d_gate.data, d_up.data, grad.data, gate.data, up.data};
  constexpr int kVec = 16 / sizeof(T);
  if (use_vectors<T>(ptrs, strides, rows)) {
    return tanh ? launch_bwd<T, kVec, true>(a, rows, stream) : launch_bwd<T, kVec, false>(a, rows, stream);
  }
  return tanh ? launch_bwd<T, 1, true>(a, rows, stream) : launch_bwd<T, 1, false>(a, rows, stream);
}

}  // namespace

Status geglu_fwd(DType dtype, View2D out, View2D gate, View2D up, int64_t rows, int64_t cols, bool tanh,
                 void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return fwd_typed<float>(out, gate, up, rows, cols, tanh, s);
    case DType::kFloat16: return fwd_typed<__half>(out, gate, up, rows, cols, tanh, s);
    case DType::kBFloat16: return fwd_typed<__nv_bfloat16>(out, gate, up, rows, cols, tanh, s);
  }
  return cudaErrorInvalidValue;
}

Status geglu_bwd(DType dtype, View2D d_gate, View2D d_up, View2D grad, View2D gate, View2D up, int64_t rows,
                 int64_t cols, bool tanh, void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return bwd_typed<float>(d_gate, d_up, grad, gate, up, rows, cols, tanh, s);
    case DType::kFloat16: return bwd_typed<__half>(d_gate, d_up, grad, gate, up, rows, cols, tanh, s);
    case DType::kBFloat16: return bwd_typed<__nv_bfloat16>(d_gate, d_up, grad, gate, up, rows, cols, tanh, s);
  }
  return cudaErrorInvalidValue;
}

const char* status_string(Status status) { return cudaGetErrorString(static_cast<cudaError_t>(status)); }

}  // namespace geglu
