// megamoe::build_routing_plan (internal, csrc/kernels/common/routing_plan.h) on a GPU
// against a CPU stable sort of the slots by expert. GPU tests skip without a GPU; the
// argument checks run everywhere (they throw before any CUDA call).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/common/routing_plan.h"

namespace {

using megamoe_test::expect_invalid;
using megamoe_test::fresh_seed;

constexpr int64_t kGuard = 64;                // ints after every output, must stay untouched
constexpr int32_t kPoison = 0x7b7b7b7b;       // not -1: unwritten rows must show up
constexpr unsigned char kPoisonByte = 0x7b;

// ---------------------------------------------------------------------------------------
// CPU oracle: std::stable_sort of the valid slots by expert id.
struct HostPlan {
  std::vector<int32_t> counts, offsets, tiles, row_token, row_slot, slot_row;
  int32_t invalid = 0;
};

HostPlan cpu_plan(const std::vector<int64_t>& ids, int64_t k, int64_t E, int32_t block_m) {
  const auto n = static_cast<int64_t>(ids.size());
  HostPlan p;
  std::vector<int32_t> valid;
  for (int64_t s = 0; s < n; ++s) {
    if (ids[s] >= 0 && ids[s] < E) {
      valid.push_back(static_cast<int32_t>(s));
    } else if (ids[s] != -1) {
      ++p.invalid;
    }
  }
  std::stable_sort(valid.begin(), valid.end(),
                   [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  p.counts.assign(E, 0);
  for (int32_t s : valid) ++p.counts[ids[s]];
  p.offsets.assign(E + 1, 0);
  p.tiles.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    p.offsets[e + 1] = p.offsets[e] + p.counts[e];
    p.tiles[e + 1] = p.tiles[e] + (p.counts[e] + block_m - 1) / block_m;
  }
  p.row_token.assign(n, -1);
  p.row_slot.assign(n, -1);
  p.slot_row.assign(n, -1);
  for (size_t r = 0; r < valid.size(); ++r) {
    p.row_token[r] = static_cast<int32_t>(valid[r] / k);
    p.row_slot[r] = valid[r];
    p.slot_row[valid[r]] = static_cast<int32_t>(r);
  }
  return p;
}

// ---------------------------------------------------------------------------------------
// Routings.
struct Mix {
  int64_t used = -1;       // experts that receive tokens (a random subset); -1: all
  double p_none = 0.05;    // id -1
  double p_invalid = 0.02; // id < -1 or >= E
  bool wide = false;       // invalid ids beyond int32 (int64 ids only)
  double p_hot = 0.0;      // slot goes to one hot expert
};

std::vector<int64_t> random_ids(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E,
                                const Mix& mix) {
  std::vector<int64_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  std::shuffle(experts.begin(), experts.end(), rng);
  const int64_t used = mix.used < 0 ? E : mix.used;
  const int64_t hot = experts[0];
  std::vector<int64_t> bad = {-2, -3, -1000, E, E + 1, E + 1000, INT32_MAX, INT32_MIN};
  if (mix.wide) {
    // Would alias valid experts if the kernel truncated to 32 bits.
    for (int64_t e : {int64_t{0}, E - 1}) {
      bad.push_back((int64_t{1} << 32) + e);
      bad.push_back(-(int64_t{1} << 32) + e);
    }
    bad.push_back(INT64_MAX);
    bad.push_back(INT64_MIN);
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> ids(T * k);
  for (int64_t& id : ids) {
    const double x = u(rng);
    if (x < mix.p_none) {
      id = -1;
    } else if (x < mix.p_none + mix.p_invalid) {
      id = bad[rng() % bad.size()];
    } else if (x < mix.p_none + mix.p_invalid + mix.p_hot) {
      id = hot;
    } else {
      id = experts[rng() % used];
    }
  }
  return ids;
}

void expect_same(const char* what, const std::vector<int32_t>& got,
                 const std::vector<int32_t>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size() << " entries differ; first at ["
                     << first << "]: got " << (bad ? got[first] : 0) << ", want "
                     << (bad ? want[first] : 0);
}

// ---------------------------------------------------------------------------------------
class RoutingPlanGpu : public megamoe_test::GpuTest {
 protected:
  // Device outputs, each followed by kGuard poisoned ints.
  struct Buffers {
    int64_t n = 0, E = 0;
    int32_t *counts = nullptr, *offsets = nullptr, *tiles = nullptr, *row_token = nullptr,
            *row_slot = nullptr, *slot_row = nullptr, *invalid = nullptr;
    void* scratch = nullptr;
    size_t scratch_bytes = 0;
    void* ids = nullptr;
    bool ids64 = false;

    megamoe::RoutingPlan plan() const {
      return {counts, offsets, tiles, row_token, row_slot, slot_row, invalid};
    }
  };

  int32_t* int_buffer(int64_t count) {
    return static_cast<int32_t*>(device_alloc((count + kGuard) * sizeof(int32_t)));
  }

  // Allocates outputs for n slots and E experts (n = 0: null [n] arrays and scratch) and
  // uploads the ids in the requested width.
  Buffers make(const std::vector<int64_t>& ids, bool ids64, int64_t E) {
    Buffers b;
    b.n = static_cast<int64_t>(ids.size());
    b.E = E;
    b.ids64 = ids64;
    b.counts = int_buffer(E);
    b.offsets = int_buffer(E + 1);
    b.tiles = int_buffer(E + 1);
    b.invalid = int_buffer(1);
    if (b.n > 0) {
      b.row_token = int_buffer(b.n);
      b.row_slot = int_buffer(b.n);
      b.slot_row = int_buffer(b.n);
    }
    b.scratch_bytes = megamoe::routing_plan_scratch_bytes(b.n, E);
    if (b.n == 0) {
      EXPECT_EQ(b.scratch_bytes, 0u);
    } else {
      EXPECT_GE(b.scratch_bytes, (E + 1) * sizeof(int32_t));
      b.scratch = device_alloc(b.scratch_bytes);
      b.ids = device_alloc(b.n * (ids64 ? 8 : 4));
    }
    upload_ids(b, ids);
    return b;
  }

  void upload_ids(const Buffers& b, const std::vector<int64_t>& ids) {
    if (b.n == 0) return;
    if (b.ids64) {
      CUDA_OK(cudaMemcpy(b.ids, ids.data(), b.n * 8, cudaMemcpyHostToDevice));
    } else {
      std::vector<int32_t> narrow(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) {
        ASSERT_TRUE(ids[i] >= INT32_MIN && ids[i] <= INT32_MAX) << "test bug: wide id for int32";
        narrow[i] = static_cast<int32_t>(ids[i]);
      }
      CUDA_OK(cudaMemcpy(b.ids, narrow.data(), b.n * 4, cudaMemcpyHostToDevice));
    }
  }

  // Outputs and guards to kPoison, scratch to garbage (the call must not rely on it).
  void poison(const Buffers& b, unsigned char scratch_byte = 0xff) {
    const auto fill = [&](int32_t* p, int64_t count) {
      if (p) {
        CUDA_OK(cudaMemsetAsync(p, kPoisonByte, (count + kGuard) * 4, stream_));
      }
    };
    fill(b.counts, b.E);
    fill(b.offsets, b.E + 1);
    fill(b.tiles, b.E + 1);
    fill(b.invalid, 1);
    fill(b.row_token, b.n);
    fill(b.row_slot, b.n);
    fill(b.slot_row, b.n);
    if (b.scratch) {
      CUDA_OK(cudaMemsetAsync(b.scratch, scratch_byte, b.scratch_bytes, stream_));
    }
  }

  void build(const Buffers& b, int64_t T, int64_t k, int32_t block_m) {
    try {
      megamoe::build_routing_plan(b.ids, b.ids64, T, k, b.E, block_m, b.plan(), b.scratch,
                                  stream_);
    } catch (const megamoe::Error& e) {
      FAIL() << "build_routing_plan threw: " << e.what();
    }
  }

  // Reads back a result; guards must still hold the poison.
  HostPlan fetch(const Buffers& b) {
    HostPlan p;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const auto get = [&](const int32_t* d, int64_t count, std::vector<int32_t>& out,
                         const char* name) {
      out.assign(count, 0);
      if (!d) return;
      std::vector<int32_t> h(count + kGuard);
      EXPECT_EQ(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int64_t i = 0; i < kGuard; ++i) {
        EXPECT_EQ(h[count + i], kPoison) << name << ": write past the end at [" << count + i << "]";
      }
      std::copy(h.begin(), h.begin() + count, out.begin());
    };
    std::vector<int32_t> invalid;
    get(b.counts, b.E, p.counts, "expert_counts");
    get(b.offsets, b.E + 1, p.offsets, "expert_offsets");
    get(b.tiles, b.E + 1, p.tiles, "tile_offsets");
    get(b.invalid, 1, invalid, "invalid_count");
    get(b.row_token, b.n, p.row_token, "row_token");
    get(b.row_slot, b.n, p.row_slot, "row_slot");
    get(b.slot_row, b.n, p.slot_row, "slot_row");
    p.invalid = invalid[0];
    return p;
  }

  static void expect_plan(const HostPlan& got, const HostPlan& want) {
    expect_same("expert_counts", got.counts, want.counts);
    expect_same("expert_offsets", got.offsets, want.offsets);
    expect_same("tile_offsets", got.tiles, want.tiles);
    expect_same("row_token", got.row_token, want.row_token);
    expect_same("row_slot", got.row_slot, want.row_slot);
    expect_same("slot_row", got.slot_row, want.slot_row);
    EXPECT_EQ(got.invalid, want.invalid) << "invalid_count";
  }

  // One routing through the GPU against the oracle.
  void check(const std::vector<int64_t>& ids, bool ids64, int64_t T, int64_t k, int64_t E,
             int32_t block_m) {
    SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) + " E=" +
                 std::to_string(E) + " block_m=" + std::to_string(block_m) +
                 (ids64 ? " int64" : " int32"));
    ASSERT_EQ(static_cast<int64_t>(ids.size()), T * k);
    Buffers b = make(ids, ids64, E);
    ASSERT_FALSE(HasFailure());
    poison(b);
    build(b, T, k, block_m);
    expect_plan(fetch(b), cpu_plan(ids, k, E, block_m));
  }

  void check_random(int64_t T, int64_t k, int64_t E, int32_t block_m, bool ids64, uint64_t seed,
                    Mix mix = {}) {
    std::mt19937_64 rng(seed);
    mix.wide = mix.wide || ids64;
    check(random_ids(rng, T, k, E, mix), ids64, T, k, E, block_m);
  }
};

}  // namespace

