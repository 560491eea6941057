// A grouped GEMM beside a kernel that holds some SMs, as the expert-parallel layer's GEMMs
// run beside its row copies: the bf16 M-grouped L2 of the 30b preset (131072 rows, 128
// experts of 1024 rows, K = 768, N = 2048), timed alone and with a stand-in copy (one block
// per SM, `hog_sms` blocks, each spinning on the global timer for `hog_us`) launched just
// before it on another stream; each also under the cap the EP layer puts on a GEMM beside a
// copy (SmLimit of the SMs less the copy's, Scope::kRoundRobinGrids). Medians of `iters`
// runs. Run it with MEGAMOE_DYNAMIC_TILES unset (round-robin tiles) and set to 1 (tiles
// handed out as blocks ask: the cap then does not apply).
//
// Why: a round-robin grid whose block waits for a copy's SM ends that much later; the cap
// avoids that by giving up the copy's SMs for the GEMM's whole run; handed-out tiles give
// them up only while the copy runs. Results: PERFLOG, ninth session of 2026-12-04.
//
// Build (after the library's build, against its test archive):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc -Iinclude \
//     tools/gemm_beside_copy.cu build/tests/cpp/libmegamoe_internal_for_tests.a -lcuda \
//     -o build/gemm_beside_copy
// Run: build/gemm_beside_copy [hog_sms=16] [hog_us=300] [iters=20]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/common/sm_count.h"
#include "kernels/sm90/gemm.h"
#include "check_cuda.h"

__global__ void hog_kernel(long long ns) {
  extern __shared__ char smem[];
  long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  now = start;
  while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  if (threadIdx.x == 0 && now == 0) smem[0] = 1;
}

int main(int argc, char** argv) {
  const int hog_sms = argc > 1 ? std::atoi(argv[1]) : 16;
  const long long hog_us = argc > 2 ? std::atoll(argv[2]) : 300;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 20;
  const int E = 128, per = 1024, K = 768, N = 2048;
  const int64_t rows = int64_t(E) * per;
  std::vector<int32_t> off(E + 1), tiles(E + 1);
  for (int e = 0; e <= E; ++e) { off[e] = e * per; tiles[e] = e * (per / 128); }
  int32_t *d_off, *d_tiles;
  __nv_bfloat16 *a, *b, *c;
  CK(cudaMalloc(&d_off, 4 * (E + 1))); CK(cudaMalloc(&d_tiles, 4 * (E + 1)));
  CK(cudaMemcpy(d_off, off.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tiles, tiles.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&a, rows * K * 2)); CK(cudaMalloc(&b, int64_t(E) * N * K * 2)); CK(cudaMalloc(&c, rows * N * 2));
  CK(cudaMemset(a, 0x3c, rows * K * 2)); CK(cudaMemset(b, 0x3c, int64_t(E) * N * K * 2));
  megamoe::sm90::MGroupedGemmArgs g;
  g.groups = {E, d_off, d_tiles, rows};
  g.a = {a, rows, megamoe::sm90::RowLayout::kSorted, nullptr};
  g.b = b; g.k = K; g.n = N;
  g.c = {c, N, rows, megamoe::sm90::RowLayout::kSorted};
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaFuncSetAttribute(hog_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t start, end, fork;
  CK(cudaEventCreate(&start)); CK(cudaEventCreate(&end)); CK(cudaEventCreate(&fork));
  const int sms = megamoe::sm_count();
  const auto run = [&](bool hog, bool limit) {
    std::vector<float> ms;
    for (int i = 0; i < iters + 3; ++i) {
      CK(cudaEventRecord(start, s0));
      if (hog) {
        CK(cudaEventRecord(fork, s0));
        CK(cudaStreamWaitEvent(s1, fork, 0));
        hog_kernel<<<hog_sms, 128, 200 * 1024, s1>>>(hog_us * 1000);
        CK(cudaGetLastError());
      }
      if (limit) {
        const megamoe::SmLimit cap(sms - hog_sms, megamoe::SmLimit::Scope::kRoundRobinGrids);
        megamoe::sm90::m_grouped_gemm_nt(g, s0);
      } else {
        megamoe::sm90::m_grouped_gemm_nt(g, s0);
      }
      CK(cudaEventRecord(end, s0));
      CK(cudaStreamSynchronize(s0)); CK(cudaStreamSynchronize(s1));
      float t; CK(cudaEventElapsedTime(&t, start, end));
      if (i >= 3) ms.push_back(t * 1000);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const char* dyn = std::getenv("MEGAMOE_DYNAMIC_TILES");
  std::printf("tiles %s, hog %d SMs x %lld us: alone %.1f us, beside the hog %.1f us, "
              "beside it under the EP cap (%d SMs for round-robin grids) %.1f us, alone under it %.1f us\n",
              dyn && dyn[0] && dyn[0] != '0' ? "handed out" : "round-robin", hog_sms, hog_us,
              run(false, false), run(true, false), sms - hog_sms, run(true, true),
              run(false, true));
  return 0;
}
