// What an overlapped combine could buy the FP8 forward, before building one. L2 of a preset
// (30b: 131072 expert-sorted rows, 128 experts of 1024 rows, K = 768, N = 2048; 235b:
// K = 1536, N = 4096; bf16 out, operands from a hash) runs on all SMs but s, beside a
// stand-in combine on s SMs launched on another stream just before it. The stand-in reduces
// a fraction of the combine's bytes (k = 8 random slots, fp32 weights, combine_rows' fma
// order and bits), as a combine that reduces column block j of every token while L2
// computes the later blocks would; the last block stays after L2.
//
// Three stand-ins:
//   - `plain`: a thread per (token, 16-byte vector) item, `frac` of the columns;
//   - `lean`: each thread keeps its vector and loads the next token's slots ahead (fewer
//     instructions, no wait for the index loads before the row loads);
//   - `staged`: the EP combine send's bulk copies into shared memory
//     (comm/staged_row_sums.cuh), every column of `frac` of the tokens (the same bytes).
//
// It prints, medians of `iters` runs in one process:
//   - L2 alone on every SM and on sms - s, combine_rows on every SM, the stand-in alone;
//   - both side by side: the makespan and each stream's own end, and that plus the last
//     block's combine (1 - frac of combine_rows) against L2 + combine_rows;
//   - staged only: the same comparison end to end, interleaved pair by pair with the
//     sequence, so that both see the same power state.
// What L2's N-grouped order costs is not in these figures (branch l2-n-grouped-order's
// probe). Results: PERFLOG, fourth session of 2026-12-06.
//
// Build (after the library's build, against its test archive):
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icsrc -Iinclude \
//     tools/l2_beside_combine.cu build/tests/cpp/libmegamoe_internal_for_tests.a -lcuda \
//     -o build/l2_beside_combine
// Run: build/l2_beside_combine [30b|235b] [frac=0.75] [iters=20] [plain|lean|staged] [s ...=8 16 24 32]
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/staged_row_sums.cuh"
#include "kernels/common/bf16_row.cuh"
#include "kernels/common/combine_rows.h"
#include "kernels/common/sm_count.h"
#include "kernels/sm90/gemm_fp8.h"
#include "check_cuda.h"

namespace {

constexpr int kThreads = 1024;
constexpr int kSlots = 8;

// The k slots' 8 bf16 values each, weighted and summed as combine_rows sums them
// (kernels/common/bf16_row.cuh: fma in slot order from +0, rounded once).
__device__ __forceinline__ uint4 weighted_sum(const uint4 (&val)[kSlots], const float (&p)[kSlots]) {
  float acc[8] = {};
#pragma unroll
  for (int j = 0; j < kSlots; ++j) megamoe::fma_row(acc, p[j], val[j]);
  return megamoe::pack_row(acc);
}

// Columns [v0, v1) (16-byte vectors) of every token: thread per (token, vector), the k
// slots' loads in flight together.
__global__ void __launch_bounds__(kThreads)
    stand_in_combine(const uint4* __restrict__ o, int64_t vecs, int64_t v0, int64_t v1,
                     const int32_t* __restrict__ slot_row, const float* __restrict__ w,
                     int64_t T, uint4* __restrict__ y) {
  extern __shared__ char hold[];  // only to keep the block alone on its SM
  const int64_t width = v1 - v0;
  const int64_t items = T * width;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / width, v = v0 + i % width;
    uint4 val[kSlots];
    float p[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int32_t r = __ldg(slot_row + t * kSlots + j);
      p[j] = __ldg(w + t * kSlots + j);
      val[j] = __ldg(o + r * vecs + v);
    }
    y[t * vecs + v] = weighted_sum(val, p);
  }
  if (threadIdx.x == 0 && T < 0) hold[0] = 1;
}

