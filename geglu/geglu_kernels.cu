// GeGLU forward/backward kernels for 2-D [rows, cols] views with arbitrary row strides (docs/cuda.md).
//
// Work decomposition: the rows are cut into "vectors" of kVec elements (16 bytes: 8 fp16/bf16, 4 fp32); a row
// has nvec = ceil(cols / kVec) vectors, the last one partial when kVec does not divide cols (its elements are
// moved by scalar accesses, or by a zero-filling partial cp.async). The rows * nvec vectors are numbered
// row-major (a 32-bit magic division per vector recovers row and column) and cut into tiles of blockDim.x
// (x kUnroll) consecutive vectors; thread t takes vectors t, t + blockDim.x, ... of a tile, so a warp moves
// 512 contiguous bytes per tensor. Rows of any length fill the grid evenly (no partial row tiles), and a
// single row (decode) spreads over many blocks.
//
// Two ways to run the tiles (choose_plan):
// * one tile per block (small and medium problems): a thread issues all of its 16-byte loads (2 or 3 tensors
//   x kUnroll), then computes and stores;
// * pipelined (large problems): a grid sized to the GPU walks the tiles, and each thread keeps the next
//   kStages - 1 tiles' loads in flight with cp.async into its own shared-memory slots while it computes the
//   current tile: the GELU math (~35-60 instructions per element) no longer leaves the memory system idle,
//   and in-flight bytes cost shared memory instead of registers.
//
// When every row of every tensor starts 16-byte aligned (aligned base pointers, row strides multiple of kVec)
// the kernels use 16-byte vectors; otherwise kVec = 1 (scalar path, one tile per block, still coalesced).
// Contiguous tensors are flattened to one row by the launcher first, so odd cols only fall back to the scalar
// path when rows are also strided at an odd pitch.
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

// ---- the two ops: per-vector math --------------------------------------------------------------------------

// Forward: in = {gate, up}, out = {out}.
template <typename T, int kVec, bool kTanh>
struct FwdOp {
  static constexpr int kIn = 2, kOut = 1;
  static __device__ __forceinline__ void compute(const Vec<T, kVec> (&in)[kIn], Vec<T, kVec> (&out)[kOut]) {
    float x[kVec], y[kVec], h[kVec], hr[kVec], o[kVec];
    to_floats(in[0], x);
    to_floats(in[1], y);
#pragma unroll
    for (int k = 0; k < kVec; ++k) h[k] = device::gelu<kTanh>(x[k]);
    Vec<T, kVec> unused;
    round_pairs<T, kVec>(h, unused, hr);  // gelu is rounded to T before the product (eager: two kernels)
#pragma unroll
    for (int k = 0; k < kVec; ++k) o[k] = hr[k] * y[k];
    out[0] = from_floats<T, kVec>(o);
  }
};

// Backward: in = {grad, gate, up}, out = {d_gate, d_up}.
template <typename T, int kVec, bool kTanh>
struct BwdOp {
  static constexpr int kIn = 3, kOut = 2;
  static __device__ __forceinline__ void compute(const Vec<T, kVec> (&in)[kIn], Vec<T, kVec> (&out)[kOut]) {
    float dy[kVec], x[kVec], y[kVec], g1[kVec], g1r[kVec], h[kVec], hr[kVec], du[kVec], dg[kVec];
    to_floats(in[0], dy);
    to_floats(in[1], x);
    to_floats(in[2], y);
#pragma unroll
    for (int k = 0; k < kVec; ++k) g1[k] = dy[k] * y[k];  // mul's backward: grad of gelu(gate) = T(dy * up)
    Vec<T, kVec> unused;
    round_pairs<T, kVec>(g1, unused, g1r);
#pragma unroll
    for (int k = 0; k < kVec; ++k) dg[k] = device::gelu_and_backward<kTanh>(x[k], g1r[k], h[k]);
    round_pairs<T, kVec>(h, unused, hr);  // eager saved T(gelu(gate)) for the product
#pragma unroll
    for (int k = 0; k < kVec; ++k) du[k] = dy[k] * hr[k];  // grad of up = T(dy * T(h))
    out[0] = from_floats<T, kVec>(dg);
    out[1] = from_floats<T, kVec>(du);
  }
};

// ---- one tile per block: load all, then compute and store --------------------------------------------------

