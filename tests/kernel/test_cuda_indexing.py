"""The kernels' work decomposition, run on the CPU: the row/column split (32-bit magic division, 64-bit
fallback) and the partial last vector, from geglu_kernels.cuh's __host__ __device__ helpers, compiled with nvcc
as host code. Every element of every row must be visited exactly once for any rows, cols, vector width, block
size and unroll; the magic division must equal true division for every numerator it can see.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HARNESS = r"""
#include "geglu_kernels.cuh"
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

using geglu::device::RowDivider;
using geglu::device::valid;

static uint64_t lcg = 0x9E3779B97F4A7C15ull;
static uint64_t next() { lcg = lcg * 6364136223846793005ull + 1442695040888963407ull; return lcg >> 11; }

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { if (failures++ < 20) { std::printf(__VA_ARGS__); std::printf("\n"); } } } while (0)

static void check_division(int64_t nvec) {
  const int64_t rows = 0xFFFFFFFFll / nvec;  // the largest grid that still uses the 32-bit path
  if (rows < 2) return;
  RowDivider d = RowDivider::make(rows, nvec);
  CHECK(d.mode == 1, "nvec %lld: mode %d, expected 1", (long long)nvec, d.mode);
  RowDivider wide = d;
  wide.mode = 2;
  const int64_t total = rows * nvec;
  auto one = [&](int64_t n) {
    if (n < 0 || n >= total) return;
    int64_t r, c, r2, c2;
    d.split(n, r, c);
    wide.split(n, r2, c2);
    CHECK(r == n / nvec && c == n % nvec, "nvec %lld n %lld: got (%lld, %lld)", (long long)nvec, (long long)n,
          (long long)r, (long long)c);
    CHECK(r2 == r && c2 == c, "64-bit path differs at nvec %lld n %lld", (long long)nvec, (long long)n);
  };
  for (int64_t n = 0; n < 20000; ++n) one(n);
  for (int64_t n = total - 20000; n < total; ++n) one(n);
  for (int i = 0; i < 100000; ++i) one(static_cast<int64_t>(next() % static_cast<uint64_t>(total)));
  for (int64_t k = 1; k < 64; ++k) {  // around multiples of nvec, near the top too
    for (int64_t base : {k * nvec, total - k * nvec}) { one(base - 1); one(base); one(base + 1); }
  }
}

// grid == 0: one tile per block (grid = ntiles); grid > 0: the pipelined kernels' loop, tile += grid.
static void check_coverage(int64_t rows, int64_t cols, int vec, int threads, int unroll, bool force64,
                           int64_t grid = 0) {
  const int64_t nvec = (cols + vec - 1) / vec;
  const int64_t total = rows * nvec;
  RowDivider d = RowDivider::make(rows, nvec);
  if (force64 && d.mode == 1) d.mode = 2;
  std::vector<unsigned char> seen(static_cast<size_t>(rows * cols), 0);
  const int64_t ntiles = (total + int64_t(threads) * unroll - 1) / (int64_t(threads) * unroll);
  const int64_t blocks = grid > 0 ? std::min(grid, ntiles) : ntiles;
  const int64_t step = grid > 0 ? blocks : ntiles;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t tile = b; tile < ntiles; tile += step)
    for (int t = 0; t < threads; ++t)
      for (int j = 0; j < unroll; ++j) {  // the kernels' loop
        const int64_t idx = tile * unroll * threads + t + int64_t(j) * threads;
        if (idx >= total) continue;
        int64_t row, col;
        d.split(idx, row, col);
        int n = 0;
        switch (vec) {
          case 1: n = valid<1>(col, cols); break;
          case 4: n = valid<4>(col, cols); break;
          case 8: n = valid<8>(col, cols); break;
        }
        CHECK(row >= 0 && row < rows && col >= 0 && col < nvec && n >= 1 && n <= vec,
              "rows %lld cols %lld vec %d: idx %lld -> (%lld, %lld) n %d", (long long)rows, (long long)cols, vec,
              (long long)idx, (long long)row, (long long)col, n);
        for (int k = 0; k < n; ++k) seen[static_cast<size_t>(row * cols + col * vec + k)]++;
      }
  for (size_t i = 0; i < seen.size(); ++i)
    CHECK(seen[i] == 1, "rows %lld cols %lld vec %d threads %d unroll %d: element %zu visited %d times",
          (long long)rows, (long long)cols, vec, threads, unroll, i, seen[i]);
}

int main() {
  for (int64_t nvec : {1ll, 2ll, 3ll, 5ll, 7ll, 8ll, 127ll, 128ll, 129ll, 1000ll, 1792ll, 1793ll, 3072ll, 4096ll,
                       65535ll, 65536ll, 65537ll, 1ll << 20, (1ll << 20) + 1, 123456789ll, (1ll << 31) - 1})
    check_division(nvec);
  for (int i = 0; i < 300; ++i) check_division(1 + static_cast<int64_t>(next() % 0x7FFFFFFFull));
  const int64_t shapes[][2] = {{1, 1}, {1, 7}, {3, 7}, {5, 127}, {1, 14336}, {16, 14336}, {1000, 9}, {37, 4096},
                               {2, 8}, {3, 1}, {7, 33}, {64, 1000}};
  for (auto& s : shapes)
    for (int vec : {1, 4, 8})
      for (int threads : {64, 128, 256})
        for (int unroll : {1, 2, 4})
          for (bool force64 : {false, true}) check_coverage(s[0], s[1], vec, threads, unroll, force64);
  for (auto& s : shapes)  // pipelined: one vector per thread per tile, grids smaller and larger than ntiles
    for (int vec : {4, 8})
      for (int threads : {64, 256})
        for (int64_t grid : {1, 3, 7, 1000}) check_coverage(s[0], s[1], vec, threads, 1, false, grid);
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
"""


def test_work_decomposition(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    (tmp_path / "harness.cu").write_text(HARNESS)
    exe = tmp_path / "harness"
    subprocess.run([nvcc, "-O2", "-std=c++17", f"-I{REPO / 'geglu'}", str(tmp_path / "harness.cu"), "-o", str(exe)],
                   check=True, capture_output=True)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK (0 failures)"), proc.stdout + proc.stderr
