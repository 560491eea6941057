// The expert-parallel protocols on one GPU: EP=2 and EP=8 with the ranks emulated on GPU 0
// (RanksTest::emulate: each rank's own buffers, stream and share of the SMs; skipped
// without a GPU). The cases of test_ep_layer.cpp, forward and both backward modes, bitwise
// against the EP=1 layer where ep_layer_test_util.h says so; 200 back-to-back calls on the
// same buffers alternating two routings; and a peer that stops calling before each phase:
// every other rank's error names it and the phase, after the timeout, instead of a hang.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "comm/peer_exchange.h"
#include "ep_layer_test_util.h"

namespace {

using megamoe::comm::Phase;
using megamoe_test::Routing;

class EpEmulated : public megamoe_test::EpLayerTest, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override { emulate(GetParam()); }
};

TEST_P(EpEmulated, MatchesEp1Layer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  const int W = world_;
  check(96, 256, 128, 16, 4, Routing::kRandom, 0.05, 96 * 4 * W, seed);
  check(100, 512, 256, 16, 2, Routing::kRandom, 0.0, 100 * 2 * W, seed + 1);
}

TEST_P(EpEmulated, KIsOne) {
  check(129, 256, 128, 8, 1, Routing::kRandom, 0.1, 129 * world_, megamoe_test::fresh_seed());
}

TEST_P(EpEmulated, EveryTokenOnOneRank) {
  // Ranks other than the last receive nothing; the last receives every row.
  check(64, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64 * 2 * world_,
        megamoe_test::fresh_seed());
}

TEST_P(EpEmulated, FewCopySms) {  // num_comm_sms: 3 SMs move every row
  check(100, 256, 128, 16, 4, Routing::kRandom, 0.05, 100 * 4 * world_, megamoe_test::fresh_seed(),
        false, 3);
}

TEST_P(EpEmulated, OverCapacityIsAnErrorAndNaNs) {
  check(64, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed(),
        /*expect_capacity=*/true);
}

// No host sync between the calls, so ranks run ahead of each other as far as the phases let
// them; the two routings give every other counts exchange other counts (the two slots of the
// counts matrix).
TEST_P(EpEmulated, ManyBackToBackCalls) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_;
  const int64_t tokens = 48, H = 256, I = 128, E = 16, k = 2;
  constexpr int kCalls = 200;
  prepare(tokens, H, I, E, k, Routing::kRandom, 0.05, tokens * k * W, seed);
  if (HasFatalFailure()) return;
  // Each token's experts shifted alike (still distinct), by an amount that varies by token.
  std::vector<int32_t> shifted = ids_;
  for (size_t s = 0; s < shifted.size(); ++s) {
    if (shifted[s] >= 0) shifted[s] = static_cast<int32_t>((shifted[s] + 1 + (s / k) % (E - 1)) % E);
  }
  std::vector<uint16_t> expected[2], unused;
  owner_sums(ids_, expected[0], unused);
  owner_sums(shifted, expected[1], unused);

  std::vector<const int32_t*> other_ids(W);
  std::vector<__nv_bfloat16*> ys(W);  // [kCalls, tokens, H] per rank
  std::vector<int32_t*> errors(W);    // [kCalls] per rank
  for (int r = 0; r < W; ++r) {
    other_ids[r] = upload_part(r, shifted, tokens * k);
    ys[r] = static_cast<__nv_bfloat16*>(alloc_on(device_of(r), kCalls * tokens * H * 2));
    errors[r] = static_cast<int32_t*>(alloc_on(device_of(r), kCalls * 4));
  }
  for (int call = 0; call < kCalls; ++call) {
    for (int r = 0; r < W; ++r) {
      launch_forward(r, false, call % 2 ? other_ids[r] : nullptr, ys[r] + call * tokens * H);
      const OnRank on = on_rank(r);
      CUDA_OK(cudaMemcpyAsync(errors[r] + call,
                              tables_[r].buffers[r] + megamoe::ep::buffer_layout(ranks_[r].g).error,
                              4, cudaMemcpyDeviceToDevice, streams_[r]));
    }
  }
  sync_ranks();

  for (int r = 0; r < W; ++r) {
    const std::vector<int32_t> codes = download<int32_t>(errors[r], kCalls);
    for (int call = 0; call < kCalls; ++call) {
      ASSERT_EQ(codes[call], 0) << "rank " << r << ", call " << call << ": "
                                << megamoe::comm::describe_error(codes[call]);
    }
    // One counts exchange and two phases per forward, none of them missed.
    const std::vector<uint32_t> generations = download<uint32_t>(
        tables_[r].buffers[r] + megamoe::comm::ControlLayout::kGeneration, 3);
    EXPECT_EQ(generations, std::vector<uint32_t>(3, kCalls)) << "rank " << r;
  }
  int wrong = 0, first_wrong = -1;
  for (int call = 0; call < kCalls; ++call) {
    std::vector<uint16_t> y(W * tokens * H);
    for (int r = 0; r < W; ++r) {
      const std::vector<uint16_t> part = download<uint16_t>(ys[r] + call * tokens * H, tokens * H);
      std::copy(part.begin(), part.end(), y.begin() + r * tokens * H);
    }
    if (y != expected[call % 2]) {
      ++wrong;
      if (first_wrong < 0) first_wrong = call;
    }
  }
  EXPECT_EQ(wrong, 0) << "calls whose y differs from the EP=1 owners' sum, the first: "
                      << first_wrong;
}

