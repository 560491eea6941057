// The expert-parallel protocols on one GPU: EP=2, 4 and 8 with the ranks emulated on GPU 0
// (RanksTest::emulate: each rank's own buffers, stream and share of the SMs; skipped
// without a GPU). The cases of test_ep_layer.cpp, forward and both backward modes, bitwise
// against the EP=1 layer where ep_layer_test_util.h says so; 200 back-to-back forwards and
// 40 back-to-back forward + backward pairs on the same buffers, alternating two routings;
// ranks with different numbers of tokens, one with none; the first failure's error word
// after a good call; and a peer that stops calling before each phase of the forward or the
// backward: every other rank's error names it and the phase, after the timeout, instead of
// a hang, and its outputs are NaN; a peer that is only late, whose outputs are NaN too (the
// group's failure word).
// Every case runs on each forward path (docs/expert-parallel.md, "Forward overlap"): the
// default one (.../EP2, .../EP8); the epilogue combine, where L2's epilogue stores each row
// into its source's slot and the source folds them there as the one-GPU layer does, the
// backward's L1 dgrad its dx rows likewise, so that y and dx are the one-GPU layer's bit for
// bit (..._EpilogueCombine); the dispatch beside L1 and L2 on the own rows, read from x in
// place, with the backward's dx send beside its weight gradients (..._OverlapDispatch), whose
// y and dx have the default path's bits; and both (..._Overlap_EpilogueCombine), whose y and
// dx are the one-GPU layer's.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/peer_exchange.h"
#include "ep_layer_test_util.h"

