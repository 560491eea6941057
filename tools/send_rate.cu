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
// First, the dispatch's copies the same way: each token's x row to two destinations, by the
// lanes' loads (before) or staged by bulk copies (comm/staged_row_copy.cuh).
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

#include "comm/staged_row_copy.cuh"
#include "comm/staged_row_sums.cuh"

#define CK(x)                                                                   \
  do {                                                                          \
    const cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                                     \
      std::printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__);    \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

namespace {

__host__ __device__ uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x ^ (x >> 33));
}

// Values in (-1, 1), with exact +0 and -0 among them (the sums' sign of zero is part of
// what the bitwise check covers).
__global__ void fill_rows(__nv_bfloat16* rows, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(uint64_t(i) * 2654435761u + seed);
    float v = (static_cast<float>(h & 0xffff) - 32768.f) / 32768.f;
    if (h % 97 == 0) v = (h & 0x10000) ? -0.f : 0.f;
    rows[i] = __float2bfloat16(v);
  }
}

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

// The dispatch's copies: each token's x row (H bf16) to two destinations (its own rank and
// one peer, as nearly every token at EP = 2), at the token's place there. Before: one warp a
// token, 4 16-byte loads a lane in flight, then the stores (ep_dispatch.cu's copy_row_to of
// before the staged copies), two 256-thread blocks per SM.
__global__ void __launch_bounds__(256)
    copy_lanes_kernel(const __nv_bfloat16* __restrict__ x, int64_t T, int H,
                      __nv_bfloat16* __restrict__ dst0, __nv_bfloat16* __restrict__ dst1) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * 8;
  const int n = H * 2 / 16;
  for (int64_t t = blockIdx.x * 8 + threadIdx.x / 32; t < T; t += warps) {
    const auto* s = reinterpret_cast<const uint4*>(x + t * H);
    for (int base = lane; base < n; base += 32 * 4) {
      uint4 v[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (base + 32 * b < n) v[b] = s[base + 32 * b];
      }
      uint4* d[2] = {reinterpret_cast<uint4*>(dst0 + t * H),
                     reinterpret_cast<uint4*>(dst1 + t * H)};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          if (base + 32 * b < n) d[i][base + 32 * b] = v[b];
        }
      }
    }
  }
}

