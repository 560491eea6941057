// Tensor-core rate of back-to-back wgmma from shared memory, by how the MMAs are issued:
// how many warpgroups issue at once (1 or 2), the instruction's N (128 or 256) and how
// many independent accumulator sets each warpgroup alternates between (1 or 2), with the
// grouped GEMM's k-block rhythm (4 k-steps per commit, wait_group 1). Operands are
// whatever shared memory holds (zeros): only the rate is measured.
//
// Why: a schedule in which one warpgroup issues MMAs at a time (a ping-pong of the two
// consumers, each with two m64n128 accumulator sets) only pays if one warpgroup can keep
// the tensor cores as busy as two issuing m64n256 together; this measures that apart from
// any GEMM kernel. The second part runs one MMA warpgroup beside a stand-in for the other's
// epilogue (shared stores, proxy fences, named barriers, a bulk store), to see whether an
// epilogue next to the MMAs slows them. Results: PERFLOG, second session of 2026-11-30.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//          tools/wgmma_rate.cu -o build-ab/wgmma_rate
// Run (on an H200): build-ab/wgmma_rate   -> one line per configuration, TFLOP/s
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/sm90/primitives.cuh"

using namespace megamoe::sm90;

constexpr int kKSteps = 4;         // 16-wide k-steps per 64-wide k-block
constexpr int kSmemBytes = 200 * 1024;  // one block per SM

constexpr int kSlabBytes = 8192;          // one 64-row slab of A (64 x 64 bf16)
constexpr int kBOffset = 4 * kSlabBytes;  // B (up to 256 rows x 64) after four A slabs

__device__ void zero_shared(uint8_t* smem) {
  for (int i = threadIdx.x; i < kSmemBytes / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
}

// One warpgroup's MMAs: k_blocks k-blocks of kKSteps m64nNk16 per accumulator set (A slab
// c for set c, the same B), one commit per k-block and wait_group 1, as the grouped GEMM.
// Returns a sum of the accumulators for the caller to keep them alive.
template <int kN, int kChains>
__device__ float issue_mmas(const uint8_t* a, const uint8_t* b, int k_blocks) {
  float acc[kChains][kN / 2];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[c][i] = 0.f;
  }
  const uint64_t desc_b = smem_desc_k_major_sw128(b);
  for (int kb = 0; kb < k_blocks; ++kb) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) fence_operand(acc[c][i]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) {
        wgmma_bf16<kN>(acc[c], smem_desc_k_major_sw128(a + c * kSlabBytes) + 2 * kk,
                       desc_b + 2 * kk, 1);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) s += acc[c][i];
  }
  return s;
}

template <int kWarpgroups, int kN, int kChains>
__global__ void __launch_bounds__(128 * 2, 1) wgmma_rate_kernel(int k_blocks, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  zero_shared(smem);
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup >= kWarpgroups) return;
  // Each warpgroup its own A slabs, one per accumulator set; B shared.
  const float s = issue_mmas<kN, kChains>(smem + warpgroup * kChains * kSlabBytes,
                                          smem + kBOffset, k_blocks);
  if (s == 12345.f) *sink = s;  // keeps the MMAs alive
}

constexpr int kTimedKBlocks = 4096;

// Milliseconds of run(kTimedKBlocks) after an untimed run(64); run launches the kernel.
template <class Run>
float time_ms(Run run) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  run(64);  // warm-up
  cudaEventRecord(start);
  run(kTimedKBlocks);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  return ms;
}

const char* status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "ok" : cudaGetErrorString(err);
}

template <int kWarpgroups, int kN, int kChains>
void measure(int sms, float* sink) {
  auto* kernel = &wgmma_rate_kernel<kWarpgroups, kN, kChains>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const float ms = time_ms([&](int k_blocks) { kernel<<<sms, 256, kSmemBytes>>>(k_blocks, sink); });
  const double flops =
      double(sms) * kWarpgroups * kTimedKBlocks * kKSteps * kChains * 2.0 * 64 * kN * 16;
  std::printf("warpgroups %d  m64n%-3d  chains %d  rows/wg %3d  %8.1f TFLOP/s  %s\n", kWarpgroups,
              kN, kChains, 64 * kChains, flops / (ms * 1e-3) / 1e12, status());
}

