// What DRAM gives the to-rows pass's traffic, with no quantization: each of T = 16384
// tokens' H = 2048 bf16 values read once (4 KiB) and k = 8 rows of H bytes written (the
// e4m3 rows' size) to the token's slots in the expert-sorted order: a random permutation of
// the 131072 rows, as random routing gives, or in token order (slot rows t * k + j), against
// the same bytes read alone and written alone. The FP8 to-rows quantizer
// (quantize_fp8_to_rows) moves this traffic plus 4-byte scales at 2.5-2.7 TB/s; this says
// how far that is from what the pattern itself allows (performance log, fifteenth session
// of 2026-12-04).
//
// Build (nothing to link):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc tools/scatter_rate.cu \
//     -o build/scatter_rate
// Run: build/scatter_rate [iters=20]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "check_cuda.h"
#include "rate_util.cuh"

namespace {

constexpr int64_t kT = 16384, kK = 8, kH = 2048;
constexpr int kThreads = 256;
constexpr int kIn = kH * 2 / 16 / 32;   // 16-byte loads a lane per token (8)
constexpr int kOut = kH / 16 / 32;      // 16-byte stores a lane per row (4)

enum Mode { kCopy, kWriteOnly, kReadOnly };

// One warp per token: its row's loads all in flight, then its k rows' stores (each lane's
// 64 bytes of a row from its first loads: the bytes are not what is measured).
template <Mode kMode>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ dest,
                   uint4* __restrict__ rows, int32_t* __restrict__ sink) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  uint32_t acc = 0;
  for (int64_t t = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; t < kT; t += warps) {
    uint4 v[kIn];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      v[i] = kMode == kWriteOnly ? make_uint4(uint32_t(t), i, lane, 1)
                                 : x[t * (kH * 2 / 16) + i * 32 + lane];
    }
    if constexpr (kMode == kReadOnly) {
#pragma unroll
      for (int i = 0; i < kIn; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      continue;
    }
    const int32_t my_dest = lane < kK ? dest[t * kK + lane] : 0;
    for (int j = 0; j < kK; ++j) {
      const int64_t r = __shfl_sync(0xffffffffu, my_dest, j);
#pragma unroll
      for (int i = 0; i < kOut; ++i) rows[r * (kH / 16) + i * 32 + lane] = v[i];
    }
  }
  if (acc == 0x12345678u) sink[0] = 1;  // keeps the read-only loads
}

template <Mode kMode>
void time_mode(const char* what, const uint4* x, const int32_t* dest, uint4* rows,
               int32_t* sink, int blocks, int iters) {
  const double us = rate_util::median_us(
      [&] { scatter_kernel<kMode><<<blocks, kThreads>>>(x, dest, rows, sink); }, iters, 3);
  const double read = kMode == kWriteOnly ? 0 : kT * kH * 2.0;
  const double written = kMode == kReadOnly ? 0 : kT * kK * kH * 1.0;
  std::printf("%-34s %4d blocks  %7.1f us  read %5.1f MiB  written %6.1f MiB  %6.2f TB/s\n",
              what, blocks, us, read / (1 << 20), written / (1 << 20),
              (read + written) / (us * 1e6));
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int sms = rate_util::sm_count();
  uint4 *x, *rows;
  int32_t *dest_random, *dest_ordered, *sink;
  CK(cudaMalloc(&x, kT * kH * 2));
  CK(cudaMalloc(&rows, kT * kK * kH));
  CK(cudaMalloc(&dest_random, kT * kK * 4));
  CK(cudaMalloc(&dest_ordered, kT * kK * 4));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(x, 1, kT * kH * 2));
  std::vector<int32_t> perm(kT * kK);
  std::iota(perm.begin(), perm.end(), 0);
  CK(cudaMemcpy(dest_ordered, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  std::shuffle(perm.begin(), perm.end(), std::mt19937(12345));
  CK(cudaMemcpy(dest_random, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  for (const int per_sm : {2, 4, 8}) {
    const int blocks = per_sm * sms;
    time_mode<kCopy>("read + scattered rows (random)", x, dest_random, rows, sink, blocks, iters);
    time_mode<kCopy>("read + rows in token order", x, dest_ordered, rows, sink, blocks, iters);
    time_mode<kWriteOnly>("scattered rows only (random)", x, dest_random, rows, sink, blocks,
                          iters);
    time_mode<kReadOnly>("read only", x, dest_random, rows, sink, blocks, iters);
  }
  CK(cudaFree(x)); CK(cudaFree(rows)); CK(cudaFree(dest_random)); CK(cudaFree(dest_ordered));
  CK(cudaFree(sink));
  return 0;
}