namespace {

using megamoe::comm::Phase;
using megamoe_test::Routing;

// Parameters: the emulated world size, and the forward's path.
class EpEmulated : public megamoe_test::EpLayerTest,
                   public ::testing::WithParamInterface<std::tuple<int, int>> {
 protected:
  void SetUp() override {
    use_path(std::get<1>(GetParam()));
    // The overlapped paths' side streams made with the ranks' own (kQueuePerEmulatedRank).
    emulate(std::get<0>(GetParam()), overlap_dispatch_);
  }

  // The missing rank goes as far as the phase before `stop` of a call (its own waits are
  // long: the others arrive there) and no further. Returns its error word, which must stay
  // 0 when the others have called.
  int32_t* stop_before(Phase stop, int missing) {
    const int64_t E = group_.num_experts;
    auto* counts = static_cast<int32_t*>(alloc_on(device_of(missing), E * 4));  // zeros
    auto* peer_error = static_cast<int32_t*>(alloc_on(device_of(missing), 8));  // int32 [2]
    const OnRank on = on_rank(missing);
    const megamoe::comm::PeerTable& peers = tables_[missing];
    if (stop != Phase::kCounts) {
      megamoe::comm::exchange_counts(peers, counts, E, megamoe_test::kLongTimeoutNs, peer_error,
                                     streams_[missing]);
    }
    if (stop == Phase::kCombine) {
      megamoe::comm::phase_barrier(peers, Phase::kDispatch, megamoe_test::kLongTimeoutNs,
                                   peer_error, streams_[missing]);
    }
    return peer_error;
  }
  // How many of the calls 0 .. calls - 1 are not `good`, and the first of them (-1: none).
  template <class Good>
  static std::pair<int, int> wrong_calls(int calls, Good good) {
    int wrong = 0, first = -1;
    for (int call = 0; call < calls; ++call) {
      if (good(call)) continue;
      ++wrong;
      if (first < 0) first = call;
    }
    return {wrong, first};
  }

  // The calls launched at `start` came back within about one timeout: after the first wait
  // that times out, every other wait of the group gives up at once (its failure word) rather
  // than waiting a whole timeout per phase.
  static void expect_one_timeout(std::chrono::steady_clock::time_point start, int64_t timeout_ns) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(ns, 2 * timeout_ns) << "the calls took " << ns / 1e6 << " ms, timeout "
                                  << timeout_ns / 1e6 << " ms";
  }
  // Elements of rank r's output [n] (bf16 or fp32) that are not NaN.
  template <class Device>
  int64_t numbers_in(int r, Device* Rank::*output, int64_t n) {
    if constexpr (sizeof(Device) == 2) {
      const std::vector<uint16_t> out = download<uint16_t>(ranks_[r].*output, n);
      return std::count_if(out.begin(), out.end(), [](uint16_t v) {
        return !std::isnan(megamoe_test::bf16_value(v));
      });
    } else {
      const std::vector<float> out = download<float>(ranks_[r].*output, n);
      return std::count_if(out.begin(), out.end(), [](float v) { return !std::isnan(v); });
    }
  }
  // Every rank but the missing one names it and the phase (its own timeout's code, or the
  // group's when another rank timed out first and its wait gave up on that), and the failed
  // call's outputs on it (the forward's y; the backward's dx, d topk_weights and bf16 weight
  // gradients) are all NaN: a failed call must not look like a result.
  void expect_timeouts_naming(int missing, const char* phase, bool backward) {
    const std::string expected = "rank " + std::to_string(missing) + " did not arrive in phase '" +
                                 phase + "' within the timeout";
    const int64_t H = this->H(), I = this->I(), e = e_local_;
    for (int r = 0; r < world_; ++r) {
      if (r == missing) continue;
      const std::string message = megamoe::comm::describe_error(error_of(r));
      EXPECT_EQ(message.rfind(expected, 0), 0u) << "rank " << r << ": " << message;
      const std::vector<int32_t> words = error_words(r);
      EXPECT_EQ(words[1], words[0]) << "rank " << r << ": the first failure's word";
      const int64_t T = rank_tokens_[r];
      if (!backward) {
        EXPECT_EQ(numbers_in(r, &Rank::y, T * H), 0) << "rank " << r << ": y not all NaN";
        continue;
      }
      EXPECT_EQ(numbers_in(r, &Rank::dx, T * H), 0) << "rank " << r << ": dx not all NaN";
      EXPECT_EQ(numbers_in(r, &Rank::dp, T * k()), 0)
          << "rank " << r << ": d topk_weights not all NaN";
      EXPECT_EQ(numbers_in(r, &Rank::dw1, e * 2 * I * H), 0)
          << "rank " << r << ": d w_gate_up not all NaN";
      EXPECT_EQ(numbers_in(r, &Rank::dw2, e * H * I), 0)
          << "rank " << r << ": d w_down not all NaN";
    }
  }
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

// Many slots a token: k = 8, and k = 16, whose combine send stages up to 16 rows a token
// (StagedRowSums<16>, half the warps).
TEST_P(EpEmulated, ManySlots) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check(64, 256, 128, 32, 8, Routing::kRandom, 0.05, 64 * 8 * world_, seed);
  check(48, 384, 128, 32, 16, Routing::kRandom, 0.05, 48 * 16 * world_, seed + 1);
}

// Rows wider than one round of the final combine's loads (a lane's 8 pieces cover 2048
// columns, partial_row_sums.cuh): H = 2304, the second round one piece.
TEST_P(EpEmulated, RowsPastOneLoadRound) {
  check(40, 2304, 128, 8, 2, Routing::kRandom, 0.05, 40 * 2 * world_, megamoe_test::fresh_seed());
}

// 128-wide L2 tiles (H not a multiple of 256): the epilogue combine's rows then arrive in
// three N-tiles, its counters count to H in steps of 128.
TEST_P(EpEmulated, NarrowL2Tiles) {
  check(80, 384, 128, 8, 2, Routing::kRandom, 0.05, 80 * 2 * world_, megamoe_test::fresh_seed());
}