// The last rank goes as far as the phase before `stop` (its own waits are long: the others
// arrive there) and never makes the call; the others call the layer with a short timeout.
TEST_P(EpEmulated, AMissingPeerIsATimeoutNamingRankAndPhase) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_, missing = W - 1;
  const int64_t tokens = 32, E = 2 * W, k = 2;
  constexpr int64_t kShortNs = 300'000'000;
  const std::pair<Phase, const char*> stops[] = {
      {Phase::kCounts, "counts"}, {Phase::kDispatch, "dispatch"}, {Phase::kCombine, "combine"}};
  for (const auto& [stop, name] : stops) {
    SCOPED_TRACE(std::string("the peer stops before phase ") + name);
    prepare(tokens, 256, 128, E, k, Routing::kRandom, 0.0, tokens * k * W, seed, 0, kShortNs);
    if (HasFatalFailure()) return;
    auto* counts = static_cast<int32_t*>(alloc_on(device_of(missing), E * 4));  // zeros
    auto* peer_error = static_cast<int32_t*>(alloc_on(device_of(missing), 4));
    {
      const OnRank on = on_rank(missing);
      const megamoe::comm::PeerTable& peers = tables_[missing];
      if (stop != Phase::kCounts) {
        megamoe::comm::exchange_counts(peers, counts, E, megamoe_test::kLongTimeoutNs,
                                       peer_error, streams_[missing]);
      }
      if (stop == Phase::kCombine) {
        megamoe::comm::phase_barrier(peers, Phase::kDispatch, megamoe_test::kLongTimeoutNs,
                                     peer_error, streams_[missing]);
      }
    }
    for (int r = 0; r < W; ++r) {
      if (r != missing) launch_forward(r, false);
    }
    sync_ranks();
    const std::string expected = "rank " + std::to_string(missing) + " did not arrive in phase '" +
                                 name + "' within the timeout";
    for (int r = 0; r < W; ++r) {
      if (r == missing) continue;
      EXPECT_EQ(megamoe::comm::describe_error(error_of(r)), expected) << "rank " << r;
    }
    EXPECT_EQ(download<int32_t>(peer_error, 1)[0], 0) << "the others did arrive where the peer waited";
  }
}

INSTANTIATE_TEST_SUITE_P(Emulated, EpEmulated, ::testing::Values(2, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "EP" + std::to_string(info.param);
                         });

}  // namespace
