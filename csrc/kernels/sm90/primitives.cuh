// Hopper (sm_90a) building blocks: mbarriers, TMA tile loads, wgmma. Thin inline-PTX
// wrappers, each named after the one instruction it issues.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace megamoe::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The thread's lane in its warp, from %laneid: opaque to the compiler, unlike
// threadIdx.x % 32 (in the bf16 mainloop, that form of its releasing lanes made ptxas
// serialize the tile-passing GEMMs' wgmma).
__device__ __forceinline__ uint32_t lane_id() {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// ---- mbarrier ------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals));
}

// Makes the barrier initialisation visible to the async proxy (TMA) and other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA -----------------------------------------------------------------------------

// Loads the box at (inner, outer) of a 2-D tensor map into shared memory; completion is
// counted in bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// Stores a shared-memory box to (inner, outer) of a 2-D tensor map, in this thread's
// current bulk async-group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src,
                                             int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(src)), "r"(inner), "r"(outer)
      : "memory");
}
// Asks for the box at (inner, outer) of a 2-D tensor map to be brought into L2, without a
// destination or a completion to wait for.
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int32_t inner,
                                                int32_t outer) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(inner), "r"(outer)
               : "memory");
}
// Copies `bytes` (a multiple of 16) from global memory into shared memory, both 16-byte
// aligned; completion is counted in bytes on `bar`.
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, uint32_t bytes,
                                             uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until this thread's committed bulk stores have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Waits until this thread's committed bulk stores are complete.
__device__ __forceinline__ void bulk_wait_group_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Stores four 8x8 bf16 matrices to shared memory: lane l gives the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes), and its register i holds elements 2(l % 4), 2(l % 4)
// + 1 of row l / 4 of matrix i (the accumulator fragment layout of mma and wgmma).
__device__ __forceinline__ void stmatrix_x4(void* row_address, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                   smem_addr(row_address)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The load counterpart: register i of lane l receives elements 2(l % 4), 2(l % 4) + 1 of
// row l / 4 of matrix i, whose row l % 8 lane l addresses.
__device__ __forceinline__ void ldmatrix_x4(const void* row_address, uint32_t& r0, uint32_t& r1,
                                            uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(row_address))
               : "memory");
}

// Barrier among `threads` threads (a warpgroup) on hardware barrier `id` (0 is
// __syncthreads's).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- cp.async (row gathers that TMA cannot express) -----------------------------------

// 16 bytes global -> shared, bypassing L1.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

// Closes this thread's current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most kPending of this thread's committed cp.async groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// 4 bytes global -> shared (an FP8 row's block scale).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

// Arrives on `bar` once this thread's earlier cp.async copies have landed; the barrier's
// expected count includes this arrival (noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// Orders generic-proxy shared-memory writes (cp.async, st.shared) seen by this thread before
// its later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- wgmma ---------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major tile written by TMA with 128-byte swizzle:
// rows of 64 bf16 (128 B), 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc_k_major_sw128(const void* tile) {
  const uint64_t addr = smem_addr(tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFF) >> 4;            // start address, 16-byte units
  desc |= uint64_t(1) << 16;                // leading byte offset (unused for this layout)
  desc |= uint64_t(1024 >> 4) << 32;        // stride byte offset: one 8-row group
  desc |= uint64_t(1) << 62;                // layout: 128-byte swizzle
  return desc;
}