// This path and the default one on the same problem, at EP=W and at EP=1 (one rank sending
// every row to itself): the overlapped dispatch alone gives the default path's y, bit for
// bit; with the epilogue combine, y is the one-GPU layer's bit for bit, where the default
// path's differs by its per-owner roundings.
TEST_P(EpEmulated, PathBits) {
  const bool epilogue = epilogue_combine_, overlap = overlap_dispatch_;
  if (!epilogue && !overlap) GTEST_SKIP() << "compares another path with the default one";
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_;
  const int64_t tokens = 72, H = 512, I = 128, E = 16, k = 4;
  std::vector<uint16_t> y[2];
  for (const bool on : {false, true}) {
    epilogue_combine_ = on && epilogue;
    overlap_dispatch_ = on && overlap;
    prepare(tokens, H, I, E, k, Routing::kRandom, 0.05, tokens * k * W, seed);
    if (HasFatalFailure()) return;
    for (int r = 0; r < W; ++r) launch_forward(r, false);
    sync_ranks();
    expect_no_errors(on ? "this path" : "default path");
    y[on] = gather<uint16_t>(&Rank::y, tokens * H);
  }
  const SingleRank ep1_this = single_rank(ids_, false, epilogue, overlap);
  if (epilogue) {
    const SingleRank fused = one_gpu();
    EXPECT_EQ(y[1], fused.y) << "EP=" << W << ": y differs from the one-GPU layer's";
    EXPECT_EQ(ep1_this.y, fused.y) << "EP=1: y differs from the one-GPU layer's";
    // k = 4 slots over 16 experts on W ranks: most tokens have slots on two owners, where the
    // default path rounds twice (a check that the comparison above can fail).
    EXPECT_NE(y[0], fused.y) << "EP=" << W << ": the default path gave the one-GPU layer's y";
  } else {
    EXPECT_EQ(y[1], y[0]) << "EP=" << W << ": y differs from the default path's";
    const SingleRank ep1_default = single_rank(ids_, false);
    EXPECT_EQ(ep1_this.y, ep1_default.y) << "EP=1: y differs from the default path's";
  }
}

TEST_P(EpEmulated, EveryTokenOnOneRank) {
  // Ranks other than the last receive nothing; the last receives every row.
  check(64, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64 * 2 * world_,
        megamoe_test::fresh_seed());
}

// Ranks with different numbers of tokens, the first with none (its token tensors null): it
// sends nothing, and receives rows for its experts' GEMMs and weight gradients. Then the
// counts reversed and every row on the last rank, which has no tokens: it receives every row
// and sends none, and the others receive nothing.
TEST_P(EpEmulated, UnevenTokensAndARankWithNone) {
  const uint64_t seed = megamoe_test::fresh_seed();
  const int W = world_;
  constexpr int64_t kMost = 96;
  uneven_tokens_ = megamoe_test::uneven_token_counts(W, kMost);
  check(kMost, 256, 128, 16, 4, Routing::kRandom, 0.05, kMost * 4 * W, seed);
  std::reverse(uneven_tokens_.begin(), uneven_tokens_.end());
  check(kMost, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, kMost * 2 * W, seed + 1);
}

TEST_P(EpEmulated, FewCopySms) {  // num_comm_sms: 3 SMs move every row
  check(100, 256, 128, 16, 4, Routing::kRandom, 0.05, 100 * 4 * world_, megamoe_test::fresh_seed(),
        false, 3);
}

TEST_P(EpEmulated, OverCapacityIsAnErrorAndNaNs) {
  check(64, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed(),
        /*expect_capacity=*/true);
}

// An over-capacity call, then a good one on the same buffers (every id -1: nothing to
// receive, y all zeros): the last call's error word is 0 again and its y is not poisoned,
// the first failure's word still names the capacity (what Buffer.check() reports after a
// model's many calls).
TEST_P(EpEmulated, TheFirstFailureOutlastsAGoodCall) {
  const int W = world_;
  const int64_t tokens = 64, k = 2;
  prepare(tokens, 256, 128, 8, k, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed());
  if (HasFatalFailure()) return;
  std::vector<const int32_t*> no_ids(W);
  for (int r = 0; r < W; ++r) {
    no_ids[r] = upload_on(device_of(r), std::vector<int32_t>(tokens * k, -1));
  }
  for (int r = 0; r < W; ++r) launch_forward(r, false);
  sync_ranks();
  for (int r = 0; r < W; ++r) launch_forward(r, false, no_ids[r]);
  sync_ranks();
  const std::vector<uint16_t> y = gather_tokens<uint16_t>(&Rank::y, H());
  EXPECT_EQ(std::count(y.begin(), y.end(), uint16_t{0}), int64_t(y.size()))
      << "the good call's y is not all +0";
  for (int r = 0; r < W; ++r) {
    const std::vector<int32_t> words = error_words(r);
    EXPECT_EQ(words[0], 0) << "rank " << r << ": " << megamoe::comm::describe_error(words[0]);
    EXPECT_NE(megamoe::comm::describe_error(words[1]).find("capacity"), std::string::npos)
        << "rank " << r << ": " << megamoe::comm::describe_error(words[1]);
  }
}