// The same sums with less in the way of the loads: each thread keeps one vector v of its
// tokens (blockDim a multiple of the width, so no division in the loop), and the next
// token's slot rows and weights are loaded before this token's rows are summed, so the
// rows' loads need not wait behind the index loads.
__global__ void __launch_bounds__(kThreads)
    stand_in_combine_lean(const uint4* __restrict__ o, int vecs, int v0, int width,
                          const int32_t* __restrict__ slot_row, const float* __restrict__ w,
                          int T, uint4* __restrict__ y) {
  extern __shared__ char hold[];
  const int per_pass = blockDim.x / width;
  const int v = v0 + threadIdx.x % width;
  const int step = gridDim.x * per_pass;
  int t = blockIdx.x * per_pass + threadIdx.x / width;
  int r[kSlots];
  float p[kSlots];
  const auto load_slots = [&](int tok) {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      r[j] = tok < T ? __ldg(slot_row + tok * kSlots + j) : 0;
      p[j] = tok < T ? __ldg(w + tok * kSlots + j) : 0.0f;
    }
  };
  load_slots(t);
  for (; t < T; t += step) {
    uint4 val[kSlots];
    float pj[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      val[j] = __ldg(o + int64_t(r[j]) * vecs + v);
      pj[j] = p[j];
    }
    load_slots(t + step);
    y[int64_t(t) * vecs + v] = weighted_sum(val, pj);
  }
  if (threadIdx.x == 0 && T < 0) hold[0] = 1;
}

// The EP combine send's form (comm/staged_row_sums.cuh): a warp per token, its slot rows
// brought into shared memory by bulk copies, which on few SMs beside a GEMM moved 1.4-1.7x
// the bytes of lanes' own loads there. Its stages hold whole 512-byte row pieces, so it
// reduces every column of the first `tokens` tokens: the same bytes as a fraction of the
// columns of every token.
using Staged = megamoe::ep::StagedRowSums<kSlots>;
__global__ void __launch_bounds__(Staged::kThreads, 1)
    stand_in_combine_staged(const __nv_bfloat16* __restrict__ o, int H,
                            const int32_t* __restrict__ slot_row, const float* __restrict__ w,
                            int tokens, __nv_bfloat16* __restrict__ y) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * Staged::kWarps;
  int64_t i = blockIdx.x * int64_t(Staged::kWarps) + threadIdx.x / 32;
  Staged::run(o, H, kSlots, smem, [&]() -> megamoe::ep::StagedToken {
    if (i >= tokens) return {true, -1, 0.f, nullptr};
    const int32_t row = lane < kSlots ? __ldg(slot_row + i * kSlots + lane) : -1;
    const float weight = lane < kSlots ? __ldg(w + i * kSlots + lane) : 0.f;
    __nv_bfloat16* out = y + i * H;
    i += warps;
    return {false, row, weight, out};
  });
}

// A value in [-1, 1) from a hash of the index and a seed.
__device__ __forceinline__ float hashed_unit(int64_t i, uint32_t seed) {
  uint32_t h = (uint32_t(i) ^ seed) * 2654435761u ^ uint32_t(i >> 32);
  h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
  return float(h >> 8) / float(1 << 23) - 1.0f;
}

// x[i] = hashed_unit(i, seed) as T: bf16 slot rows that all differ, for the bitwise check;
// e4m3 operands that vary, which draw the tensor cores' real power and so run L2 at the
// clocks it gets in the layer under the power cap.
template <class T>
__global__ void fill_hash(T* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = T(hashed_unit(i, seed));
  }
}

}  // namespace

