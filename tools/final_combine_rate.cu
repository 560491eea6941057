// The EP final combine's sums timed alone on one GPU: the library's sum_partial_rows
// (comm/partial_row_sums.cuh: a lane's loads of an owner's row all in flight before its
// fmas) at 4 and 8 pieces a lane (16 spill at two blocks per SM), against the loop it
// replaced (each 16-byte piece summed over the owners as it came), both in the library's
// launch: two 256-thread blocks per SM, one warp per token. The final combine reads only
// this rank's own memory (the owners' partial rows, already written into its combine
// area), so one GPU measures it as it runs at any EP size. A synthetic rank: T = 16384
// tokens of H bf16, W owners (2 as at EP = 2, 8 as at EP = 8), each owner holding a token
// with probability 1 - (1 - 1/W)^8 (k = 8 slots at random among W owners). Every launch's
// output is checked bit for bit against the old loop's. Results: performance log,
// fifteenth session of 2026-12-04.
//
// Build (nothing to link):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//     tools/final_combine_rate.cu -o build/final_combine_rate
// Run: build/final_combine_rate [iters=20]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check_cuda.h"
#include "comm/partial_row_sums.cuh"
#include "rate_util.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kT = 16384;

using rate_util::fill_rows;
using rate_util::mix;

// The final combine's loop before the fifteenth session of 2026-12-04.
__global__ void __launch_bounds__(kThreads)
    old_kernel(const __nv_bfloat16* __restrict__ partial, const int32_t* __restrict__ pos,
               int world, int H, __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t t = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; t < kT; t += warps) {
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float acc[8] = {};
      for (int d = 0; d < world; ++d) {
        if (pos[t * world + d] < 0) continue;
        megamoe::fma_row(acc, 1.f, *reinterpret_cast<const uint4*>(
                                       partial + (int64_t(d) * kT + t) * H + c));
      }
      *reinterpret_cast<uint4*>(out + t * H + c) = megamoe::pack_row(acc);
    }
  }
}

template <int kChunks>
__global__ void __launch_bounds__(kThreads, 2)
    new_kernel(const __nv_bfloat16* __restrict__ partial, const int32_t* __restrict__ pos,
               int world, int H, __nv_bfloat16* __restrict__ out) {
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t t = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; t < kT; t += warps) {
    megamoe::ep::sum_partial_rows<kChunks>(partial + t * H, kT * H, pos + t * world, world,
                                           H, out + t * H);
  }
}

struct Data {
  int H, world;
  int64_t rows_read = 0;
  __nv_bfloat16 *partial, *out, *first;
  int32_t* pos;
};

template <class Launch>
void time_it(const Data& d, const char* what, int blocks, Launch&& launch, int iters) {
  CK(cudaMemset(d.out, 0xff, kT * d.H * 2));  // poisoned: every row must be written
  const double us = rate_util::median_us(launch, iters, 3);
  const char* verdict = rate_util::verdict(d.out, d.first, size_t(kT) * d.H * 2);
  const double gbs = double((d.rows_read + kT) * d.H * 2) / (us * 1e3);
  std::printf("H=%d W=%d %-18s %4d blocks x %d threads %8.1f us %7.1f GB/s  %s\n", d.H,
              d.world, what, blocks, kThreads, us, gbs, verdict);
}

template <int kChunks>
void time_new(const Data& d, int blocks, int iters) {
  char what[32];
  std::snprintf(what, sizeof what, "new, %d chunks", kChunks);
  time_it(d, what, blocks, [&] {
    new_kernel<kChunks><<<blocks, kThreads>>>(d.partial, d.pos, d.world, d.H, d.out);
  }, iters);
}

void run_case(int H, int world, int sms, int iters) {
  Data d{H, world};
  CK(cudaMalloc(&d.partial, world * kT * H * 2));
  CK(cudaMalloc(&d.out, kT * H * 2));
  CK(cudaMalloc(&d.first, kT * H * 2));
  CK(cudaMalloc(&d.pos, kT * world * 4));
  fill_rows<<<4 * sms, 256>>>(d.partial, world * kT * H, 11u + H + world);
  const double held = 1.0 - std::pow(1.0 - 1.0 / world, 8);
  std::vector<int32_t> pos(kT * world);
  for (int64_t i = 0; i < kT * world; ++i) {
    pos[i] = (mix(uint64_t(i) + 7919u * world) % 10000) < held * 10000 ? 0 : -1;
    d.rows_read += pos[i] >= 0;
  }
  CK(cudaMemcpy(d.pos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  std::printf("-- H = %d, W = %d owners, %.1f%% of (token, owner) pairs held\n", H, world,
              100.0 * d.rows_read / (kT * world));
  const int blocks = 2 * sms;  // the library's launch (ep_layout.cpp: copy_blocks)
  __nv_bfloat16* first = d.first;
  d.first = nullptr;
  time_it(d, "old loop", blocks, [&] {
    old_kernel<<<blocks, kThreads>>>(d.partial, d.pos, world, H, d.out);
  }, iters);
  CK(cudaMemcpy(first, d.out, kT * H * 2, cudaMemcpyDeviceToDevice));
  d.first = first;
  time_new<4>(d, blocks, iters);
  time_new<8>(d, blocks, iters);
  time_it(d, "old loop (again)", blocks, [&] {
    old_kernel<<<blocks, kThreads>>>(d.partial, d.pos, world, H, d.out);
  }, iters);
  CK(cudaFree(d.partial)); CK(cudaFree(d.out)); CK(cudaFree(d.first)); CK(cudaFree(d.pos));
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int sms = rate_util::sm_count();
  for (const int H : {2048, 4096}) {
    for (const int world : {2, 8}) run_case(H, world, sms, iters);
  }
  // An H that is not a multiple of 256 (the last round covers only some lanes' columns).
  run_case(2056, 2, sms, iters);
  return 0;
}