TEST_F(RoutingPlanGpu, MatchesCpuInt32) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(4097, 8, 128, 128, false, seed);
}

TEST_F(RoutingPlanGpu, MatchesCpuInt64WithIdsBeyondInt32) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(4097, 8, 128, 128, true, seed);
}

TEST_F(RoutingPlanGpu, SmallShapes) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  for (bool ids64 : {false, true}) {
    check_random(1, 1, 1, 128, ids64, seed + 1);
    check_random(1, 8, 16, 64, ids64, seed + 2);
    check_random(7, 3, 5, 2, ids64, seed + 3);
    check_random(7, 1, 1, 1, ids64, seed + 4);
    check_random(1000, 1, 64, 128, ids64, seed + 5);   // k = 1
    check_random(33, 16, 40, 3, ids64, seed + 6);      // k = 16, small block_m
    check_random(129, 8, 2, 64, ids64, seed + 7, {.p_none = 0.3, .p_invalid = 0.2});
  }
  // One slot, each kind of id.
  for (int64_t id : {int64_t{0}, int64_t{-1}, int64_t{-2}, int64_t{3}}) {
    check({id}, false, 1, 1, 3, 128);
  }
}

TEST_F(RoutingPlanGpu, ZeroTokensWriteZeroCounts) {
  for (bool ids64 : {false, true}) {
    Buffers b = make({}, ids64, 128);
    ASSERT_FALSE(HasFailure());
    ASSERT_EQ(b.row_token, nullptr);
    ASSERT_EQ(b.scratch, nullptr);
    poison(b);
    build(b, 0, 8, 128);
    const HostPlan got = fetch(b);
    expect_plan(got, cpu_plan({}, 8, 128, 128));
    for (int32_t v : got.offsets) EXPECT_EQ(v, 0);
  }
}