// Each token's experts shifted alike (still distinct), by an amount that varies by token.
std::vector<int32_t> shifted_ids(std::vector<int32_t> ids, int64_t E, int64_t k) {
  for (size_t s = 0; s < ids.size(); ++s) {
    if (ids[s] >= 0) ids[s] = static_cast<int32_t>((ids[s] + 1 + (s / k) % (E - 1)) % E);
  }
  return ids;
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
  const std::vector<int32_t> shifted = shifted_ids(ids_, E, k);
  // The epilogue combine's y is the one-GPU layer's, the other paths' the EP=1 owners' sum.
  std::vector<uint16_t> expected[2], unused;
  if (epilogue_combine_) {
    expected[0] = one_gpu().y;
    expected[1] = one_gpu(&shifted).y;
  } else {
    owner_sums(ids_, expected[0], unused);
    owner_sums(shifted, expected[1], unused);
  }

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
    // One counts exchange and two phases per forward, none of them missed (the epilogue
    // combine has no combine phase: its waits are per slot).
    const std::vector<uint32_t> generations = download<uint32_t>(
        tables_[r].buffers[r] + megamoe::comm::ControlLayout::kGeneration, 3);
    const uint32_t combines = epilogue_combine_ ? 0 : kCalls;
    EXPECT_EQ(generations, (std::vector<uint32_t>{kCalls, kCalls, combines})) << "rank " << r;
  }
  const auto [wrong, first_wrong] = wrong_calls(kCalls, [&](int call) {
    return gather_call<uint16_t>(ys, call, tokens * H) == expected[call % 2];
  });
  EXPECT_EQ(wrong, 0) << "calls whose y differs from the "
                      << (epilogue_combine_ ? "one-GPU layer's" : "EP=1 owners' sum")
                      << ", the first: " << first_wrong;
}

// Forward then backward, call after call with no host sync, alternating two routings: the
// backward's buffers (on the epilogue paths its d topk_weights and dx slots and their
// counters) reused while the ranks run ahead of each other, from a forward to its backward
// and from one backward to the next. Every call's dx and d topk_weights as expected.
TEST_P(EpEmulated, ManyBackToBackBackwards) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_;
  const int64_t tokens = 48, H = 256, I = 128, E = 16, k = 2;
  constexpr int kCalls = 40;
  prepare(tokens, H, I, E, k, Routing::kRandom, 0.05, tokens * k * W, seed);
  if (HasFatalFailure()) return;
  const std::vector<int32_t> shifted = shifted_ids(ids_, E, k);
  // dx: the one-GPU layer's on the epilogue paths, the EP=1 owners' sum on the others; d
  // topk_weights: the one-GPU layer's on every path.
  std::vector<uint16_t> expected_dx[2], unused;
  std::vector<float> expected_dp[2];
  for (int i = 0; i < 2; ++i) {
    const SingleRank fused = one_gpu(i ? &shifted : nullptr);
    expected_dp[i] = fused.dp;
    if (epilogue_combine_) {
      expected_dx[i] = fused.dx;
    } else {
      owner_sums(i ? shifted : ids_, unused, expected_dx[i]);
    }
  }
  std::vector<const int32_t*> other_ids(W);
  std::vector<__nv_bfloat16*> dxs(W);  // [kCalls, tokens, H] per rank
  std::vector<float*> dps(W);          // [kCalls, tokens, k] per rank
  for (int r = 0; r < W; ++r) {
    other_ids[r] = upload_part(r, shifted, tokens * k);
    dxs[r] = static_cast<__nv_bfloat16*>(alloc_on(device_of(r), kCalls * tokens * H * 2));
    dps[r] = static_cast<float*>(alloc_on(device_of(r), kCalls * tokens * k * 4));
  }
  for (int call = 0; call < kCalls; ++call) {
    for (int r = 0; r < W; ++r) {
      const int32_t* ids = call % 2 ? other_ids[r] : nullptr;
      launch_forward(r, false, ids);
      launch_backward(r, false, ids, dxs[r] + call * tokens * H, dps[r] + call * tokens * k);
    }
  }
  sync_ranks();
  expect_no_errors("after the calls");
  const auto [wrong, first_wrong] = wrong_calls(kCalls, [&](int call) {
    const std::vector<float> dp = gather_call<float>(dps, call, tokens * k);
    const std::vector<float>& want_dp = expected_dp[call % 2];
    return gather_call<uint16_t>(dxs, call, tokens * H) == expected_dx[call % 2] &&
           std::memcmp(dp.data(), want_dp.data(), dp.size() * 4) == 0;
  });
  EXPECT_EQ(wrong, 0) << "calls whose dx or d topk_weights differ from "
                      << (epilogue_combine_ ? "the one-GPU layer's" : "the expected")
                      << ", the first: " << first_wrong;
}