// The library's staged copy (ep_dispatch.cu's shape: 12 warps of 4 stages of 4 KiB).
using DispatchCopy = megamoe::ep::StagedRowCopy<12, 4, 4096>;
__global__ void __launch_bounds__(DispatchCopy::kThreads, 1)
    copy_staged_kernel(const __nv_bfloat16* __restrict__ x, int64_t T, int H,
                       __nv_bfloat16* __restrict__ dst0, __nv_bfloat16* __restrict__ dst1) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * 12;
  int64_t t = blockIdx.x * 12 + threadIdx.x / 32;
  int offset = 0;
  const int bytes = H * 2;
  DispatchCopy::run(
      smem,
      [&](megamoe::ep::StagedPiece& piece) -> bool {
        if (t >= T) return false;
        const int n = bytes - offset < 4096 ? bytes - offset : 4096;
        piece = {reinterpret_cast<const char*>(x + t * H) + offset, t, n, 0, offset, 0};
        offset += n;
        if (offset == bytes) {
          offset = 0;
          t += warps;
        }
        return true;
      },
      [&](const megamoe::ep::StagedPiece& piece, const uint8_t* staged) {
        const auto* from = reinterpret_cast<const uint4*>(staged);
        for (__nv_bfloat16* dst : {dst0, dst1}) {
          auto* to = reinterpret_cast<uint4*>(reinterpret_cast<char*>(dst + piece.token * H) +
                                              piece.offset);
          for (int o = lane; o < piece.bytes / 16; o += 32) to[o] = from[o];
        }
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

template <int kThreads, int kBatch, bool kCompact>
void time_launch(const Data& d, int blocks, int iters, const char* name) {
  CK(cudaMemset(d.out, 0xff, kT * d.H * 2));  // poisoned: every row must be written
  std::vector<float> ms;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  const int warmup = iters > 1 ? 3 : 0;  // one launch a shape under a profiler
  for (int i = 0; i < iters + warmup; ++i) {
    CK(cudaEventRecord(a));
    send_kernel<kThreads, kBatch, kCompact>
        <<<blocks, kThreads>>>(d.rows, d.slot_row, d.weights, kT, d.H, kK, d.out);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    if (i >= warmup) ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double us = 1e3 * ms[ms.size() / 2];
  const bool first = d.first == nullptr;
  bool same = true;
  if (!first) {
    std::vector<uint16_t> x(kT * d.H), y(kT * d.H);
    CK(cudaMemcpy(x.data(), d.out, x.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), d.first, y.size() * 2, cudaMemcpyDeviceToHost));
    same = x == y;
  }
  const double gbs = double(d.rows_read * d.H * 2 + kT * d.H * 2) / (us * 1e3);
  std::printf("H=%d p=%.3f %-26s %4d blocks x %4d threads, batch %d %-8s %8.1f us %7.1f GB/s  %s\n",
              d.H, d.p, name, blocks, kThreads, kBatch, kCompact ? "compact" : "slots", us, gbs,
              first ? "(reference)" : same ? "bitwise equal" : "DIFFERENT BITS");
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
}

void time_staged(const Data& d, int blocks, int iters, const char* name) {
  using Sums = megamoe::ep::StagedRowSums<8>;
  CK(cudaFuncSetAttribute(staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          Sums::kSharedBytes));
  CK(cudaMemset(d.out, 0xff, kT * d.H * 2));
  std::vector<float> ms;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  const int warmup = iters > 1 ? 3 : 0;
  for (int i = 0; i < iters + warmup; ++i) {
    CK(cudaEventRecord(a));
    staged_kernel<<<blocks, Sums::kThreads, Sums::kSharedBytes>>>(d.rows, d.slot_row, d.weights,
                                                                  kT, d.H, kK, d.out);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    if (i >= warmup) ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double us = 1e3 * ms[ms.size() / 2];
  std::vector<uint16_t> x(kT * d.H), y(kT * d.H);
  CK(cudaMemcpy(x.data(), d.out, x.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), d.first, y.size() * 2, cudaMemcpyDeviceToHost));
  const double gbs = double(d.rows_read * d.H * 2 + kT * d.H * 2) / (us * 1e3);
  std::printf("H=%d p=%.3f %-26s %4d blocks x %4d threads, staged (library)  %8.1f us %7.1f GB/s  %s\n",
              d.H, d.p, name, blocks, Sums::kThreads, us, gbs,
              x == y ? "bitwise equal" : "DIFFERENT BITS");
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
}

// Times the two copies on `sms_used` SMs (the lanes' version two 256-thread blocks a SM) and
// checks both destinations against x bit for bit.
void time_dispatch(int H, int sms_used, int iters, const char* name) {
  __nv_bfloat16 *x, *d0, *d1;
  CK(cudaMalloc(&x, kT * H * 2)); CK(cudaMalloc(&d0, kT * H * 2)); CK(cudaMalloc(&d1, kT * H * 2));
  fill_rows<<<264, 256>>>(x, kT * H, 11u + H);
  CK(cudaFuncSetAttribute(copy_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          DispatchCopy::kSharedBytes));
  for (const bool staged : {false, true}) {
    CK(cudaMemset(d0, 0xff, kT * H * 2)); CK(cudaMemset(d1, 0xff, kT * H * 2));
    std::vector<float> ms;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    const int warmup = iters > 1 ? 3 : 0;
    for (int i = 0; i < iters + warmup; ++i) {
      CK(cudaEventRecord(a));
      if (staged) {
        copy_staged_kernel<<<sms_used, DispatchCopy::kThreads, DispatchCopy::kSharedBytes>>>(
            x, kT, H, d0, d1);
      } else {
        copy_lanes_kernel<<<2 * sms_used, 256>>>(x, kT, H, d0, d1);
      }
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t;
      CK(cudaEventElapsedTime(&t, a, b));
      if (i >= warmup) ms.push_back(t);
    }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    const double us = 1e3 * ms[ms.size() / 2];
    std::vector<uint16_t> hx(kT * H), h0(kT * H), h1(kT * H);
    CK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h0.data(), d0, h0.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h1.data(), d1, h1.size() * 2, cudaMemcpyDeviceToHost));
    std::printf("dispatch H=%d %-26s %s %8.1f us %7.1f GB/s  %s\n", H, name,
                staged ? "staged (library)        " : "lanes (2 x 256 a SM)    ", us,
                3.0 * kT * H * 2 / (us * 1e3), hx == h0 && hx == h1 ? "copies exact" : "WRONG COPY");
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  }
  CK(cudaFree(x)); CK(cudaFree(d0)); CK(cudaFree(d1));
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
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (quick) {
    run_case(2048, 0.5, kR, sms, iters);
    run_case(2048, 0.125, kR, sms, iters);
    return 0;
  }
  for (const int H : {2048, 4096}) {
    time_dispatch(H, sms, iters, "every SM");
    time_dispatch(H, 16, iters, "16 SMs (beside a GEMM)");
    time_dispatch(H, 32, iters, "32 SMs (beside a GEMM)");
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