TEST_F(RoutingPlanGpu, NoValidSlots) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(500, 4, 32, 128, false, seed, {.p_none = 0.5, .p_invalid = 0.5});
  check_random(500, 4, 32, 128, true, seed + 1, {.p_none = 1.0, .p_invalid = 0.0});
}

TEST_F(RoutingPlanGpu, AllSlotsToOneExpert) {
  const int64_t T = 16384, k = 8;
  std::vector<int64_t> ids(T * k, 77);
  check(ids, false, T, k, 128, 64);
  check(ids, true, T, k, 128, 128);
  std::vector<int64_t> one(T * k, 0);
  check(one, false, T, k, 1, 128);  // E = 1
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(T, k, 1, 128, false, seed, {.p_none = 0.1, .p_invalid = 0.05});
  check_random(T, k, 128, 128, false, seed + 1, {.p_none = 0.0, .p_invalid = 0.0, .p_hot = 0.9});
}

TEST_F(RoutingPlanGpu, ExpertsWithNoTokens) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(3000, 8, 64, 128, false, seed, {.used = 5});
  check_random(3000, 8, 512, 64, true, seed + 1, {.used = 100});
}

TEST_F(RoutingPlanGpu, Slots131072E128) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(16384, 8, 128, 128, false, seed);
  check_random(16384, 8, 128, 64, true, seed + 1);
  check_random(16384, 8, 128, 128, false, seed + 2, {.p_none = 0.0, .p_invalid = 0.0});
  // 129 blocks of 1024 slots: one past the hist that each scatter block scans itself, so
  // plan_scan runs (the cases above are at that bound).
  check_random(16512, 8, 128, 128, false, seed + 3);
}

