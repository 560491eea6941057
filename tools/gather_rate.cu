// What the memory system gives the gathered column quantizer's traffic
// (quantize_fp8_columns_gathered: x or p dy into the weight gradients' token-contiguous
// e4m3 copies), with no quantization. That pass reads, for each 128 x 128 tile of the
// expert-sorted rows, the tile's 128 token rows' 256 bytes of one 128-column stripe of the
// bf16 token matrix x [T, H], gathered through the routing plan, and writes the tile's
// 16 KiB of e4m3 columns (128 contiguous bytes a column). Each token row is read k = 8
// times, once for each of its sorted rows, so the pass moves about T k H 2 bytes of reads
// and T k H of writes through L2 while DRAM needs only T H 2 and T k H: at 30b about 850 MB
// an operand against 380 MB. Its tiles go stripe by stripe, so that the CTAs at work read
// one or two stripes of x (4 MiB at T = 16384), which L2 holds across their k reads.
//
// The layer's pass takes 212 us an operand at 30b (H200): 4.0 TB/s of L2 traffic, 1.8 TB/s
// of DRAM bytes (performance log, eighth session of 2026-12-05). These rows say what the
// traffic itself allows, one tile per CTA at a time with all of a thread's 8 loads in
// flight and 2 to 8 CTAs per SM:
//   - the gathered reads alone, stripe by stripe (the pass's order) and tile row by tile row
//     (every stripe of a row block in turn: each token row read whole, k times far apart);
//   - the gathered reads and the tile's 16 KiB of writes (the pass's traffic);
//   - the same traffic with the rows read in order from a [T k, H] matrix (no gather: what
//     the plain column quantizer of a bf16 sorted copy moves, as a's columns do).
// The rows are the sorted rows of a random top-8 routing over 128 experts (rate_util's
// routed_rows, the layer's stable sort), without the padding of each expert's last tile.
//
// Build (nothing to link):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc tools/gather_rate.cu \
//     -o build/gather_rate
// Run: build/gather_rate [iters=20]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check_cuda.h"
#include "rate_util.cuh"

namespace {

constexpr int64_t kT = 16384, kK = 8, kRows = kT * kK;
constexpr int kExperts = 128;
constexpr int kThreads = 256;
constexpr int kTile = 128;
constexpr int kColGroups = 16;   // 16 lanes x 8 bf16 = a tile's 128 columns
constexpr int kRowsPerThread = 8;

enum Mode { kGatherReads, kGatherReadsRowOrder, kGatherTraffic, kSortedTraffic };

// Tile `tile` as (row block, stripe): stripe by stripe, or row block by row block.
template <Mode kMode>
__device__ __forceinline__ void tile_of(int64_t tile, int64_t row_blocks, int64_t stripes,
                                        int64_t& block, int64_t& stripe) {
  if constexpr (kMode == kGatherReadsRowOrder) {
    block = tile / stripes;
    stripe = tile % stripes;
  } else {
    block = tile % row_blocks;
    stripe = tile / row_blocks;
  }
}

// Each thread: 8 rows x 8 columns of its tile (16 bytes a row), all 8 loads issued before
// any is used; then, with writes, 4 of the tile's 16-byte pieces of e4m3 columns (column c
// of the stripe at out[(stripe * 128 + c) * rows + block * 128 ...]) made from the loaded
// words: the bytes are not what is measured, but the stores wait for the loads.
template <Mode kMode>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ row_token,
                  int64_t hidden, uint8_t* __restrict__ out, uint32_t* __restrict__ sink) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
  const int64_t row_blocks = kRows / kTile, stripes = hidden / kTile;
  const int64_t row_pieces = hidden / 8;  // 16-byte pieces of a bf16 row
  uint32_t acc = 0;
  for (int64_t tile = blockIdx.x; tile < row_blocks * stripes; tile += gridDim.x) {
    int64_t block, stripe;
    tile_of<kMode>(tile, row_blocks, stripes, block, stripe);
    const int64_t row0 = block * kTile + rg * kRowsPerThread;
    uint4 v[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t src = kMode == kSortedTraffic ? row0 + i : __ldg(&row_token[row0 + i]);
      v[i] = x[src * row_pieces + stripe * kColGroups + cg];
    }
    uint4 folded = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      folded.x ^= v[i].x; folded.y ^= v[i].y; folded.z ^= v[i].z; folded.w ^= v[i].w;
    }
    if constexpr (kMode == kGatherReads || kMode == kGatherReadsRowOrder) {
      acc ^= folded.x ^ folded.y ^ folded.z ^ folded.w;
    } else {
      uint8_t* tb = out + stripe * kTile * kRows + block * kTile;
#pragma unroll
      for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
        const int idx = threadIdx.x + k * kThreads, c = idx / 8, m = idx % 8;
        *reinterpret_cast<uint4*>(tb + c * kRows + 16 * m) = folded;
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = 1;  // keeps the read-only loads
}

