// megamoe::combine_rows (internal, csrc/kernels/common/combine_rows.h) on a GPU against a
// CPU loop. The kernel is an exact function of its inputs (an fp32 fma chain in slot order
// rounded once to bf16), so results are compared bit for bit. GPU tests skip without a GPU;
// the argument checks run everywhere.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/common/combine_rows.h"
#include "kernels/common/routing_plan.h"

namespace {

using megamoe_test::expect_invalid;
using megamoe_test::fresh_seed;

constexpr int64_t kGuardRows = 2;     // rows after every bf16 output, must stay poisoned
constexpr uint16_t kPoisonBits = 0xffff;  // bf16 NaN (0xFF bytes)

uint16_t to_bf16(float f) {  // round to nearest even, as __float2bfloat16_rn (finite f)
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& h : v) h = to_bf16(dist(rng));
  return v;
}

// y[t] = bf16(fma chain over j = 0..k-1 of w[t,j] * o[slot_row[t,j]]), skipping slot_row < 0.
std::vector<uint16_t> cpu_combine(const std::vector<uint16_t>& o, int64_t H,
                                  const std::vector<int32_t>& slot_row,
                                  const std::vector<float>& w, int64_t T, int64_t k) {
  std::vector<uint16_t> y(T * H);
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = slot_row[t * k + j];
      if (r < 0) continue;
      for (int64_t c = 0; c < H; ++c) acc[c] = std::fmaf(w[t * k + j], from_bf16(o[r * H + c]), acc[c]);
    }
    for (int64_t c = 0; c < H; ++c) y[t * H + c] = to_bf16(acc[c]);
  }
  return y;
}

// Row-level comparison of bf16 bits; reports the first differing element.
void expect_rows(const char* what, const uint16_t* got, const uint16_t* want, int64_t rows,
                 int64_t H) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < rows * H; ++i) {
    if (got[i] != want[i]) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << rows * H << " elements differ; first at row "
                    << (first < 0 ? 0 : first / H) << " col " << (first < 0 ? 0 : first % H)
                    << ": got 0x" << std::hex << (first < 0 ? 0 : got[first]) << ", want 0x"
                    << (first < 0 ? 0 : want[first]);
}

void expect_poisoned(const char* what, const uint16_t* p, int64_t count) {
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) bad += p[i] != kPoisonBits;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << count << " elements were written";
}

// The combine's weights: fp32, bf16, or none (a plain sum, the backward's dx).
enum class Weights { kFp32, kBf16, kNone };

class CombineRowsGpu : public megamoe_test::GpuTest {
 protected:
  // bf16 rows plus kGuardRows guard rows, all 0xFF bytes (NaN).
  __nv_bfloat16* bf16_rows(int64_t rows, int64_t H) {
    return reinterpret_cast<__nv_bfloat16*>(alloc<uint16_t>((rows + kGuardRows) * H));
  }
  void poison_rows(__nv_bfloat16* p, int64_t rows, int64_t H) {
    CUDA_OK(cudaMemsetAsync(p, 0xff, (rows + kGuardRows) * H * 2, stream_));
  }

  template <class Fn>
  void call(const char* name, Fn&& fn) {
    try {
      fn();
    } catch (const megamoe::Error& e) {
      FAIL() << name << " threw: " << e.what();
    }
  }

  // o has T*k rows; slot_row maps slots to a random permutation of them, -1 with p_none;
  // token 0 (when T > 1) has no valid slot.
  void check_combine(int64_t T, int64_t k, int64_t H, Weights weights, double p_none,
                     uint64_t seed, int repeats = 1) {
    const bool bf16_weights = weights == Weights::kBf16;
    SCOPED_TRACE("combine T=" + std::to_string(T) + " k=" + std::to_string(k) + " H=" +
                 std::to_string(H) +
                 (weights == Weights::kNone ? " no weights"
                                            : bf16_weights ? " bf16 weights" : " fp32 weights"));
    std::mt19937_64 rng(seed);
    const int64_t R = T * k;
    const std::vector<uint16_t> o = random_bf16(rng, R * H);
    std::vector<int32_t> slot_row(R);
    std::iota(slot_row.begin(), slot_row.end(), 0);
    std::shuffle(slot_row.begin(), slot_row.end(), rng);
    std::bernoulli_distribution none(p_none);
    for (int32_t& r : slot_row) {
      if (none(rng)) r = -1;
    }
    if (T > 1) std::fill_n(slot_row.begin(), k, -1);
    std::uniform_real_distribution<float> wdist(-1.0f, 1.0f);
    std::vector<float> w(R);
    std::vector<uint16_t> w_bf16(R);
    for (int64_t i = 0; i < R; ++i) {
      w[i] = weights == Weights::kNone ? 1.0f : wdist(rng);
      if (bf16_weights) {
        w_bf16[i] = to_bf16(w[i]);
        w[i] = from_bf16(w_bf16[i]);
      }
    }
    auto* d_o = reinterpret_cast<const __nv_bfloat16*>(upload(o));
    int32_t* d_slots = upload(slot_row);
    const void* d_w = weights == Weights::kNone ? nullptr
                      : bf16_weights              ? static_cast<const void*>(upload(w_bf16))
                                                  : static_cast<const void*>(upload(w));
    __nv_bfloat16* d_y = bf16_rows(T, H);
    ASSERT_FALSE(HasFailure());
    const std::vector<uint16_t> want = cpu_combine(o, H, slot_row, w, T, k);
    std::vector<uint16_t> first;
    for (int rep = 0; rep < repeats; ++rep) {
      poison_rows(d_y, T, H);
      call("combine_rows", [&] {
        megamoe::combine_rows(d_o, H, d_slots, d_w, bf16_weights, T, k, d_y, stream_);
      });
      const std::vector<uint16_t> y =
          download(reinterpret_cast<const uint16_t*>(d_y), (T + kGuardRows) * H);
      expect_rows("y", y.data(), want.data(), T, H);
      expect_poisoned("y guard", y.data() + T * H, kGuardRows * H);
      if (rep == 0) {
        first = y;
      } else {
        EXPECT_TRUE(y == first) << "repeat " << rep << " differs bitwise from the first call";
      }
    }
  }
};

}  // namespace

