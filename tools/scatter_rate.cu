// What DRAM gives the to-rows pass's traffic, with no quantization: each of T = 16384
// tokens' H = 2048 bf16 values read once (4 KiB) and k = 8 rows of H bytes written (the
// e4m3 rows' size) to the token's slots in the expert-sorted order: a random permutation of
// the 131072 rows, as random routing gives, or in token order (slot rows t * k + j), against
// the same bytes read alone and written alone. The FP8 to-rows quantizer
// (quantize_fp8_to_rows) moves this traffic plus 4-byte scales at 2.5-2.7 TB/s; this says
// how far that is from what the pattern itself allows (performance log, fifteenth session
// of 2026-12-04). The warp-per-row quantizer with these stores was no faster than the tile
// kernel, so the quantizing itself holds the pass back; the rows below take it apart: the
// same scatter with 8-byte stores (the e4m3 pieces' width), with the 1x128 maxima and the
// e4m3 rounding of fp8_recipe.cuh (16 lanes a block, 4 shuffles), with the 4-byte scales
// stored as the GEMMs read them (scale of row r's block j at scales[j * ld + r], lanes 0-15
// one block each), and with both: the quantizer's traffic and work, without its tiling.
// Last, the scales of a row stored together (64 bytes a row) and transposed into the GEMMs'
// layout by a pass of their own, timed apart: what that layout would cost and give back.
// A random permutation of the rows is the worst case for both stores. The layer's routing
// plan sorts stably, so a token's expert-sorted rows follow the rows of the tokens before it
// that chose the same expert: neighbouring tokens write neighbouring rows and scales (with
// 128 experts, runs of about 8 rows per expert per 128 tokens). The "routed" rows use
// destinations made that way from a random top-8 of 128 experts per token, as the layer's
// random routing gives them.
//
// Build (nothing to link):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc tools/scatter_rate.cu \
//     -o build/scatter_rate
// Run: build/scatter_rate [iters=20]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "check_cuda.h"
#include "kernels/common/fp8_recipe.cuh"
#include "rate_util.cuh"