// One warpgroup issues m64n128 MMAs over two accumulator sets (the ping-pong mainloop)
// while the other runs a stand-in for the ping-pong epilogue over and over: 32 KB of bf16
// stores into a staging buffer with the epilogue's swizzled addresses (kStores), then
// (kFence) a proxy fence, the warpgroup's named barrier (always, twice a round), then
// (kBulkStore) the staging buffer copied to global memory by the bulk-copy engine, as the
// TMA store does.
template <bool kStores, bool kFence, bool kBulkStore>
__global__ void __launch_bounds__(256, 1) interference_kernel(int k_blocks, float* sink,
                                                              uint8_t* scratch) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ volatile int done;
  zero_shared(smem);
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  if (threadIdx.x >= 128) {  // the epilogue stand-in
    uint8_t* staging = smem + 96 * 1024;
    const int t = threadIdx.x - 128;
    float v = t;
    uint8_t* out = scratch + int64_t(blockIdx.x) * 32768;
    __shared__ int stop;  // `done` as thread 0 saw it, the same for the whole warpgroup
    for (;;) {
      if (kStores) {
        for (int i = 0; i < 32768 / (128 * 4); ++i) {  // 4-byte stores, 64 per thread
          const int r = (i * 128 + t) / 32, c = ((i * 128 + t) % 32) * 2;
          *reinterpret_cast<__nv_bfloat162*>(staging + (r % 256) * 128 +
                                             (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2) =
              __floats2bfloat162_rn(v, v + 1.f);
          v += 1.f;
        }
      }
      if (kFence) fence_proxy_async_shared();
      if (t == 0) stop = done;
      named_barrier_sync(1, 128);
      if (kBulkStore && t == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out),
                     "r"(smem_addr(staging)), "r"(32768) : "memory");
        bulk_commit_group();
        bulk_wait_group_read_all();
      }
      const bool leave = stop != 0;
      named_barrier_sync(1, 128);
      if (leave) break;
    }
    return;
  }
  const float s = issue_mmas<128, 2>(smem, smem + kBOffset, k_blocks);
  if (threadIdx.x == 0) done = 1;
  if (s == 12345.f) *sink = s;
}

template <bool kStores, bool kFence, bool kBulkStore>
void measure_interference(int sms, float* sink, uint8_t* scratch, const char* what) {
  auto* kernel = &interference_kernel<kStores, kFence, kBulkStore>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const float ms = time_ms(
      [&](int k_blocks) { kernel<<<sms, 256, kSmemBytes>>>(k_blocks, sink, scratch); });
  const double flops = double(sms) * kTimedKBlocks * kKSteps * 2 * 2.0 * 64 * 128 * 16;
  std::printf("1 warpgroup m64n128 x2 beside: %-44s %8.1f TFLOP/s  %s\n", what,
              flops / (ms * 1e-3) / 1e12, status());
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, sizeof(float));
  // The cooperative kernel's issue pattern, then the ping-pong's, then the rest.
  measure<2, 256, 1>(sms, sink);
  measure<1, 128, 2>(sms, sink);
  measure<1, 256, 1>(sms, sink);
  measure<2, 128, 2>(sms, sink);
  measure<2, 128, 1>(sms, sink);
  measure<1, 128, 1>(sms, sink);
  measure<2, 256, 1>(sms, sink);  // again: the clock may have moved
  // The ping-pong epilogue's traffic beside one warpgroup's MMAs.
  uint8_t* scratch = nullptr;
  cudaMalloc(&scratch, size_t(sms) * 32768);
  measure_interference<false, false, false>(sms, sink, scratch, "barriers only");
  measure_interference<true, false, false>(sms, sink, scratch, "shared stores");
  measure_interference<true, true, false>(sms, sink, scratch, "stores + proxy fence");
  measure_interference<true, true, true>(sms, sink, scratch, "stores + proxy fence + bulk store");
  measure_interference<false, true, false>(sms, sink, scratch, "proxy fence only");
  return 0;
}