TEST_F(RoutingPlanGpu, Slots131072E512) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(16384, 8, 512, 64, false, seed);
  check_random(16384, 8, 512, 128, true, seed + 1);
}

TEST_F(RoutingPlanGpu, SeveralTilesPerBlock) {
  // Enough slots that the block count is capped and each block walks several tiles.
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(50000, 8, 1024, 128, false, seed);
  check_random(262144, 8, 128, 128, false, seed + 1, {.p_hot = 0.3});
  check_random(1 << 18, 16, 256, 64, true, seed + 2);
}

TEST_F(RoutingPlanGpu, ManyExperts) {
  // Fewer warps per block above ~1365 experts; the documented maximum is 4096.
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  check_random(3000, 8, 1024, 128, false, seed);
  check_random(3000, 8, 2000, 128, false, seed + 1);
  check_random(9000, 16, megamoe::kRoutingPlanMaxExperts, 64, true, seed + 2);
  check_random(5, 2, megamoe::kRoutingPlanMaxExperts, 128, false, seed + 3);
}

TEST_F(RoutingPlanGpu, BitwiseDeterministic) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  const int64_t T = 16384, k = 8, E = 128;
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> ids = random_ids(rng, T, k, E, {});
  Buffers b = make(ids, false, E);
  ASSERT_FALSE(HasFailure());
  poison(b, 0xff);
  build(b, T, k, 128);
  const HostPlan first = fetch(b);
  poison(b, 0x00);  // different scratch garbage
  build(b, T, k, 128);
  const HostPlan second = fetch(b);
  expect_plan(second, first);
  expect_plan(first, cpu_plan(ids, k, E, 128));
}

