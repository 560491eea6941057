// The EP combine send's sums timed alone on one GPU, per launch shape, against the lanes'
// loads they replaced: the library's StagedRowSums (comm/staged_row_sums.cuh: the rows in
// shared memory by bulk copies, one block per SM) and, below, the send of before the
// thirteenth session of 2026-12-04, whose lanes loaded the rows themselves (batched by
// slots, as it did, or by this owner's rows: `compact`), on every SM (its default launch:
// two 256-thread blocks per SM) or on a few (its launch beside a GEMM: one wide block per
// copy SM). A synthetic owner: R = 131072 expert rows of H bf16, T = 16384 received tokens
// of k = 8 slots, each slot this owner's with probability p (1/2 as at EP = 2, 1/4, 1/8 as
// at EP = 8) at a random row. The stores go to this GPU's memory instead of a peer's, so
// this measures the loads' side, which two-GPU timelines found to bound the sends on few
// SMs (performance log, twelfth session of 2026-12-04). Every launch's output is checked
// bit for bit against the first one's. Results: performance log, thirteenth session.
//
// Build (nothing to link):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc tools/send_rate.cu \
//     -o build/send_rate
// Run: build/send_rate [iters=20] [quick]  (quick: H = 2048 at p = 1/2 and 1/8 only; one
// launch a shape when iters is 1, for a profiler)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/staged_row_sums.cuh"
#include "check_cuda.h"
#include "rate_util.cuh"

namespace {

using rate_util::fill_rows;
using rate_util::mix;

// The sums of the send before: lane j < k holds slot j's row (-1: another owner's) and
// weight; kBatch rows' 16-byte loads a lane in flight before their fmas; kCompact batches
// this owner's rows instead of slots.
template <int kBatch, bool kCompact>
__device__ __forceinline__ void sum_slot_rows(const __nv_bfloat16* __restrict__ rows,
                                              int H, int k, int lane, int32_t row,
                                              float weight, __nv_bfloat16* out) {
  int n = k;  // entries to visit, lanes 0..n-1
  if constexpr (kCompact) {
    const unsigned valid = __ballot_sync(0xffffffffu, lane < k && row >= 0);
    n = __popc(valid);
    const int from = lane < n ? static_cast<int>(__fns(valid, 0, lane + 1)) : lane;
    row = __shfl_sync(0xffffffffu, row, from);
    weight = __shfl_sync(0xffffffffu, weight, from);
  }
  // Every lane runs every pass (the shuffles below need the whole warp), also where H is
  // not a multiple of 256 and the last pass covers only some lanes' columns.
  for (int c0 = 0; c0 < H; c0 += 32 * 8) {
    const int c = c0 + lane * 8;
    const bool in_row = c < H;
    float acc[8] = {};
    for (int j0 = 0; j0 < n; j0 += kBatch) {
      uint4 v[kBatch];
      float w[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int32_t r = __shfl_sync(0xffffffffu, row, (j0 + b) % 32);
        w[b] = __shfl_sync(0xffffffffu, weight, (j0 + b) % 32);
        const bool used = j0 + b < n && r >= 0;
        v[b] = used && in_row ? *reinterpret_cast<const uint4*>(rows + int64_t(r) * H + c)
                              : make_uint4(0, 0, 0, 0);
        if (!used) w[b] = 0.f;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) megamoe::fma_row(acc, w[b], v[b]);
    }
    if (in_row) *reinterpret_cast<uint4*>(out + c) = megamoe::pack_row(acc);
  }
}

template <int kThreads, int kBatch, bool kCompact>
__global__ void __launch_bounds__(kThreads)
    send_kernel(const __nv_bfloat16* __restrict__ rows, const int32_t* __restrict__ slot_row,
                const float* __restrict__ row_weights, int64_t T, int H, int k,
                __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t t = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
    const int32_t row = lane < k ? slot_row[t * k + lane] : -1;
    const float weight = row >= 0 ? row_weights[row] : 1.f;
    sum_slot_rows<kBatch, kCompact>(rows, H, k, lane, row, weight, out + t * H);
  }
}

// The library's sums on the synthetic owner: one warp per token at a time.
__global__ void __launch_bounds__(megamoe::ep::StagedRowSums<8>::kThreads, 1)
    staged_kernel(const __nv_bfloat16* __restrict__ rows, const int32_t* __restrict__ slot_row,
                  const float* __restrict__ row_weights, int64_t T, int H, int k,
                  __nv_bfloat16* __restrict__ out) {
  using Sums = megamoe::ep::StagedRowSums<8>;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * Sums::kWarps;
  int64_t t = blockIdx.x * int64_t(Sums::kWarps) + threadIdx.x / 32;
  Sums::run(rows, H, k, smem, [&]() -> megamoe::ep::StagedToken {
    if (t >= T) return {true, -1, 0.f, nullptr};
    const int32_t row = lane < k ? slot_row[t * k + lane] : -1;
    const float weight = row >= 0 ? row_weights[row] : 1.f;
    const megamoe::ep::StagedToken token{false, row, weight, out + t * H};
    t += warps;
    return token;
  });
}

struct Data {
  int H;
  double p;
  int64_t rows_read = 0;
  __nv_bfloat16 *rows, *out, *first;
  int32_t* slot_row;
  float* weights;
};

constexpr int64_t kR = 131072, kT = 16384;
constexpr int kK = 8;

