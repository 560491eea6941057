// What the stand-alone rate tools (send_rate.cu, final_combine_rate.cu, scatter_rate.cu,
// gather_rate.cu) share: a hash for synthetic data, bf16 rows with exact +0 and -0 among
// them, the median time of a launch, the bitwise verdict against a reference output, the SM
// count and the sorted rows of a random routing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "check_cuda.h"

namespace rate_util {

__host__ __device__ inline uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x ^ (x >> 33));
}

// Values in (-1, 1), with exact +0 and -0 among them (the sums' sign of zero is part of
// what the tools' bitwise checks cover).
__global__ void fill_rows(__nv_bfloat16* rows, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(uint64_t(i) * 2654435761u + seed);
    float v = (static_cast<float>(h & 0xffff) - 32768.f) / 32768.f;
    if (h % 97 == 0) v = (h & 0x10000) ? -0.f : 0.f;
    rows[i] = __float2bfloat16(v);
  }
}

// `launch` run warmup times, then iters times each between two events on the default
// stream; the median of the timed runs in microseconds.
template <class Launch>
double median_us(Launch&& launch, int iters, int warmup) {
  std::vector<float> ms;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < iters + warmup; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    if (i >= warmup) ms.push_back(t);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[ms.size() / 2];
}

// `out` against the reference output `first` (device, `bytes` each; null: out is the
// reference).
inline const char* verdict(const void* out, const void* first, size_t bytes) {
  if (first == nullptr) return "(reference)";
  std::vector<uint8_t> x(bytes), y(bytes);
  CK(cudaMemcpy(x.data(), out, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), first, bytes, cudaMemcpyDeviceToHost));
  return x == y ? "bitwise equal" : "DIFFERENT BITS";
}

inline int sm_count() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

// The expert-sorted row of each of `tokens` x `k` slots as the layer's routing plan sorts
// them (routing_plan.h: a stable counting sort of the slots by expert): a distinct random
// top-k of `experts` per token, then row = the expert's offset + the slot's rank among that
// expert's slots in slot order. Checked to be a permutation of the rows.
inline std::vector<int32_t> routed_rows(int64_t tokens, int k, int experts, unsigned seed) {
  std::mt19937 rng(seed);
  const int64_t slots = tokens * k;
  std::vector<int32_t> ids(slots), order(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    for (int j = 0; j < k; ++j) {  // a partial Fisher-Yates shuffle: k distinct experts
      std::swap(order[j], order[j + rng() % (experts - j)]);
      ids[t * k + j] = order[j];
    }
  }
  std::vector<int64_t> next(experts + 1, 0);
  for (const int32_t e : ids) ++next[e + 1];
  std::partial_sum(next.begin(), next.end(), next.begin());
  std::vector<int32_t> row(slots);
  for (int64_t s = 0; s < slots; ++s) row[s] = static_cast<int32_t>(next[ids[s]]++);
  std::vector<char> seen(slots, 0);
  for (const int32_t r : row) {
    if (r < 0 || r >= slots || seen[r]++) {
      std::fprintf(stderr, "routed_rows: not a permutation\n");
      std::exit(1);
    }
  }
  return row;
}

}  // namespace rate_util