TEST_F(CombineRowsGpu, CombineFp32WeightsH2048) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(1024, 8, 2048, Weights::kFp32, 0.1, seed);
}

TEST_F(CombineRowsGpu, CombineBf16WeightsH2048) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(1024, 8, 2048, Weights::kBf16, 0.1, seed);
}

TEST_F(CombineRowsGpu, CombineH64) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(4097, 8, 64, Weights::kFp32, 0.1, seed);
  check_combine(4097, 8, 64, Weights::kBf16, 0.1, seed + 1);
}

TEST_F(CombineRowsGpu, CombineShapes) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(1, 1, 64, Weights::kFp32, 0.0, seed);
  check_combine(1, 1, 8, Weights::kBf16, 0.0, seed + 1);
  check_combine(7, 1, 2048, Weights::kFp32, 0.2, seed + 2);   // k = 1
  check_combine(7, 10, 24, Weights::kBf16, 0.2, seed + 3);    // k > one load group of 8
  check_combine(33, 16, 136, Weights::kFp32, 0.3, seed + 4);  // k = 16
  check_combine(5, 4, 4096, Weights::kBf16, 1.0, seed + 5);   // no valid slot: all zeros
}

// No weights (the backward's dx): each used slot's row added with weight 1, in the same fold.
TEST_F(CombineRowsGpu, CombineWithoutWeights) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(1024, 8, 2048, Weights::kNone, 0.1, seed);
  check_combine(7, 10, 24, Weights::kNone, 0.2, seed + 1);  // k > one load group of 8
  check_combine(5, 4, 64, Weights::kNone, 1.0, seed + 2);   // no valid slot: all zeros
}

TEST_F(CombineRowsGpu, CombineBitwiseDeterministic) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_combine(2048, 8, 2048, Weights::kFp32, 0.05, seed, 3);
}

TEST_F(CombineRowsGpu, NoTokensIsANoOp) {
  call("combine_rows", [&] {
    megamoe::combine_rows(nullptr, 64, nullptr, nullptr, false, 0, 8, nullptr, stream_);
  });
  CUDA_OK(cudaStreamSynchronize(stream_));
}