TEST_F(RoutingPlanGpu, CapturableInCudaGraph) {
  const uint64_t seed = fresh_seed();
  SEEDED(seed);
  const int64_t T = 4097, k = 8, E = 128;
  const int32_t block_m = 128;
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> ids = random_ids(rng, T, k, E, {.wide = true});
  Buffers b = make(ids, true, E);
  ASSERT_FALSE(HasFailure());

  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  std::string error;
  try {
    megamoe::build_routing_plan(b.ids, true, T, k, E, block_m, b.plan(), b.scratch, stream_);
  } catch (const megamoe::Error& e) {
    error = e.what();
  }
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_EQ(error, "");
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  // Replays overwrite poisoned outputs; a replay after new ids are uploaded sees them.
  for (int replay = 0; replay < 2; ++replay) {
    poison(b);
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    expect_plan(fetch(b), cpu_plan(ids, k, E, block_m));
  }
  const std::vector<int64_t> ids2 = random_ids(rng, T, k, E, {.used = 17, .wide = true});
  upload_ids(b, ids2);
  poison(b);
  CUDA_OK(cudaGraphLaunch(exec, stream_));
  expect_plan(fetch(b), cpu_plan(ids2, k, E, block_m));
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
}

// ---------------------------------------------------------------------------------------
// Argument checks: thrown before any CUDA call, so they run without a GPU too.
TEST(RoutingPlanArgs, RejectedBeforeAnyLaunch) {
  alignas(8) static int32_t fake[64];  // never dereferenced: validation comes first
  const megamoe::RoutingPlan plan{fake, fake, fake, fake, fake, fake, fake};
  const auto build = [&](const void* ids, int64_t T, int64_t k, int64_t E, int32_t bm,
                         const megamoe::RoutingPlan& p, void* scratch) {
    return [=] { megamoe::build_routing_plan(ids, false, T, k, E, bm, p, scratch, nullptr); };
  };
  expect_invalid(build(fake, 4, 2, 0, 128, plan, fake), "num_experts");
  expect_invalid(build(fake, 4, 2, megamoe::kRoutingPlanMaxExperts + 1, 128, plan, fake),
                 "num_experts");
  expect_invalid(build(fake, -1, 2, 8, 128, plan, fake), "T:");
  expect_invalid(build(fake, 4, 0, 8, 128, plan, fake), "k:");
  expect_invalid(build(fake, int64_t{1} << 28, 8, 8, 128, plan, fake), "2^31");
  expect_invalid(build(fake, 4, 2, 8, 0, plan, fake), "block_m");
  expect_invalid(build(nullptr, 4, 2, 8, 128, plan, fake), "topk_ids");
  expect_invalid(build(fake, 4, 2, 8, 128, plan, nullptr), "scratch");
  megamoe::RoutingPlan no_rows = plan;
  no_rows.slot_row = nullptr;
  expect_invalid(build(fake, 4, 2, 8, 128, no_rows, fake), "slot_row");
  megamoe::RoutingPlan no_counts = plan;
  no_counts.expert_counts = nullptr;
  expect_invalid(build(fake, 0, 2, 8, 128, no_counts, nullptr), "expert_counts");
  expect_invalid(
      [&] {
        megamoe::build_routing_plan(reinterpret_cast<const char*>(fake) + 4, true, 4, 2, 8, 128,
                                    plan, fake, nullptr);
      },
      "aligned");
  expect_invalid([] { (void)megamoe::routing_plan_scratch_bytes(10, 0); }, "num_experts");
  expect_invalid([] { (void)megamoe::routing_plan_scratch_bytes(-1, 8); }, "num_slots");
}

TEST(RoutingPlanArgs, ScratchBytes) {
  EXPECT_EQ(megamoe::routing_plan_scratch_bytes(0, 128), 0u);
  for (int64_t E : {int64_t{1}, int64_t{128}, int64_t{512}, megamoe::kRoutingPlanMaxExperts}) {
    for (int64_t n : {int64_t{1}, int64_t{131072}, int64_t{1} << 24, int64_t{INT32_MAX}}) {
      const size_t bytes = megamoe::routing_plan_scratch_bytes(n, E);
      EXPECT_GE(bytes, (E + 1) * sizeof(int32_t)) << "n=" << n << " E=" << E;
      // The block count is capped, so scratch stays small even for huge n.
      EXPECT_LE(bytes, ((int64_t{1} << 18) + E + 1) * sizeof(int32_t)) << "n=" << n << " E=" << E;
    }
  }
}