// The last rank goes as far as the phase before `stop` (stop_before) and never makes the
// call; the others call the layer with a short timeout. With the epilogue combine, a peer
// that passed the dispatch phase but never runs its L2 is missed where each rank waits for
// its slots' rows: phase 'combine rows'. (64 tokens of 2 slots per rank over 2W experts:
// every rank has a slot on the missing rank, but for a chance of about 1e-7.)
TEST_P(EpEmulated, AMissingPeerIsATimeoutNamingRankAndPhase) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_, missing = W - 1;
  const int64_t tokens = epilogue_combine_ ? 64 : 32, E = 2 * W, k = 2;
  constexpr int64_t kShortNs = 300'000'000;
  const std::pair<Phase, const char*> stops[] = {
      {Phase::kCounts, "counts"},
      {Phase::kDispatch, "dispatch"},
      {Phase::kCombine, epilogue_combine_ ? "combine rows" : "combine"}};
  for (const auto& [stop, name] : stops) {
    SCOPED_TRACE(std::string("the peer stops before phase ") + name);
    prepare(tokens, 256, 128, E, k, Routing::kRandom, 0.0, tokens * k * W, seed, 0, kShortNs);
    if (HasFatalFailure()) return;
    const int32_t* peer_error = stop_before(stop, missing);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < W; ++r) {
      if (r != missing) launch_forward(r, false);
    }
    sync_ranks();
    expect_one_timeout(start, kShortNs);
    expect_timeouts_naming(missing, name, /*backward=*/false);
    EXPECT_EQ(download<int32_t>(peer_error, 1)[0], 0) << "the others did arrive where the peer waited";
  }
}

// The same in the backward: every rank runs a forward, then the last rank stops before a
// phase of the backward, which the others call with a short timeout. With the epilogue
// combine, a peer past the dispatch phase that never runs its L1 dgrad is missed where each
// rank waits for its slots' dx rows: phase 'combine rows'.
TEST_P(EpEmulated, AMissingPeerInTheBackwardIsATimeoutNamingRankAndPhase) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_, missing = W - 1;
  const int64_t tokens = epilogue_combine_ ? 64 : 32, E = 2 * W, k = 2;
  constexpr int64_t kShortNs = 300'000'000;
  const std::pair<Phase, const char*> stops[] = {
      {Phase::kCounts, "counts"},
      {Phase::kDispatch, "dispatch"},
      {Phase::kCombine, epilogue_combine_ ? "combine rows" : "combine"}};
  for (const auto& [stop, name] : stops) {
    SCOPED_TRACE(std::string("the peer stops before the backward's phase ") + name);
    prepare(tokens, 256, 128, E, k, Routing::kRandom, 0.0, tokens * k * W, seed);
    if (HasFatalFailure()) return;
    for (int r = 0; r < W; ++r) launch_forward(r, false);
    sync_ranks();
    expect_no_errors("the forward");
    const int32_t* peer_error = stop_before(stop, missing);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < W; ++r) {
      if (r == missing) continue;
      ranks_[r].g.timeout_ns = kShortNs;
      // No NaN fill: the outputs hold zeros from their allocation, so only the failed
      // call's poison can make them NaN.
      launch_backward(r, false, nullptr, nullptr, nullptr, /*nan_first=*/false);
    }
    sync_ranks();
    expect_one_timeout(start, kShortNs);
    expect_timeouts_naming(missing, name, /*backward=*/true);
    EXPECT_EQ(download<int32_t>(peer_error, 1)[0], 0) << "the others did arrive where the peer waited";
  }
}