namespace {

constexpr int64_t kT = 16384, kK = 8, kH = 2048;
constexpr int kThreads = 256;
constexpr int kIn = kH * 2 / 16 / 32;   // 16-byte loads a lane per token (8)
constexpr int kOut = kH / 16 / 32;      // 16-byte stores a lane per row (4)

constexpr int kBlocks = kH / 128;       // 1x128 blocks a row (16)
constexpr int64_t kScaleLd = kT * kK;   // scales[j * kScaleLd + r]: the sorted rows' count
constexpr int kRoutedExperts = 128;     // the presets' E

enum Mode {
  kCopy, kWriteOnly, kReadOnly, kCopy8, kCopyScales, kQuantize, kQuantizeScales,
  kQuantizeRowScales  // the scales of a row together (scales[r * kBlocks + j]): 64 bytes a row
};

// kQuantize*: the 1x128 blocks of this lane's 8 pieces (piece i * 32 + lane holds columns
// 8 (i * 32 + lane) .. + 7, so block 2 i + lane / 16 is held by the 16 lanes of a half-warp)
// rounded to e4m3 as quantize_fp8 does, 8 bytes a piece; scale[i] is block 2 i + lane / 16's.
__device__ __forceinline__ void quantize_pieces(const uint4 (&v)[kIn], uint2 (&q)[kIn],
                                                float (&scale)[kIn]) {
#pragma unroll
  for (int i = 0; i < kIn; ++i) {
    uint32_t m = megamoe::max_of_halves(megamoe::max_halves(
        megamoe::max_halves(v[i].x & megamoe::kBf16AbsMask2, v[i].y & megamoe::kBf16AbsMask2),
        megamoe::max_halves(v[i].z & megamoe::kBf16AbsMask2, v[i].w & megamoe::kBf16AbsMask2)));
#pragma unroll
    for (int off = 1; off < 16; off *= 2) m = max(m, __shfl_xor_sync(~0u, m, off));
    const megamoe::Fp8BlockScale s = megamoe::fp8_block_scale_bf16(m);
    q[i] = make_uint2(megamoe::fp8_quad(v[i].x, v[i].y, s.r, s.r, s.r, s.r),
                      megamoe::fp8_quad(v[i].z, v[i].w, s.r, s.r, s.r, s.r));
    scale[i] = s.scale;
  }
}

// One warp per token: its row's loads all in flight, then its k rows' stores (in the copy
// modes each lane's 64 bytes of a row from its first loads: the bytes are not what is
// measured).
template <Mode kMode>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ dest,
                   uint4* __restrict__ rows, float* __restrict__ scales,
                   int32_t* __restrict__ sink) {
  constexpr bool kQuantized =
      kMode == kQuantize || kMode == kQuantizeScales || kMode == kQuantizeRowScales;
  constexpr bool kScales =
      kMode == kCopyScales || kMode == kQuantizeScales || kMode == kQuantizeRowScales;
  constexpr bool kNarrow = kMode == kCopy8 || kQuantized;  // 8-byte stores
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  uint32_t acc = 0;
  for (int64_t t = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; t < kT; t += warps) {
    uint4 v[kIn];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      v[i] = kMode == kWriteOnly ? make_uint4(uint32_t(t), i, lane, 1)
                                 : x[t * (kH * 2 / 16) + i * 32 + lane];
    }
    if constexpr (kMode == kReadOnly) {
#pragma unroll
      for (int i = 0; i < kIn; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      continue;
    }
    uint2 q[kIn];
    float scale[kIn];
    if constexpr (kQuantized) {
      quantize_pieces(v, q, scale);
    } else {
#pragma unroll
      for (int i = 0; i < kIn; ++i) {
        q[i] = make_uint2(v[i].x ^ v[i].z, v[i].y ^ v[i].w);
        scale[i] = __uint_as_float(v[i].x);
      }
    }
    // Lanes 0-15 store the scales, lane b block b's: it is scale[b / 2] of the half-warp
    // b % 2 * 16 .. (the quantizer's "lanes 0-15 one block each").
    float my_scale = 0.f;
    if constexpr (kScales) {
#pragma unroll
      for (int i = 0; i < kIn; ++i) {
        const float si = __shfl_sync(~0u, scale[i], lane % 2 * 16);
        if (lane / 2 == i) my_scale = si;
      }
    }
    const int32_t my_dest = lane < kK ? dest[t * kK + lane] : 0;
    for (int j = 0; j < kK; ++j) {
      const int64_t r = __shfl_sync(0xffffffffu, my_dest, j);
      if constexpr (kNarrow) {
        uint2* row = reinterpret_cast<uint2*>(rows) + r * (kH / 8);
#pragma unroll
        for (int i = 0; i < kIn; ++i) row[i * 32 + lane] = q[i];
      } else {
#pragma unroll
        for (int i = 0; i < kOut; ++i) rows[r * (kH / 16) + i * 32 + lane] = v[i];
      }
      if constexpr (kScales) {
        if (lane < kBlocks) {
          scales[kMode == kQuantizeRowScales ? r * kBlocks + lane : lane * kScaleLd + r] = my_scale;
        }
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = 1;  // keeps the read-only loads
}

// kQuantizeRowScales' scales put where the GEMMs read them: [r][j] -> [j][r], a 32 x 16
// tile of rows per warp (the pass this layout would need after the to-rows kernel).
__global__ void __launch_bounds__(kThreads)
    transpose_scales_kernel(const float* __restrict__ by_row, float* __restrict__ by_block) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t r0 = (blockIdx.x * int64_t(kThreads / 32) + threadIdx.x / 32) * 32; r0 < kScaleLd;
       r0 += warps * 32) {
    float v[kBlocks];
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) v[j] = by_row[(r0 + lane) * kBlocks + j];
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) by_block[j * kScaleLd + r0 + lane] = v[j];
  }
}

template <Mode kMode>
void time_mode(const char* what, const uint4* x, const int32_t* dest, uint4* rows,
               float* scales, int32_t* sink, int blocks, int iters) {
  const double us = rate_util::median_us(
      [&] { scatter_kernel<kMode><<<blocks, kThreads>>>(x, dest, rows, scales, sink); }, iters,
      3);
  const double read = kMode == kWriteOnly ? 0 : kT * kH * 2.0;
  const bool with_scales =
      kMode == kCopyScales || kMode == kQuantizeScales || kMode == kQuantizeRowScales;
  const double written = kMode == kReadOnly ? 0 : kT * kK * (kH + (with_scales ? kBlocks * 4 : 0));
  std::printf("%-34s %4d blocks  %7.1f us  read %5.1f MiB  written %6.1f MiB  %6.2f TB/s\n",
              what, blocks, us, read / (1 << 20), written / (1 << 20),
              (read + written) / (us * 1e6));
}

// e4m3 (bias 7, no infinities, 0x7F / 0xFF NaN) to float.
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

