// Which mbarrier orderings compute-sanitizer's racecheck sees. The grouped GEMM's tile
// passing in miniature: one producer thread writes a tile's slot into the first stage of each
// tile and an end marker after the last, the two consumer warpgroups read the slot after the
// stage's full barrier and hand each stage back on its empty barrier. Every access is ordered
// by the PTX memory model (mbarrier.arrive is release, try_wait acquire, both at CTA scope),
// so each hazard racecheck reports here is one it cannot see through.
//
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//     tools/racecheck_probe.cu -o build/racecheck_probe
//   compute-sanitizer --tool racecheck build/racecheck_probe MODE
//
// Findings (one H100, performance log, fifth session of 2026-12-05): plain 1 hazard (the
// slot's reads against every rewrite), per-thread and leader clean, tx and tx-end 4 (the
// landing buffer's reads too: the bulk copy's write is put on the issuing thread).
//
// MODE (how a stage's full barrier completes; how the consumers release a stage):
//   plain      every stage: the producer's mbarrier.arrive; releases: warp leaders
//   per-thread as plain, releases: every consumer thread
//   tx         tile stages: arrive.expect_tx and a 16-byte cp.async.bulk (as the GEMM's
//              TMA); the end marker: mbarrier.arrive (as the GEMM); releases: warp leaders
//   tx-end     as tx, and the end marker too comes with expect_tx and a copy
//   leader     as plain, but each warp's leader reads the slot and passes it to its lanes
//              by shuffles: the thread that reads is the thread that arrives
#include <cstdio>
#include <cstring>

#include "kernels/sm90/primitives.cuh"

using namespace megamoe::sm90;

namespace {

constexpr int kStages = 4, kTiles = 24, kBlocksPerTile = 3;
enum Mode { kPlain, kPerThread, kTx, kTxEnd, kLeader };

struct Slot {
  int tile, a, b, c;
};

__global__ void probe(int mode, const int4* src, int* out) {
  __shared__ uint64_t full[kStages], empty[kStages];
  __shared__ Slot slot[kStages];
  __shared__ __align__(16) int4 landing[kStages];
  const bool per_thread = mode == kPerThread;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], per_thread ? 256 : 8);
    }
    fence_barrier_init();
  }
  __syncthreads();
  int stage = 0;
  uint32_t phase = 0;
  const auto advance = [&] {
    if (++stage == kStages) stage = 0, phase ^= 1;
  };
  if (threadIdx.x < 128) {
    if (threadIdx.x != 0) return;
    const auto fill = [&](bool with_copy) {
      if (with_copy) {
        mbarrier_arrive_expect_tx(&full[stage], 16);
        bulk_load_1d(&landing[stage], src, 16, &full[stage]);
      } else {
        mbarrier_arrive(&full[stage]);
      }
    };
    const bool tx = mode == kTx || mode == kTxEnd;
    for (int t = 0; t < kTiles; ++t) {
      for (int kb = 0; kb < kBlocksPerTile; ++kb) {
        mbarrier_wait(&empty[stage], phase ^ 1);
        if (kb == 0) slot[stage] = Slot{t, t + 1, t + 2, t + 3};
        fill(tx);
        advance();
      }
    }
    mbarrier_wait(&empty[stage], phase ^ 1);
    slot[stage] = Slot{-1, 0, 0, 0};
    fill(mode == kTxEnd);
    return;
  }
  int sum = 0;
  for (;;) {
    mbarrier_wait(&full[stage], phase);
    Slot t = mode == kLeader && threadIdx.x % 32 != 0 ? Slot{} : slot[stage];
    if (mode == kLeader) {
      t.tile = __shfl_sync(~0u, t.tile, 0);
      t.a = __shfl_sync(~0u, t.a, 0);
      t.b = __shfl_sync(~0u, t.b, 0);
      t.c = __shfl_sync(~0u, t.c, 0);
    }
    if (t.tile < 0) break;
    sum += t.a + t.b + t.c;
    for (int kb = 0; kb < kBlocksPerTile; ++kb) {
      mbarrier_wait(&full[stage], phase);
      sum += landing[stage].x;
      __threadfence_block();
      __syncwarp();
      if (per_thread || threadIdx.x % 32 == 0) mbarrier_arrive(&empty[stage]);
      advance();
    }
  }
  atomicAdd(out, sum);
}

}  // namespace

int main(int argc, char** argv) {
  const char* names[] = {"plain", "per-thread", "tx", "tx-end", "leader"};
  int mode = -1;
  for (int m = 0; m < 5; ++m) {
    if (argc > 1 && std::strcmp(argv[1], names[m]) == 0) mode = m;
  }
  if (mode < 0) {
    std::fprintf(stderr, "usage: racecheck_probe plain|per-thread|tx|tx-end|leader\n");
    return 2;
  }
  int4* src;
  int* out;
  cudaMalloc(&src, sizeof(int4));
  cudaMalloc(&out, sizeof(int));
  cudaMemset(src, 0, sizeof(int4));
  cudaMemset(out, 0, sizeof(int));
  probe<<<2, 384>>>(mode, src, out);
  int sum = 0;
  cudaMemcpy(&sum, out, sizeof(int), cudaMemcpyDeviceToHost);
  // Per consumer thread: the sum over tiles of 3t + 6; 512 consumer threads.
  const int expect = 512 * (3 * kTiles * (kTiles - 1) / 2 + 6 * kTiles);
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("%s: %s, sum %d (expected %d)\n", names[mode], cudaGetErrorString(err), sum,
              expect);
  return err == cudaSuccess && sum == expect ? 0 : 1;
}