// A peer that is late but alive: the others time out waiting for it in 'counts', go on with
// its stale counts (zeros: nothing from it) and send it sums that lack its rows. It times
// out nowhere, so without the group's failure word it would take those sums for a result.
// With it, its y is NaN too and its error names the late rank, the phase and a rank that
// went on (a wait of its own that has to wait gives up on that word; with the epilogue
// combine, its wait for slot rows nobody computes). The buffers are then spent: a next call
// of every rank, on time, is NaN on every rank.
TEST_P(EpEmulated, ALatePeerFailsTheWholeGroup) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const int W = world_, late = W - 1;
  const int64_t tokens = 32, E = 2 * W, k = 2;
  constexpr int64_t kShortNs = 500'000'000;
  prepare(tokens, 256, 128, E, k, Routing::kRandom, 0.0, tokens * k * W, seed, 0, kShortNs);
  if (HasFatalFailure()) return;
  const int64_t H = this->H();
  for (int r = 0; r < W; ++r) {
    if (r != late) launch_forward(r, false);
  }
  // Past the others' timeout in 'counts' by half of one, as far inside their next wait.
  std::this_thread::sleep_for(std::chrono::nanoseconds(kShortNs * 3 / 2));
  launch_forward(late, false);
  sync_ranks();
  const std::string counts =
      "rank " + std::to_string(late) + " did not arrive in phase 'counts' within the timeout";
  const auto seen_by_a_peer = [&](int32_t code) {
    return megamoe::comm::describe_error(code).rfind(counts + " of rank ", 0) == 0;
  };
  for (int r = 0; r < W; ++r) {
    const int32_t code = error_of(r);
    // The others: their own timeout, or (W > 2) another's that reached them first.
    const std::string message = megamoe::comm::describe_error(code);
    if (r != late) {
      EXPECT_EQ(message.rfind(counts, 0), 0u) << "rank " << r << ": " << message;
    } else {
      EXPECT_TRUE(seen_by_a_peer(code)) << "the late rank: " << message;
    }
    EXPECT_EQ(numbers_in(r, &Rank::y, rank_tokens_[r] * H), 0) << "rank " << r << ": y not all NaN";
    const int32_t mark = download<int32_t>(
        tables_[r].buffers[r] + megamoe::comm::ControlLayout::kGroupFailure, 1)[0];
    EXPECT_TRUE(seen_by_a_peer(mark)) << "rank " << r << "'s group failure word: "
                                      << megamoe::comm::describe_error(mark);
  }
  for (int r = 0; r < W; ++r) launch_forward(r, false);
  sync_ranks();
  for (int r = 0; r < W; ++r) {
    EXPECT_NE(error_of(r), 0) << "rank " << r << ", the call on spent buffers";
    EXPECT_EQ(numbers_in(r, &Rank::y, rank_tokens_[r] * H), 0)
        << "rank " << r << ": y of the call on spent buffers not all NaN";
  }
}

INSTANTIATE_TEST_SUITE_P(Emulated, EpEmulated,
                         ::testing::Combine(::testing::Values(2, 4, 8),
                                            ::testing::ValuesIn(megamoe_test::kEpPaths)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           const int path = std::get<1>(info.param);
                           return "EP" + std::to_string(std::get<0>(info.param)) +
                                  (path == megamoe_test::kDefault
                                       ? std::string()
                                       : "_" + std::string(megamoe_test::kEpPathNames[path]));
                         });

}  // namespace