template <typename T, int kIn, int kOut>
struct Args {
  const T* in[kIn];
  T* out[kOut];
  int64_t s_in[kIn], s_out[kOut];  // row strides (elements)
  int64_t cols;
  int64_t total;   // rows * nvec
  int64_t ntiles;  // ceil(total / (kUnroll * blockDim.x)); the pipelined kernels' loop bound
  RowDivider div;
};

// One thread's share of a tile: kUnroll vectors of each input, and where its outputs go.
template <class Op, typename T, int kVec, int kUnroll>
struct Frag {
  Vec<T, kVec> v[kUnroll][Op::kIn];
  int64_t off[kUnroll][Op::kOut];
  int n[kUnroll];  // elements of each vector that exist (0: none)
};

// Issue every load of this thread's part of tile `tile` (coalesced: vector t, t + blockDim.x, ...).
template <class Op, typename T, int kVec, int kUnroll>
__device__ __forceinline__ void load_tile(const Args<T, Op::kIn, Op::kOut>& a, int64_t tile,
                                          Frag<Op, T, kVec, kUnroll>& f) {
  const int64_t first = tile * kUnroll * blockDim.x + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t idx = first + static_cast<int64_t>(j) * blockDim.x;
    f.n[j] = 0;
    if (idx < a.total) {
      int64_t row, col;
      a.div.split(idx, row, col);
      f.n[j] = valid<kVec>(col, a.cols);
      const int64_t c = col * kVec;
#pragma unroll
      for (int o = 0; o < Op::kOut; ++o) f.off[j][o] = row * a.s_out[o] + c;
#pragma unroll
      for (int i = 0; i < Op::kIn; ++i) load(f.v[j][i], a.in[i] + (row * a.s_in[i] + c), f.n[j]);
    }
  }
}

template <class Op, typename T, int kVec, int kUnroll>
__device__ __forceinline__ void finish_tile(const Args<T, Op::kIn, Op::kOut>& a, const Frag<Op, T, kVec, kUnroll>& f) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (f.n[j] > 0) {
      Vec<T, kVec> out[Op::kOut];
      Op::compute(f.v[j], out);
#pragma unroll
      for (int o = 0; o < Op::kOut; ++o) store(a.out[o] + f.off[j][o], out[o], f.n[j]);
    }
  }
}

// One tile per block (grid = ntiles): a thread issues all its loads, then computes and stores. Every element
// is loaded and stored by the same thread, its load first, so an output may be exactly an input (in place).
template <class Op, typename T, int kVec, int kUnroll>
__device__ __forceinline__ void run_tile(const Args<T, Op::kIn, Op::kOut>& a) {
  Frag<Op, T, kVec, kUnroll> f;
  load_tile<Op>(a, blockIdx.x, f);
  finish_tile<Op>(a, f);
}

// ---- pipelined: cp.async (LDGSTS) into shared memory, kStages deep ------------------------------------------
//
// A grid sized to the GPU walks the tiles (tile += gridDim.x; a tile = one 16-byte vector per tensor per
// thread). Each thread copies its own vectors of the next kStages - 1 tiles into its own shared-memory slots
// with cp.async while it computes the current one, so the loads stay in flight during the ~35-60 instructions
// per element of GELU math and cost no registers. A thread reads back only the slots it filled itself, so no
// block barrier is needed (cp.async.wait_group orders them for the thread). Tiles are disjoint and each element
// is still loaded (copied) before the same thread stores it, so the in-place rule holds.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  // .cg: 16-byte copy bypassing L1. Only whole vectors: the src-size (zero-filling) form for a row's partial
  // last vector was reported by compute-sanitizer memcheck as a 16-byte read past the end of the tensor.
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

