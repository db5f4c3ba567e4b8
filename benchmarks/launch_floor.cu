// The host's floor for one kernel launch, without Python: µs per cudaLaunchKernel of an empty kernel and of one with
// the GeGLU entry point's argument list, back to back on one stream; and per kernel node replayed from a CUDA graph.
// Built and run by benchmarks/launch_overhead.py when nvcc is on the PATH (nvcc -O2 -o launch_floor launch_floor.cu).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

__global__ void empty_kernel() {}
__global__ void twelve_args(void* out, long long so, const void* g, long long sg, const void* u, long long su,
                            long long rows, long long cols, int tanh_, int dtype) {}

#define CHECK(x)                                                              \
  do {                                                                        \
    cudaError_t e = (x);                                                      \
    if (e != cudaSuccess) {                                                   \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));              \
      return 1;                                                               \
    }                                                                         \
  } while (0)

template <class F>
static double us_per_call(F f, cudaStream_t s, int n) {
  for (int i = 0; i < 200; ++i) f();
  cudaStreamSynchronize(s);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  cudaStreamSynchronize(s);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

int main() {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int n = 20000;
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 1 << 20));
  double e = us_per_call([&] { empty_kernel<<<1, 32, 0, s>>>(); }, s, n);
  double a = us_per_call([&] { twelve_args<<<14, 128, 0, s>>>(p, 1, p, 1, p, 1, 1, 14336, 1, 2); }, s, n);
  CHECK(cudaGetLastError());
  // The same launches captured in a graph of 100 nodes and replayed: what a call costs once the host is out of it.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 100; ++i) twelve_args<<<14, 128, 0, s>>>(p, 1, p, 1, p, 1, 1, 14336, 1, 2);
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  double gr = us_per_call([&] { cudaGraphLaunch(exec, s); }, s, n / 100) / 100;
  std::printf("C launch, empty kernel                   %8.2f us/call\n", e);
  std::printf("C launch, 10-argument kernel             %8.2f us/call\n", a);
  std::printf("C graph replay, per kernel node          %8.2f us/call\n", gr);
  return 0;
}