// Runs `launch` (iters times after 3 warm-up runs; once, for a profiler, when iters is 1)
// on a poisoned output, prints the median time, the rate and how the output compares with
// d.first's (none: this is the reference), each line labelled by `what`.
template <class Launch>
void time_sums(const Data& d, const char* name, int blocks, int threads, const char* what,
               Launch&& launch, int iters) {
  CK(cudaMemset(d.out, 0xff, kT * d.H * 2));  // poisoned: every row must be written
  const double us = rate_util::median_us(launch, iters, iters > 1 ? 3 : 0);
  const char* verdict = rate_util::verdict(d.out, d.first, size_t(kT) * d.H * 2);
  const double gbs = double(d.rows_read * d.H * 2 + kT * d.H * 2) / (us * 1e3);
  std::printf("H=%d p=%.3f %-26s %4d blocks x %4d threads, %-22s %8.1f us %7.1f GB/s  %s\n",
              d.H, d.p, name, blocks, threads, what, us, gbs, verdict);
}

template <int kThreads, int kBatch, bool kCompact>
void time_launch(const Data& d, int blocks, int iters, const char* name) {
  char what[32];
  std::snprintf(what, sizeof what, "batch %d %s", kBatch, kCompact ? "compact" : "slots");
  time_sums(d, name, blocks, kThreads, what, [&] {
    send_kernel<kThreads, kBatch, kCompact>
        <<<blocks, kThreads>>>(d.rows, d.slot_row, d.weights, kT, d.H, kK, d.out);
  }, iters);
}

void time_staged(const Data& d, int blocks, int iters, const char* name) {
  using Sums = megamoe::ep::StagedRowSums<8>;
  CK(cudaFuncSetAttribute(staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          Sums::kSharedBytes));
  time_sums(d, name, blocks, Sums::kThreads, "staged (library)", [&] {
    staged_kernel<<<blocks, Sums::kThreads, Sums::kSharedBytes>>>(d.rows, d.slot_row, d.weights,
                                                                  kT, d.H, kK, d.out);
  }, iters);
}

// One synthetic owner: the slots' rows drawn from the first `span` of the R rows.
void run_case(int H, double p, int64_t span, int sms, int iters) {
  Data d{H, p};
  CK(cudaMalloc(&d.rows, kR * H * 2));
  CK(cudaMalloc(&d.out, kT * H * 2));
  CK(cudaMalloc(&d.first, kT * H * 2));
  CK(cudaMalloc(&d.slot_row, kT * kK * 4));
  CK(cudaMalloc(&d.weights, kR * 4));
  fill_rows<<<4 * sms, 256>>>(d.rows, kR * H, 7u + H);
  std::vector<int32_t> slot(kT * kK);
  std::vector<float> w(kR);
  for (int64_t s = 0; s < kT * kK; ++s) {
    const uint32_t h = mix(uint64_t(s) + 1000003u * H);
    slot[s] = (h % 10000) < p * 10000 ? static_cast<int32_t>(mix(h) % span) : -1;
    d.rows_read += slot[s] >= 0;
  }
  for (int64_t r = 0; r < kR; ++r) w[r] = (mix(r + 77) % 1000) / 1000.f;  // some exact 0
  CK(cudaMemcpy(d.slot_row, slot.data(), slot.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.weights, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  std::printf("-- H = %d, p = %.3f, rows from the first %lld of %lld\n", H, p,
              static_cast<long long>(span), static_cast<long long>(kR));
  __nv_bfloat16* first = d.first;
  d.first = nullptr;
  time_launch<256, 4, false>(d, 2 * sms, iters, "every SM (default launch)");
  CK(cudaMemcpy(first, d.out, kT * H * 2, cudaMemcpyDeviceToDevice));
  d.first = first;
  time_launch<256, 4, true>(d, 2 * sms, iters, "every SM (default launch)");
  if (span == kR) time_launch<256, 8, true>(d, 2 * sms, iters, "every SM (default launch)");
  for (const int copy_sms : {16, 32}) {
    const char* name = copy_sms == 16 ? "16 SMs (beside a GEMM)" : "32 SMs (beside a GEMM)";
    time_launch<1024, 4, false>(d, copy_sms, iters, name);
    time_launch<1024, 4, true>(d, copy_sms, iters, name);
    if (span < kR) {
      time_staged(d, copy_sms, iters, name);
      continue;
    }
    time_launch<1024, 8, true>(d, copy_sms, iters, name);
    time_launch<768, 8, false>(d, copy_sms, iters, name);
    time_launch<768, 8, true>(d, copy_sms, iters, name);
    time_staged(d, copy_sms, iters, name);
  }
  time_staged(d, sms, iters, "every SM (one block each)");
  CK(cudaFree(d.rows)); CK(cudaFree(d.out)); CK(cudaFree(d.first));
  CK(cudaFree(d.slot_row)); CK(cudaFree(d.weights));
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out before a possible timeout
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool quick = argc > 2 && std::string(argv[2]) == "quick";  // H = 2048, p = 1/2 and 1/8
  const int sms = rate_util::sm_count();
  if (quick) {
    run_case(2048, 0.5, kR, sms, iters);
    run_case(2048, 0.125, kR, sms, iters);
    return 0;
  }
  for (const int H : {2048, 4096}) {
    for (const double p : {0.5, 0.25, 0.125}) run_case(H, p, kR, sms, iters);
  }
  // The same sums with every slot's row among 8192 (32 MiB at H = 2048): whether the rate
  // on few SMs depends on how far apart the rows lie.
  run_case(2048, 0.5, 8192, sms, iters);
  run_case(2048, 0.125, 8192, sms, iters);
  return 0;
}