template <Mode kMode>
void time_mode(const char* what, int64_t hidden, const uint4* x, const int32_t* row_token,
               const uint4* x_sorted, uint8_t* out, uint32_t* sink, int blocks, int iters) {
  const bool writes = kMode == kGatherTraffic || kMode == kSortedTraffic;
  const double us = rate_util::median_us(
      [&] {
        gather_kernel<kMode><<<blocks, kThreads>>>(kMode == kSortedTraffic ? x_sorted : x,
                                                   row_token, hidden, out, sink);
      },
      iters, 3);
  const double reads = kRows * hidden * 2.0, written = writes ? kRows * hidden * 1.0 : 0.0;
  // The least DRAM bytes: x once (the sorted copy whole), the writes once.
  const double dram = (kMode == kSortedTraffic ? reads : kT * hidden * 2.0) + written;
  std::printf("H %5lld  %-40s %4d blocks  %7.1f us  through L2 %6.1f MiB %5.2f TB/s  "
              "least DRAM %6.1f MiB %5.2f TB/s\n",
              static_cast<long long>(hidden), what, blocks, us, (reads + written) / (1 << 20),
              (reads + written) / (us * 1e6), dram / (1 << 20), dram / (us * 1e6));
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int sms = rate_util::sm_count();
  // row_token of the sorted rows: the inverse of each slot's row.
  const std::vector<int32_t> slot_row = rate_util::routed_rows(kT, kK, kExperts, 12345);
  std::vector<int32_t> token(kRows);
  for (int64_t s = 0; s < kRows; ++s) token[slot_row[s]] = static_cast<int32_t>(s / kK);
  int32_t* row_token;
  uint32_t* sink;
  CK(cudaMalloc(&row_token, kRows * 4));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemcpy(row_token, token.data(), kRows * 4, cudaMemcpyHostToDevice));
  for (const int64_t hidden : {int64_t(2048), int64_t(4096)}) {  // the presets' H
    uint4 *x, *x_sorted;
    uint8_t* out;
    CK(cudaMalloc(&x, kT * hidden * 2));
    CK(cudaMalloc(&x_sorted, kRows * hidden * 2));
    CK(cudaMalloc(&out, kRows * hidden));
    rate_util::fill_rows<<<4 * sms, 256>>>(reinterpret_cast<__nv_bfloat16*>(x), kT * hidden, 7);
    rate_util::fill_rows<<<4 * sms, 256>>>(reinterpret_cast<__nv_bfloat16*>(x_sorted),
                                           kRows * hidden, 8);
    CK(cudaGetLastError());
    for (const int per_sm : {2, 3, 4, 8}) {
      const int blocks = per_sm * sms;
      const auto timed = [&](auto mode, const char* what) {
        time_mode<decltype(mode)::value>(what, hidden, x, row_token, x_sorted, out, sink,
                                         blocks, iters);
      };
      timed(std::integral_constant<Mode, kGatherReads>{}, "gathered reads, stripe by stripe");
      timed(std::integral_constant<Mode, kGatherReadsRowOrder>{}, "gathered reads, row block by row block");
      timed(std::integral_constant<Mode, kGatherTraffic>{}, "gathered reads + column writes");
      timed(std::integral_constant<Mode, kSortedTraffic>{}, "sorted rows in order + column writes");
    }
    CK(cudaFree(x)); CK(cudaFree(x_sorted)); CK(cudaFree(out));
  }
  CK(cudaFree(row_token)); CK(cudaFree(sink));
  return 0;
}