template <class Op, typename T, int kVec, int kStages>
__device__ __forceinline__ void run_pipelined(const Args<T, Op::kIn, Op::kOut>& a) {
  extern __shared__ uint4 smem[];  // [kStages][Op::kIn][blockDim.x] 16-byte slots
  const int threads = blockDim.x;
  auto slot = [&](int stage, int i) { return smem + (stage * Op::kIn + i) * threads + threadIdx.x; };
  auto issue = [&](int64_t tile, int stage) {
    if (tile < a.ntiles) {
      const int64_t idx = tile * threads + threadIdx.x;
      if (idx < a.total) {
        int64_t row, col;
        a.div.split(idx, row, col);
        const int n = valid<kVec>(col, a.cols);
        const int64_t c = col * kVec;
#pragma unroll
        for (int i = 0; i < Op::kIn; ++i) {
          const T* src = a.in[i] + (row * a.s_in[i] + c);
          if (n == kVec) {
            cp_async16(slot(stage, i), src);
          } else {  // partial last vector of a row: element loads, zero-filled (read back by this thread only)
            T* dst = reinterpret_cast<T*>(slot(stage, i));
#pragma unroll
            for (int k = 0; k < kVec; ++k) dst[k] = k < n ? src[k] : T(0.0f);
          }
        }
      }
    }
    cp_async_commit();  // one group per tile, empty or not, so that wait_group counts tiles
  };
  const int64_t step = gridDim.x;
  int64_t next = blockIdx.x;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s, next += step) issue(next, s);
  int stage = 0;
  for (int64_t tile = blockIdx.x; tile < a.ntiles; tile += step) {
    issue(next, (stage + kStages - 1) % kStages);  // the slot consumed one iteration ago
    next += step;
    cp_async_wait<kStages - 1>();  // this thread's copies of `tile` have landed
    const int64_t idx = tile * threads + threadIdx.x;
    if (idx < a.total) {
      int64_t row, col;
      a.div.split(idx, row, col);
      const int n = valid<kVec>(col, a.cols);
      const int64_t c = col * kVec;
      Vec<T, kVec> in[Op::kIn], out[Op::kOut];
#pragma unroll
      for (int i = 0; i < Op::kIn; ++i) in[i] = *reinterpret_cast<const Vec<T, kVec>*>(slot(stage, i));
      Op::compute(in, out);
#pragma unroll
      for (int o = 0; o < Op::kOut; ++o) store(a.out[o] + (row * a.s_out[o] + c), out[o], n);
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();  // no copy may still be landing when the block exits
}

// Register caps (blocks of 256 threads that must fit on an SM): left alone, nvcc interleaves the GELU chains
// of all of a thread's elements and takes up to ~166 registers (one block per SM). ptxas -v: no spills.
template <int kUnroll, int kStages>
constexpr int kMinBlocks = kStages > 0 ? 4 : kUnroll == 1 ? 4 : kUnroll == 2 ? 3 : 2;

// kStages == 0: one tile per block with kUnroll vectors per tensor per thread; kStages > 0: pipelined.
template <typename T, int kVec, int kUnroll, bool kTanh, int kStages>
__global__ void __launch_bounds__(kMaxThreads, (kMinBlocks<kUnroll, kStages>)) geglu_fwd_kernel(const Args<T, 2, 1> a) {
  if constexpr (kStages > 0) {
    run_pipelined<FwdOp<T, kVec, kTanh>, T, kVec, kStages>(a);
  } else {
    run_tile<FwdOp<T, kVec, kTanh>, T, kVec, kUnroll>(a);
  }
}

template <typename T, int kVec, int kUnroll, bool kTanh, int kStages>
__global__ void __launch_bounds__(kMaxThreads, (kMinBlocks<kUnroll, kStages>)) geglu_bwd_kernel(const Args<T, 3, 2> a) {
  if constexpr (kStages > 0) {
    run_pipelined<BwdOp<T, kVec, kTanh>, T, kVec, kStages>(a);
  } else {
    run_tile<BwdOp<T, kVec, kTanh>, T, kVec, kUnroll>(a);
  }
}

// ---- launch configuration -------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;

int sm_count(int dev) {
  static std::atomic<int> cache[kMaxDevices];  // 0 = not yet queried
  int n = dev < kMaxDevices ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    if (dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Per-kernel launch facts, cached per device: resident blocks per SM at a block size (the pipelined kernels'
// dynamic shared memory is fixed by the block size), and the shared-memory carveout preference, set once.
template <auto kKernel>
struct KernelInfo {
  static int blocks_per_sm(int threads, size_t smem, int dev) {
    static std::atomic<int> cache[kMaxDevices][kMaxThreads / 32 + 1];
    std::atomic<int>* slot = dev < kMaxDevices ? &cache[dev][threads / 32] : nullptr;
    int n = slot ? slot->load(std::memory_order_relaxed) : 0;
    if (n == 0) {
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, smem) != cudaSuccess || n <= 0) n = 1;
      if (slot) slot->store(n, std::memory_order_relaxed);
    }
    return n;
  }
  // The pipelined kernels want shared memory, not L1 (their loads bypass L1): ask for the largest carveout so
  // that as many blocks are resident as the occupancy calculation assumed. A hint; failures are ignored.
  static void prefer_shared(int dev) {
    static std::atomic<bool> done[kMaxDevices];
    if (dev < kMaxDevices && done[dev].load(std::memory_order_relaxed)) return;
    cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    cudaGetLastError();
    if (dev < kMaxDevices) done[dev].store(true, std::memory_order_relaxed);
  }
};

constexpr int kDefaultStages = 4;

struct Plan {
  int threads = 0;
  int unroll = 1;  // one tile per block: vectors per tensor per thread (1, 2, 4)
  int stages = 0;  // > 0: the cp.async pipeline with this many stages (2 or 4), vector path only
};

// A forced plan, for tuning on a new GPU (kerneltools/cuda_bench.py --plans) and for tests, set through the C entry
// point geglu_c_set_plan (the package's `geglu.configure(cuda_plan=...)`, which reads GEGLU_CUDA_PLAN once at import):
// threads 32..256, a multiple of 32; either one tile per block with unroll 1, 2 or 4 vectors per tensor per thread
// (the vector path takes 4 as 2), or the cp.async pipeline with stages 2 or 4 (unroll 1; the scalar path then uses
// one tile per block). Packed in one word so that a launch reads a consistent plan: threads | unroll << 16 |
// stages << 24; 0 = the built-in choice.
std::atomic<uint32_t> g_forced_plan{0};

bool valid_plan(int threads, int unroll, int stages) {
  if (threads < 32 || threads > kMaxThreads || threads % 32 != 0) return false;
  if (stages != 0) return (stages == 2 || stages == 4) && unroll == 1;
  return unroll == 1 || unroll == 2 || unroll == 4;
}

Plan forced_plan() {
  Plan plan;
  const uint32_t packed = g_forced_plan.load(std::memory_order_relaxed);
  if (packed == 0) return plan;
  plan.threads = static_cast<int>(packed & 0xFFFF);
  plan.unroll = static_cast<int>((packed >> 16) & 0xFF);
  plan.stages = static_cast<int>(packed >> 24);
  return plan;
}

// Vector path, >= 4 tiles of 256 vectors per SM: the cp.async pipeline (256 threads, 4 stages, as many blocks
// as fit on the GPU). Otherwise one tile per block: 2 vectors per tensor per thread (4 elements on the scalar
// path) while that still gives >= 2 blocks per SM; small (decode-sized) problems use 1 per thread and smaller
// blocks, so that the work spreads over as many SMs as it can.
Plan choose_plan(int64_t total, int sms, bool vector_path) {
  Plan forced = forced_plan();
  if (forced.threads) {
    if (forced.stages && !vector_path) forced.stages = 0;
    return forced;
  }
  auto tiles = [&](int threads, int unroll) { return (total + int64_t(threads) * unroll - 1) / (int64_t(threads) * unroll); };
  if (vector_path && tiles(kMaxThreads, 1) >= 4 * int64_t(sms)) return {kMaxThreads, 1, kDefaultStages};
  if (!vector_path && tiles(kMaxThreads, 4) >= 2 * int64_t(sms)) return {kMaxThreads, 4, 0};
  if (tiles(kMaxThreads, 2) >= 2 * int64_t(sms)) return {kMaxThreads, 2, 0};
  int threads = kMaxThreads;
  while (threads > 64 && tiles(threads, 1) < 2 * int64_t(sms)) threads /= 2;
  return {threads, 1, 0};
}

template <template <typename, int, int, bool, int> class K, typename T, int kVec, bool kTanh, class A>
cudaError_t launch(A a, int64_t rows, cudaStream_t stream) {
  const int64_t nvec = (a.cols + kVec - 1) / kVec;
  a.total = rows * nvec;
  a.div = RowDivider::make(rows, nvec);
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const int sms = sm_count(dev);
  Plan plan = choose_plan(a.total, sms, kVec > 1);
  // The vector path has kernels for 1 or 2 vectors per thread: a forced unroll of 4 runs as 2, and the grid
  // must be sized for what runs.
  if (kVec > 1 && plan.unroll > 2) plan.unroll = 2;
  a.ntiles = (a.total + int64_t(plan.threads) * plan.unroll - 1) / (int64_t(plan.threads) * plan.unroll);
  auto go = [&](auto which, int stages) {
    constexpr auto kernel = decltype(which)::kernel;
    int64_t blocks = a.ntiles;
    size_t smem = 0;
    if (stages > 0) {
      constexpr int kIn = sizeof(a.in) / sizeof(a.in[0]);
      smem = size_t(stages) * kIn * plan.threads * 16;  // <= 4 * 3 * 256 * 16 = 48 KiB: no opt-in needed
      KernelInfo<kernel>::prefer_shared(dev);
      blocks = std::min<int64_t>(blocks, int64_t(sms) * KernelInfo<kernel>::blocks_per_sm(plan.threads, smem, dev));
    }
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    kernel<<<dim3(static_cast<unsigned>(blocks)), dim3(plan.threads), smem, stream>>>(a);
    return cudaGetLastError();
  };
  if constexpr (kVec > 1) {  // 16-byte vectors: the pipeline, or one tile per block with 1 or 2 vectors
    if (plan.stages == 2) return go(K<T, kVec, 1, kTanh, 2>{}, 2);
    if (plan.stages == 4) return go(K<T, kVec, 1, kTanh, 4>{}, 4);
    if (plan.unroll >= 2) return go(K<T, kVec, 2, kTanh, 0>{}, 0);
    return go(K<T, kVec, 1, kTanh, 0>{}, 0);
  } else {  // scalar path: one tile per block with 1, 2 or 4 elements per tensor per thread
    switch (plan.unroll) {
      case 4: return go(K<T, kVec, 4, kTanh, 0>{}, 0);
      case 2: return go(K<T, kVec, 2, kTanh, 0>{}, 0);
      default: return go(K<T, kVec, 1, kTanh, 0>{}, 0);
    }
  }
}

template <typename T, int kVec, int kUnroll, bool kTanh, int kStages>
struct FwdKernel {
  static constexpr auto kernel = geglu_fwd_kernel<T, kVec, kUnroll, kTanh, kStages>;
};
template <typename T, int kVec, int kUnroll, bool kTanh, int kStages>
struct BwdKernel {
  static constexpr auto kernel = geglu_bwd_kernel<T, kVec, kUnroll, kTanh, kStages>;
};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Rows that follow each other without a gap in every tensor form one long row (better vector alignment,
// no per-row tails). Updates (rows, cols) and the row strides.
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

// 16-byte vectors need every row of every tensor to start 16-byte aligned.
template <typename T, int kN>
bool use_vectors(const void* const (&ptrs)[kN], const int64_t (&strides)[kN], int64_t rows) {
  constexpr int64_t kVec = 16 / sizeof(T);
  for (int i = 0; i < kN; ++i) {
    if (!aligned16(ptrs[i])) return false;
    if (rows > 1 && strides[i] % kVec != 0) return false;
  }
  return true;
}

// outs/ins: the 2-D views; fills Args (strides after flattening) and launches the vector or scalar kernels.
template <template <typename, int, int, bool, int> class K, typename T, int kIn, int kOut>
cudaError_t dispatch(const View2D (&outs)[kOut], const View2D (&ins)[kIn], int64_t rows, int64_t cols, bool tanh,
                     cudaStream_t stream) {
  int64_t strides[kOut + kIn];
  const void* ptrs[kOut + kIn];
  for (int o = 0; o < kOut; ++o) strides[o] = outs[o].row_stride, ptrs[o] = outs[o].data;
  for (int i = 0; i < kIn; ++i) strides[kOut + i] = ins[i].row_stride, ptrs[kOut + i] = ins[i].data;
  flatten(rows, cols, strides);
  Args<T, kIn, kOut> a{};
  for (int o = 0; o < kOut; ++o) a.out[o] = static_cast<T*>(outs[o].data), a.s_out[o] = strides[o];
  for (int i = 0; i < kIn; ++i) a.in[i] = static_cast<const T*>(ins[i].data), a.s_in[i] = strides[kOut + i];
  a.cols = cols;
  constexpr int kVec = 16 / sizeof(T);
  if (use_vectors<T>(ptrs, strides, rows)) {
    return tanh ? launch<K, T, kVec, true>(a, rows, stream) : launch<K, T, kVec, false>(a, rows, stream);
  }
  return tanh ? launch<K, T, 1, true>(a, rows, stream) : launch<K, T, 1, false>(a, rows, stream);
}

}  // namespace

Status geglu_fwd(DType dtype, View2D out, View2D gate, View2D up, int64_t rows, int64_t cols, bool tanh,
                 void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const View2D outs[1] = {out}, ins[2] = {gate, up};
  switch (dtype) {
    case DType::kFloat32: return dispatch<FwdKernel, float>(outs, ins, rows, cols, tanh, s);
    case DType::kFloat16: return dispatch<FwdKernel, __half>(outs, ins, rows, cols, tanh, s);
    case DType::kBFloat16: return dispatch<FwdKernel, __nv_bfloat16>(outs, ins, rows, cols, tanh, s);
  }
  return cudaErrorInvalidValue;
}

Status geglu_bwd(DType dtype, View2D d_gate, View2D d_up, View2D grad, View2D gate, View2D up, int64_t rows,
                 int64_t cols, bool tanh, void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const View2D outs[2] = {d_gate, d_up}, ins[3] = {grad, gate, up};
  switch (dtype) {
    case DType::kFloat32: return dispatch<BwdKernel, float>(outs, ins, rows, cols, tanh, s);
    case DType::kFloat16: return dispatch<BwdKernel, __half>(outs, ins, rows, cols, tanh, s);
    case DType::kBFloat16: return dispatch<BwdKernel, __nv_bfloat16>(outs, ins, rows, cols, tanh, s);
  }
  return cudaErrorInvalidValue;
}

const char* status_string(Status status) { return cudaGetErrorString(static_cast<cudaError_t>(status)); }

Status set_launch_plan(int threads, int unroll, int stages) {
  if (threads == 0) {
    g_forced_plan.store(0, std::memory_order_relaxed);
    return cudaSuccess;
  }
  if (!valid_plan(threads, unroll, stages)) return cudaErrorInvalidValue;
  g_forced_plan.store(static_cast<uint32_t>(threads) | static_cast<uint32_t>(unroll) << 16 |
                          static_cast<uint32_t>(stages) << 24,
                      std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace geglu

// ---- plain C entry points ---------------------------------------------------------------------------------------
// The package's eager fast path (torch-ext/geglu/_direct.py) calls these through ctypes: the same launches as the
// ops, without the dispatcher's boxed call, which at decode sizes costs more than the kernel (docs/cuda.md). The
// caller passes tensors it has validated as the ops do (dtype, shapes, unit last-dim stride, no partial overlap).
// `dtype` is geglu::DType; strides are row strides in elements; the launch goes to `device` on `stream`.
namespace {

template <typename F>
int on_device(int device, F&& launch) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return err;
  if (current != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
  const int status = launch();
  if (current != device) cudaSetDevice(current);
  return status;
}

bool valid_dtype(int dtype) { return dtype >= 0 && dtype <= 2; }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int geglu_c_fwd(int dtype, void* out, int64_t s_out, void* gate,
                                                       int64_t s_gate, void* up, int64_t s_up, int64_t rows,
                                                       int64_t cols, int tanh, int device, void* stream) {
  if (!valid_dtype(dtype)) return cudaErrorInvalidValue;
  return on_device(device, [&] {
    return geglu::geglu_fwd(static_cast<geglu::DType>(dtype), geglu::View2D{out, s_out}, geglu::View2D{gate, s_gate},
                            geglu::View2D{up, s_up}, rows, cols, tanh != 0, stream);
  });
}

__attribute__((visibility("default"))) int geglu_c_bwd(int dtype, void* d_gate, int64_t s_dg, void* d_up,
                                                       int64_t s_du, void* grad, int64_t s_dy, void* gate,
                                                       int64_t s_gate, void* up, int64_t s_up, int64_t rows,
                                                       int64_t cols, int tanh, int device, void* stream) {
  if (!valid_dtype(dtype)) return cudaErrorInvalidValue;
  return on_device(device, [&] {
    return geglu::geglu_bwd(static_cast<geglu::DType>(dtype), geglu::View2D{d_gate, s_dg}, geglu::View2D{d_up, s_du},
                            geglu::View2D{grad, s_dy}, geglu::View2D{gate, s_gate}, geglu::View2D{up, s_up}, rows,
                            cols, tanh != 0, stream);
  });
}

// Force a launch plan for every later launch (geglu::set_launch_plan). No CUDA call.
__attribute__((visibility("default"))) int geglu_c_set_plan(int threads, int unroll, int stages) {
  return geglu::set_launch_plan(threads, unroll, stages);
}

__attribute__((visibility("default"))) const char* geglu_c_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // extern "C"