int main(int argc, char** argv) {
  // An optional first argument names the preset: 30b (the default) or 235b.
  const std::string preset = argc > 1 && (std::string(argv[1]) == "30b" ||
                                          std::string(argv[1]) == "235b") ? argv[1] : "30b";
  if (argc > 1 && std::string(argv[1]) == preset) { --argc; ++argv; }
  const double frac = argc > 1 ? std::atof(argv[1]) : 0.75;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  const std::string variant = argc > 3 ? argv[3] : "plain";
  const bool lean = variant == "lean", staged = variant == "staged";
  if (!lean && !staged && variant != "plain") {
    std::fprintf(stderr, "variant: expected plain, lean or staged, got %s\n", variant.c_str());
    return 2;
  }
  std::vector<int> side;
  for (int i = 4; i < argc; ++i) side.push_back(std::atoi(argv[i]));
  if (side.empty()) side = {8, 16, 24, 32};

  // L2 of the preset: K = I (moe_intermediate_size), N = H (hidden_size); 128 experts, k = 8.
  const bool big = preset == "235b";
  const int E = 128, per = 1024, K = big ? 1536 : 768, N = big ? 4096 : 2048, T = 16384;
  const int64_t rows = int64_t(E) * per;
  std::vector<int32_t> off(E + 1), tiles(E + 1);
  for (int e = 0; e <= E; ++e) { off[e] = e * per; tiles[e] = e * (per / 128); }
  // Random routing: each token's k slots are k distinct sorted rows, every row used once.
  std::vector<int32_t> slots(rows);
  std::iota(slots.begin(), slots.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<float> weights(rows);
  std::uniform_real_distribution<float> u(0.0f, 0.25f);
  for (auto& x : weights) x = u(rng);

  int32_t *d_off, *d_tiles, *d_slots;
  float *d_w, *a_scales, *b_scales;
  __nv_fp8_e4m3 *a, *b;
  __nv_bfloat16 *c, *y;
  const int64_t a_scale_count = (K / 128) * rows;
  const int64_t b_scale_count = int64_t(E) * (N / 128) * (K / 128);
  CK(cudaMalloc(&d_off, 4 * (E + 1))); CK(cudaMalloc(&d_tiles, 4 * (E + 1)));
  CK(cudaMalloc(&d_slots, 4 * rows)); CK(cudaMalloc(&d_w, 4 * rows));
  CK(cudaMemcpy(d_off, off.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tiles, tiles.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_slots, slots.data(), 4 * rows, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_w, weights.data(), 4 * rows, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&a, rows * K)); CK(cudaMalloc(&b, int64_t(E) * N * K));
  CK(cudaMalloc(&a_scales, 4 * a_scale_count)); CK(cudaMalloc(&b_scales, 4 * b_scale_count));
  CK(cudaMalloc(&c, rows * N * 2)); CK(cudaMalloc(&y, int64_t(T) * N * 2));
  fill_hash<<<1024, 256>>>(a, rows * K, 1u);
  fill_hash<<<1024, 256>>>(b, int64_t(E) * N * K, 2u);
  CK(cudaGetLastError());
  {
    std::vector<float> ones(std::max(a_scale_count, b_scale_count), 1.0f);
    CK(cudaMemcpy(a_scales, ones.data(), 4 * a_scale_count, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_scales, ones.data(), 4 * b_scale_count, cudaMemcpyHostToDevice));
  }
  megamoe::sm90::MGroupedFp8GemmArgs g;
  g.groups = {E, d_off, d_tiles, rows};
  g.a.data = a; g.a.rows = rows; g.a.layout = megamoe::sm90::RowLayout::kSorted;
  g.a.scales = a_scales; g.a.scale_ld = rows;
  g.b.data = b; g.b.scales = b_scales;
  g.b.s_expert = (N / 128) * (K / 128); g.b.s_n = K / 128; g.b.s_k = 1;
  g.k = K; g.n = N;
  g.c = {c, N, rows, megamoe::sm90::RowLayout::kSorted};

  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  constexpr int kHoldBytes = 200 * 1024;
  CK(cudaFuncSetAttribute(stand_in_combine, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          kHoldBytes));
  CK(cudaFuncSetAttribute(stand_in_combine_lean, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          kHoldBytes));
  CK(cudaFuncSetAttribute(stand_in_combine_staged, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          Staged::kSharedBytes));
  cudaEvent_t start, end0, end1, l2_end;
  CK(cudaEventCreate(&start)); CK(cudaEventCreate(&end0)); CK(cudaEventCreate(&end1));
  CK(cudaEventCreate(&l2_end));
  const int sms = megamoe::sm_count();
  const int64_t vecs = N / 8;
  const int64_t v1 = std::max<int64_t>(1, std::min<int64_t>(vecs, int64_t(frac * vecs + 0.5)));
  // The staged stand-in's share as tokens: the same fraction of the bytes.
  const int staged_tokens = int(int64_t(T) * v1 / vecs);

  // gemm_sms 0: no L2; combine_sms 0: no stand-in; real: combine_rows on every SM instead.
  // Also the medians of each stream's own end (L2's, the combine's), from the same start.
  double l2_done = 0, combine_done = 0;
  // The variant's stand-in on `blocks` SMs (one block each), on s1.
  const auto launch_stand_in = [&](int blocks) {
    if (staged) {
      stand_in_combine_staged<<<blocks, Staged::kThreads, Staged::kSharedBytes, s1>>>(
          c, N, d_slots, d_w, staged_tokens, y);
    } else if (lean) {
      const int width = int(v1), threads = (kThreads / width) * width;
      stand_in_combine_lean<<<blocks, threads, kHoldBytes, s1>>>(
          reinterpret_cast<const uint4*>(c), int(vecs), 0, width, d_slots, d_w, T,
          reinterpret_cast<uint4*>(y));
    } else {
      stand_in_combine<<<blocks, kThreads, kHoldBytes, s1>>>(
          reinterpret_cast<const uint4*>(c), vecs, 0, v1, d_slots, d_w, T,
          reinterpret_cast<uint4*>(y));
    }
    CK(cudaGetLastError());
  };
  const auto run = [&](int gemm_sms, int combine_sms, bool real) {
    std::vector<float> us, l2_us, c_us;
    for (int i = 0; i < iters + 3; ++i) {
      CK(cudaEventRecord(start, s0));
      CK(cudaStreamWaitEvent(s1, start, 0));
      if (combine_sms > 0) launch_stand_in(combine_sms);
      if (real) megamoe::combine_rows(c, N, d_slots, d_w, false, T, kSlots, y, s1);
      CK(cudaEventRecord(end1, s1));
      if (gemm_sms > 0) {
        const megamoe::SmLimit cap(gemm_sms);
        megamoe::sm90::m_grouped_fp8_gemm_nt(g, s0);
      }
      CK(cudaEventRecord(l2_end, s0));
      CK(cudaStreamWaitEvent(s0, end1, 0));
      CK(cudaEventRecord(end0, s0));
      CK(cudaStreamSynchronize(s0));
      float t; CK(cudaEventElapsedTime(&t, start, end0));
      float tl, tc;
      CK(cudaEventElapsedTime(&tl, start, l2_end)); CK(cudaEventElapsedTime(&tc, start, end1));
      if (i >= 3) { us.push_back(t * 1000); l2_us.push_back(tl * 1000); c_us.push_back(tc * 1000); }
    }
    const auto median = [](std::vector<float>& v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    l2_done = median(l2_us);
    combine_done = median(c_us);
    return median(us);
  };

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double l2 = run(sms, 0, false);
  const double combine = run(0, 0, true);
  const double stand_all = run(0, sms, false);
  // The stand-in's sums must be combine_rows' on its columns (bitwise: the same fma order),
  // so that it is known to move the same bytes. c gets distinct values for the check.
  {
    fill_hash<<<1024, 256, 0, s0>>>(c, rows * N, 0u);
    CK(cudaGetLastError());
    std::vector<uint16_t> want(int64_t(T) * N), got(int64_t(T) * N);
    megamoe::combine_rows(c, N, d_slots, d_w, false, T, kSlots, y, s0);
    CK(cudaMemcpyAsync(want.data(), y, want.size() * 2, cudaMemcpyDeviceToHost, s0));
    CK(cudaMemsetAsync(y, 0xff, want.size() * 2, s0));
    CK(cudaStreamSynchronize(s0));
    run(0, sms, false);
    CK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    const int64_t check_tokens = staged ? staged_tokens : T, check_cols = staged ? N : v1 * 8;
    for (int64_t t = 0; t < check_tokens; ++t)
      for (int64_t col = 0; col < check_cols; ++col) bad += want[t * N + col] != got[t * N + col];
    std::printf("stand-in sums against combine_rows' on its %lld tokens x %lld columns: %lld "
                "differ\n", (long long)check_tokens, (long long)check_cols, (long long)bad);
  }
  if (staged) {
    std::printf("%s, %d SMs; %s; stand-in staged; tokens reduced beside L2: %d of %d (frac "
                "%.3f)\n", prop.name, sms, preset.c_str(), staged_tokens, T,
                double(staged_tokens) / T);
  } else {
    std::printf("%s, %d SMs; %s; stand-in %s; columns reduced beside L2: %lld of %lld (frac "
                "%.3f)\n", prop.name, sms, preset.c_str(), variant.c_str(), (long long)v1 * 8,
                (long long)N, double(v1) / vecs);
  }
  std::printf("L2 alone %.1f us; combine_rows alone %.1f us; stand-in on every SM for its "
              "share %.1f us\n", l2, combine, stand_all);
  std::printf("L2 + combine in sequence: %.1f us\n", l2 + combine);
  std::printf("%4s %10s %14s %12s %9s %14s %10s %18s\n", "s", "L2 on rest", "stand-in on s",
              "side by side", "L2 ends", "stand-in ends", "+ last", "gain vs sequence");
  for (int s : side) {
    if (s <= 0 || s >= sms) continue;
    const double l2_rest = run(sms - s, 0, false);
    const double stand = run(0, s, false);
    const double both = run(sms - s, s, false);
    const double rest = combine * (1.0 - double(v1) / vecs);
    std::printf("%4d %10.1f %14.1f %12.1f %9.1f %14.1f %10.1f %18.1f\n", s, l2_rest, stand,
                both, l2_done, combine_done, both + rest, l2 + combine - (both + rest));
  }
  if (!staged) return 0;

  // The same comparison end to end and interleaved, so that both sides see the same power
  // state (under the cap, L2 alone on the same SMs moved by 10-15% between configurations
  // timed seconds apart in one process):
  // each iteration times the sequence (L2 on every SM, then combine_rows over every token)
  // and then the overlap (the staged stand-in on s SMs for its tokens beside L2 on the
  // rest, then combine_rows over the remaining tokens on every SM), from one event to the
  // next on s0.
  const auto time_of = [&](auto&& work) {
    CK(cudaEventRecord(start, s0));
    work();
    CK(cudaEventRecord(end0, s0));
    CK(cudaStreamSynchronize(s0));
    float t; CK(cudaEventElapsedTime(&t, start, end0));
    return t * 1000;
  };
  std::printf("interleaved, medians of %d pairs: %4s %12s %12s %10s\n", iters, "s", "sequence",
              "overlap", "gain");
  for (int s : side) {
    if (s <= 0 || s >= sms) continue;
    std::vector<float> seq, ovl;
    for (int i = 0; i < iters + 3; ++i) {
      const float a = time_of([&] {
        megamoe::sm90::m_grouped_fp8_gemm_nt(g, s0);
        megamoe::combine_rows(c, N, d_slots, d_w, false, T, kSlots, y, s0);
      });
      const float b = time_of([&] {
        CK(cudaStreamWaitEvent(s1, start, 0));
        launch_stand_in(s);
        CK(cudaEventRecord(end1, s1));
        {
          const megamoe::SmLimit cap(sms - s);
          megamoe::sm90::m_grouped_fp8_gemm_nt(g, s0);
        }
        CK(cudaStreamWaitEvent(s0, end1, 0));
        if (staged_tokens < T) {
          megamoe::combine_rows(c, N, d_slots + int64_t(staged_tokens) * kSlots,
                                d_w + int64_t(staged_tokens) * kSlots, false, T - staged_tokens,
                                kSlots, y + int64_t(staged_tokens) * N, s0);
        }
      });
      if (i >= 3) { seq.push_back(a); ovl.push_back(b); }
    }
    std::sort(seq.begin(), seq.end());
    std::sort(ovl.begin(), ovl.end());
    const float m_seq = seq[seq.size() / 2], m_ovl = ovl[ovl.size() / 2];
    std::printf("interleaved, medians of %d pairs: %4d %12.1f %12.1f %10.1f\n", iters, s, m_seq,
                m_ovl, m_seq - m_ovl);
  }
  return 0;
}