float bf16_value(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// kQuantizeScales' output against x for every 97th token: each block's scale is
// max(amax, 2^-100) / 448 (fp32 division, as fp8_recipe.cuh) and each value's e4m3 times it
// is within half an e4m3 step of x (a relative 2^-4, or 2^-10 of the scale below the normal
// range). Returns the number of mismatches.
int check_quantized(const uint4* x_dev, const int32_t* dest_dev, const uint4* rows_dev,
                    const float* scales_dev) {
  std::vector<uint16_t> x(kT * kH);
  std::vector<int32_t> dest(kT * kK);
  std::vector<uint8_t> rows(kT * kK * kH);
  std::vector<float> scales(kBlocks * kScaleLd);
  CK(cudaMemcpy(x.data(), x_dev, x.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dest.data(), dest_dev, dest.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rows.data(), rows_dev, rows.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(scales.data(), scales_dev, scales.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int64_t t = 0; t < kT; t += 97) {
    for (int b = 0; b < kBlocks; ++b) {
      float amax = 0.f;
      for (int c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(bf16_value(x[t * kH + b * 128 + c])));
      const float scale = std::max(amax, 0x1p-100f) / 448.f;
      for (int j = 0; j < kK; ++j) {
        const int64_t r = dest[t * kK + j];
        bad += scales[b * kScaleLd + r] != scale;
        for (int c = 0; c < 128; ++c) {
          const float v = bf16_value(x[t * kH + b * 128 + c]);
          const float got = e4m3_value(rows[r * kH + b * 128 + c]) * scale;
          bad += !(std::fabs(got - v) <= std::fabs(v) * 0x1p-4f + scale * 0x1p-10f);
        }
      }
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int sms = rate_util::sm_count();
  uint4 *x, *rows;
  float* scales;
  int32_t *dest_random, *dest_ordered, *dest_routed, *sink;
  CK(cudaMalloc(&x, kT * kH * 2));
  CK(cudaMalloc(&rows, kT * kK * kH));
  CK(cudaMalloc(&scales, kBlocks * kScaleLd * 4));
  CK(cudaMalloc(&dest_random, kT * kK * 4));
  CK(cudaMalloc(&dest_ordered, kT * kK * 4));
  CK(cudaMalloc(&dest_routed, kT * kK * 4));
  CK(cudaMalloc(&sink, 4));
  // Values in (-1, 1): the quantizing modes' maxima and scales see a model's kind of rows.
  rate_util::fill_rows<<<4 * sms, 256>>>(reinterpret_cast<__nv_bfloat16*>(x), kT * kH, 7);
  CK(cudaGetLastError());
  std::vector<int32_t> perm(kT * kK);
  std::iota(perm.begin(), perm.end(), 0);
  CK(cudaMemcpy(dest_ordered, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  std::shuffle(perm.begin(), perm.end(), std::mt19937(12345));
  CK(cudaMemcpy(dest_random, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<int32_t> routed = rate_util::routed_rows(kT, kK, kRoutedExperts, 12345);
  CK(cudaMemcpy(dest_routed, routed.data(), routed.size() * 4, cudaMemcpyHostToDevice));
  for (const int per_sm : {2, 4, 8}) {
    const int blocks = per_sm * sms;
    const auto timed = [&](auto mode, const char* what, const int32_t* dest) {
      time_mode<decltype(mode)::value>(what, x, dest, rows, scales, sink, blocks, iters);
    };
    // The same traffic to each kind of destinations, bare and then quantized.
    const auto stores = [&](const int32_t* dest, const std::string& routing) {
      const auto row = [&](auto mode, const char* what) {
        timed(mode, (routing + ", " + what).c_str(), dest);
      };
      row(std::integral_constant<Mode, kCopy>{}, "read + scattered rows");
      row(std::integral_constant<Mode, kCopy8>{}, "8-byte stores");
      row(std::integral_constant<Mode, kCopyScales>{}, "+ 4-byte scales");
      row(std::integral_constant<Mode, kQuantize>{}, "quantized (1x128, e4m3)");
      row(std::integral_constant<Mode, kQuantizeScales>{}, "quantized + scales");
      row(std::integral_constant<Mode, kQuantizeRowScales>{}, "quantized + scales by row");
    };
    stores(dest_random, "random");
    timed(std::integral_constant<Mode, kCopy>{}, "read + rows in token order", dest_ordered);
    timed(std::integral_constant<Mode, kWriteOnly>{}, "scattered rows only (random)", dest_random);
    timed(std::integral_constant<Mode, kReadOnly>{}, "read only", dest_random);
    stores(dest_routed, "routed");
  }
  // The transpose the by-row scales would need (8 MiB read, 8 MiB written).
  float* by_row;
  CK(cudaMalloc(&by_row, kBlocks * kScaleLd * 4));
  scatter_kernel<kQuantizeRowScales><<<4 * sms, kThreads>>>(x, dest_random, rows, by_row, sink);
  const double transpose_us = rate_util::median_us(
      [&] { transpose_scales_kernel<<<4 * sms, kThreads>>>(by_row, scales); }, iters, 3);
  std::printf("%-34s %4d blocks  %7.1f us\n", "by-row scales transposed", 4 * sms, transpose_us);
  // The last rows written are kQuantizeRowScales' (same values as kQuantizeScales'), their
  // scales transposed into the GEMMs' layout: both paths checked at once.
  const int bad = check_quantized(x, dest_random, rows, scales);
  std::printf("quantized + scales by row, transposed, against x: %s (%d mismatches)\n",
              bad ? "FAILED" : "ok", bad);
  CK(cudaFree(by_row));
  CK(cudaFree(x)); CK(cudaFree(rows)); CK(cudaFree(scales)); CK(cudaFree(dest_random));
  CK(cudaFree(dest_ordered)); CK(cudaFree(dest_routed)); CK(cudaFree(sink));
  return bad ? 1 : 0;
}