// Descriptor of an N-major (MN-major) tile written by TMA with 128-byte swizzle in boxes of
// 64 rows along K x 64 elements along N: `lbo` is the byte distance between 64-element
// groups along N (one box), `sbo` between 8-row groups along K.
__device__ __forceinline__ uint64_t smem_desc_mn_major_sw128(const void* tile, uint32_t lbo,
                                                             uint32_t sbo) {
  const uint64_t addr = smem_addr(tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFF) >> 4;
  desc |= uint64_t((lbo >> 4) & 0x3FFF) << 16;
  desc |= uint64_t((sbo >> 4) & 0x3FFF) << 32;
  desc |= uint64_t(1) << 62;  // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the async MMA.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64xN] (+)= A[64x16] * B[Nx16]^T, bf16 in, fp32 accumulate; A K-major (kTransA = 0) or
// M-major (1) and B K-major (kTransB = 0) or N-major (1), both in shared memory. scale_d = 0
// overwrites D. Each thread holds N/2 accumulators.
// The accumulator operands of the wgmma instructions below, written out once: the asm string
// needs them as literal %n and the constraints as a list. D_0_63 names operands 0..63 (the
// first 64 accumulators), D_64_127 the next 64; ACC64(d, i) binds d[i..i+63].
#define MEGAMOE_WGMMA_D_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MEGAMOE_WGMMA_D_64_127 \
  ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MEGAMOE_WGMMA_ACC8(d, i)                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define MEGAMOE_WGMMA_ACC64(d, i)                                                   \
  MEGAMOE_WGMMA_ACC8(d, i), MEGAMOE_WGMMA_ACC8(d, i + 8), MEGAMOE_WGMMA_ACC8(d, i + 16), \
      MEGAMOE_WGMMA_ACC8(d, i + 24), MEGAMOE_WGMMA_ACC8(d, i + 32),                     \
      MEGAMOE_WGMMA_ACC8(d, i + 40), MEGAMOE_WGMMA_ACC8(d, i + 48), MEGAMOE_WGMMA_ACC8(d, i + 56)

// One specialization of WgmmaBf16 per N: the instruction with its accumulators (OPERANDS,
// the asm numbers; ACCS..., the constraints), PRED the operand number of scale_d, TAIL the
// descriptors' and the transposes'.
#define MEGAMOE_WGMMA_BF16(N, OPERANDS, PRED, TAIL, ...)                                     \
  template <>                                                                              \
  struct WgmmaBf16<N> {                                                                    \
    template <int kTransA, int kTransB>                                                    \
    __device__ static __forceinline__ void mma(float (&d)[N / 2], uint64_t desc_a,         \
                                               uint64_t desc_b, int scale_d) {             \
      asm volatile("{\n"                                                                   \
                   ".reg .pred p;\n"                                                       \
                   "setp.ne.b32 p, " PRED ", 0;\n"                                         \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "             \
                   "{" OPERANDS "}, " TAIL ";\n"                                           \
                   "}\n"                                                                   \
                   : __VA_ARGS__                                                           \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB)); \
    }                                                                                      \
  };

template <int N>
struct WgmmaBf16;
MEGAMOE_WGMMA_BF16(128, MEGAMOE_WGMMA_D_0_63, "%66", "%64, %65, p, 1, 1, %67, %68",
                   MEGAMOE_WGMMA_ACC64(d, 0))
MEGAMOE_WGMMA_BF16(256, MEGAMOE_WGMMA_D_0_63 MEGAMOE_WGMMA_D_64_127, "%130",
                   "%128, %129, p, 1, 1, %131, %132", MEGAMOE_WGMMA_ACC64(d, 0),
                   MEGAMOE_WGMMA_ACC64(d, 64))

#undef MEGAMOE_WGMMA_BF16

// D[64x128] (+)= A[64x32] * B[128x32]^T, e4m3 in, fp32 out, both K-major (FP8 wgmma has no
// transposed operands). The tensor cores keep fewer than fp32's bits while they accumulate:
// the FP8 mainloop runs one k-block per call chain and promotes D into its own fp32 sums.
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               "{" MEGAMOE_WGMMA_D_0_63 "}, %64, %65, p, 1, 1;\n"
               "}\n"
               : MEGAMOE_WGMMA_ACC64(d, 0)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

#undef MEGAMOE_WGMMA_ACC64
#undef MEGAMOE_WGMMA_ACC8
#undef MEGAMOE_WGMMA_D_64_127
#undef MEGAMOE_WGMMA_D_0_63

template <int N, int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d) {
  WgmmaBf16<N>::template mma<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
}

// Moves this warpgroup's register budget up or down (sm_90a); the kernel must be
// compiled with a register cap (__launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace megamoe::sm90
