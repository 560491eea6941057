// Compile-only probe: can a consumer warpgroup keep its own FP8 MMAs in flight through its
// promotions (192-wide tile, two 96-column groups, a 48-register scratch each, 96 sums)
// without ptxas serializing the wgmmas (C7514) or spilling at 232 registers?
#include <cuda_fp8.h>
#include "kernels/sm90/primitives.cuh"
using namespace megamoe::sm90;

#define D48 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define A8(d, i) "+f"(d[i]), "+f"(d[i+1]), "+f"(d[i+2]), "+f"(d[i+3]), "+f"(d[i+4]), "+f"(d[i+5]), "+f"(d[i+6]), "+f"(d[i+7])
__device__ __forceinline__ void wgmma_e4m3_n96(float (&d)[48], uint64_t da, uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {" D48 "}, %48, %49, p, 1, 1;\n}\n"
               : A8(d, 0), A8(d, 8), A8(d, 16), A8(d, 24), A8(d, 32), A8(d, 40)
               : "l"(da), "l"(db), "r"(scale_d));
}

constexpr int kStages = 4, kChunk = CHUNK;
struct Smem {
  alignas(1024) uint8_t a[kStages][128 * 128];
  alignas(1024) uint8_t b[kStages][192 * 128];
  float a_scales[kStages][128];
  uint64_t full[kStages], empty[kStages];
};

__device__ __forceinline__ void issue(float (&s)[48], uint64_t da, uint64_t db) {
#pragma unroll
  for (int i = 0; i < 48; ++i) fence_operand(s[i]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_n96(s, da + 2 * kk, db + 2 * kk, kk > 0);
  wgmma_commit();
}
__device__ __forceinline__ void promote(const float (&s)[48], float* sum, float scale) {
#pragma unroll
  for (int i = 0; i < 48; ++i) sum[i] = fmaf(s[i], scale, sum[i]);
}

__global__ void __launch_bounds__(384, 1) probe(const float* b_scales, float* out, int k_blocks) {
  extern __shared__ __align__(1024) uint8_t raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int st = kb % kStages;
        if (kb >= kStages) mbarrier_wait(&sm.empty[st], ((kb / kStages) - 1) & 1);
        mbarrier_arrive(&sm.full[st]);
      }
    }
    return;
  }
  setmaxnreg_inc<232>();
  const int consumer = wg - 1;
  float sum[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) sum[i] = 0.f;
  float s0[48], s1[48];
  int kb = 0;
  // Chunks of kChunk k-blocks, straight-line: group n's MMAs issued before group n-1's
  // wait and promotion; only the chunk's last group waits with nothing behind it.
  for (; kb + kChunk <= k_blocks; kb += kChunk) {
    float prev_scale = 0.f;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int st = (kb + i) % kStages;
      const float sb0 = __ldg(b_scales + 2 * (kb + i)), sb1 = __ldg(b_scales + 2 * (kb + i) + 1);
      mbarrier_wait(&sm.full[st], ((kb + i) / kStages) & 1);
      const float sa = sm.a_scales[st][consumer * 64 + threadIdx.x % 32];
      const uint64_t da = smem_desc_k_major_sw128(sm.a[st] + consumer * 64 * 128);
      const uint64_t db = smem_desc_k_major_sw128(sm.b[st]);
      issue(s0, da, db);                       // group 0 of k-block i
      if (i > 0) {
        wgmma_wait<1>();                         // group 1 of k-block i-1 done
#pragma unroll
        for (int j = 0; j < 48; ++j) fence_operand(s1[j]);
        promote(s1, sum + 48, prev_scale);
        if (threadIdx.x % 32 == 0) mbarrier_arrive(&sm.empty[(kb + i - 1) % kStages]);
      }
      issue(s1, da, db + 96 * 128 / 16);       // group 1
      wgmma_wait<1>();                           // group 0 done
#pragma unroll
      for (int j = 0; j < 48; ++j) fence_operand(s0[j]);
      promote(s0, sum, sa * sb0);
      prev_scale = sa * sb1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 48; ++j) fence_operand(s1[j]);
    promote(s1, sum + 48, prev_scale);
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&sm.empty[(kb + kChunk - 1) % kStages]);
  }
  for (; kb < k_blocks; ++kb) {
    const int st = kb % kStages;
    const float sb0 = __ldg(b_scales + 2 * kb), sb1 = __ldg(b_scales + 2 * kb + 1);
    mbarrier_wait(&sm.full[st], (kb / kStages) & 1);
    const float sa = sm.a_scales[st][consumer * 64 + threadIdx.x % 32];
    const uint64_t da = smem_desc_k_major_sw128(sm.a[st] + consumer * 64 * 128);
    const uint64_t db = smem_desc_k_major_sw128(sm.b[st]);
    issue(s0, da, db);
    issue(s1, da, db + 96 * 128 / 16);
    wgmma_wait<1>();
#pragma unroll
    for (int j = 0; j < 48; ++j) fence_operand(s0[j]);
    promote(s0, sum, sa * sb0);
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 48; ++j) fence_operand(s1[j]);
    promote(s1, sum + 48, sa * sb1);
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&sm.empty[st]);
  }
#pragma unroll
  for (int i = 0; i < 96; ++i) out[(blockIdx.x * 256 + threadIdx.x - 128) * 96 + i] = sum[i];
}