// Plan and combine captured in one CUDA graph, with identity "experts": o holds x[t] at the
// sorted row of every valid slot of token t (laid out from a plan built once outside the
// graph), so y[t] = sum over valid slots of p[t,j] * x[t], exactly.
TEST_F(CombineRowsGpu, PlanCombineInCudaGraph) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  for (int64_t H : {64, 2048}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int64_t T = 4097, k = 8, E = 128, n = T * k;
    std::mt19937_64 rng(seed + H);
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) {
      const uint64_t u = rng() % 20;
      id = u == 0 ? -1 : u == 1 ? static_cast<int32_t>(E + 3) : static_cast<int32_t>(rng() % E);
    }
    const std::vector<uint16_t> x = random_bf16(rng, T * H);
    std::vector<float> w(n);
    std::uniform_real_distribution<float> wdist(0.0f, 1.0f);
    for (float& v : w) v = wdist(rng);

    // Expected: N valid pairs; y = cpu_combine over x itself, slot (t, j) reading row t
    // when its id is valid (the plan puts x[t] at that slot's sorted row of o).
    int64_t valid = 0;
    std::vector<int32_t> slot_token(n, -1);
    for (int64_t s = 0; s < n; ++s) {
      if (ids[s] < 0 || ids[s] >= E) continue;
      ++valid;
      slot_token[s] = static_cast<int32_t>(s / k);
    }
    const std::vector<uint16_t> want = cpu_combine(x, H, slot_token, w, T, k);

    int32_t* d_ids = upload(ids);
    float* d_w = upload(w);
    const megamoe::RoutingPlan plan{alloc<int32_t>(E), alloc<int32_t>(E + 1),
                                    alloc<int32_t>(E + 1), alloc<int32_t>(n),
                                    alloc<int32_t>(n), alloc<int32_t>(n),
                                    alloc<int32_t>(1)};
    void* scratch = alloc<char>(static_cast<int64_t>(megamoe::routing_plan_scratch_bytes(n, E)));
    __nv_bfloat16* d_y = bf16_rows(T, H);
    ASSERT_FALSE(HasFailure());
    const auto build_plan = [&] {
      megamoe::build_routing_plan(d_ids, false, T, k, E, 128, plan, scratch, stream_);
    };

    // The plan once, outside any graph, for the sorted order of o's rows.
    call("build_routing_plan", build_plan);
    const std::vector<int32_t> row_token = download(plan.row_token, n);
    const std::vector<int32_t> offsets = download(plan.expert_offsets, E + 1);
    ASSERT_FALSE(HasFailure());
    ASSERT_EQ(offsets[E], valid);
    // Rows >= N and the guard rows of o stay NaN: reading one would show in y.
    std::vector<uint16_t> o((n + kGuardRows) * H, kPoisonBits);
    for (int64_t r = 0; r < valid; ++r) {
      ASSERT_GE(row_token[r], 0);
      ASSERT_LT(row_token[r], T);
      std::copy_n(x.begin() + row_token[r] * H, H, o.begin() + r * H);
    }
    auto* d_o = reinterpret_cast<const __nv_bfloat16*>(upload(o));
    ASSERT_FALSE(HasFailure());

    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    std::string error;
    try {
      build_plan();
      megamoe::combine_rows(d_o, H, plan.slot_row, d_w, false, T, k, d_y, stream_);
    } catch (const megamoe::Error& e) {
      error = e.what();
    }
    CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    ASSERT_EQ(error, "");
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    std::vector<uint16_t> first_y;
    for (int replay = 0; replay < 2; ++replay) {
      // Every plan output to -1 (no valid slot): y is right only if the replay rebuilt it.
      const auto poison_ints = [&](int32_t* p, int64_t count) {
        CUDA_OK(cudaMemsetAsync(p, 0xff, count * sizeof(int32_t), stream_));
      };
      poison_ints(plan.expert_counts, E);
      poison_ints(plan.expert_offsets, E + 1);
      poison_ints(plan.tile_offsets, E + 1);
      poison_ints(plan.row_token, n);
      poison_ints(plan.row_slot, n);
      poison_ints(plan.slot_row, n);
      poison_ints(plan.invalid_count, 1);
      poison_rows(d_y, T, H);
      CUDA_OK(cudaGraphLaunch(exec, stream_));
      const std::vector<int32_t> replay_row_token = download(plan.row_token, n);
      const std::vector<int32_t> replay_offsets = download(plan.expert_offsets, E + 1);
      const std::vector<uint16_t> y =
          download(reinterpret_cast<const uint16_t*>(d_y), (T + kGuardRows) * H);
      ASSERT_EQ(replay_offsets[E], valid);
      EXPECT_TRUE(replay_row_token == row_token) << "replayed plan differs from the one o follows";
      expect_rows("y", y.data(), want.data(), T, H);
      expect_poisoned("y guard", y.data() + T * H, kGuardRows * H);
      if (replay == 0) {
        first_y = y;
      } else {
        EXPECT_TRUE(y == first_y) << "replay differs bitwise";
      }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
  }
}

// ---------------------------------------------------------------------------------------
// Argument checks: thrown before any CUDA call, so they run without a GPU too.
TEST(CombineRowsArgs, RejectedBeforeAnyLaunch) {
  alignas(16) static uint16_t buf[256];  // never dereferenced: validation comes first
  auto* rows = reinterpret_cast<__nv_bfloat16*>(buf);
  auto* odd = reinterpret_cast<__nv_bfloat16*>(buf + 1);
  auto* idx = reinterpret_cast<int32_t*>(buf);
  using megamoe::combine_rows;
  expect_invalid([&] { combine_rows(rows, 20, idx, buf, false, 4, 2, rows, nullptr); }, "H:");
  expect_invalid([&] { combine_rows(rows, 64, idx, buf, false, -1, 2, rows, nullptr); }, "T:");
  expect_invalid([&] { combine_rows(rows, 64, idx, buf, false, 4, 0, rows, nullptr); }, "k:");
  expect_invalid([&] { combine_rows(odd, 64, idx, buf, false, 4, 2, rows, nullptr); }, "o is not");
  expect_invalid([&] { combine_rows(rows, 64, idx, buf, false, 4, 2, odd, nullptr); }, "y is not");
  expect_invalid([&] { combine_rows(rows, 64, nullptr, buf, false, 4, 2, rows, nullptr); },
                 "slot_row");
  expect_invalid([&] { combine_rows(rows, 64, idx, buf + 1, false, 4, 2, rows, nullptr); },
                 "topk_weights is not aligned");
  expect_invalid([&] { combine_rows(rows, 64, idx, buf, true, int64_t{1} << 30, 4, rows, nullptr); },
                 "2^31");
}
