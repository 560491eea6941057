// The expert-parallel layer (first version) on every local GPU of one process with peer
// access: EP=W forward and backward against the EP=1 layer and the one-GPU fused layer on
// the same global problem, and the forward against the float64 CPU reference
// (ep_layer_test_util.h says what must match bitwise); a rank that receives nothing, every
// token on one rank, ranks with different numbers of tokens (one with none), k = 1, 8 and
// 16, -1 ids, 128-wide L2 tiles, repeated calls on the same buffers (bitwise equal), a
// limited number of copy SMs, and the capacity error. Every case
// runs on each forward path (.../Default, the epilogue combine, where L2's epilogue stores
// rows into their sources' slots over NVLink, the dispatch beside the own rows' chain with
// the backward's dx send beside its weight gradients, and both): the default path's bits,
// but y and dx with the epilogue combine, which are the one-GPU layer's.
// test_ep_emulated.cpp runs the same cases on ranks emulated on one GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "ep_layer_test_util.h"

namespace {

using megamoe_test::Routing;

class EpLayerGpu : public megamoe_test::EpLayerTest, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override {
    use_path(GetParam());
    use_gpus();
  }
};

TEST_P(EpLayerGpu, MatchesOneGpuLayer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check(300, 256, 128, 8, 2, Routing::kRandom, 0.05, 300 * 2 * 8, seed);
  check(1000, 512, 256, 16, 4, Routing::kRandom, 0.0, 1000 * 4 * 8, seed + 1);
  check(129, 256, 128, 8, 1, Routing::kRandom, 0.1, 129 * 8, seed + 2);  // k = 1
  check(200, 384, 128, 8, 2, Routing::kRandom, 0.05, 200 * 2 * 8, seed + 3);  // 128-wide L2
  // k = 8 and k = 16 (the combine send's 16-row stages)
  check(256, 256, 128, 32, 8, Routing::kRandom, 0.05, 256 * 8 * 8, seed + 4);
  check(128, 384, 128, 32, 16, Routing::kRandom, 0.05, 128 * 16 * 8, seed + 5);
}

TEST_P(EpLayerGpu, EveryTokenOnOneRank) {
  // Ranks other than the last receive nothing; the last receives every row.
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 200 * 2 * 8, megamoe_test::fresh_seed());
}

// Ranks with different numbers of tokens, the first with none (its token tensors null); then
// the counts reversed and every row on the last rank, which has no tokens.
TEST_P(EpLayerGpu, UnevenTokensAndARankWithNone) {
  const uint64_t seed = megamoe_test::fresh_seed();
  constexpr int64_t kMost = 300;
  uneven_tokens_ = megamoe_test::uneven_token_counts(world_, kMost);
  check(kMost, 256, 128, 16, 4, Routing::kRandom, 0.05, kMost * 4 * 8, seed);
  std::reverse(uneven_tokens_.begin(), uneven_tokens_.end());
  check(kMost, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, kMost * 2 * 8, seed + 1);
}

TEST_P(EpLayerGpu, FewCopySms) {  // num_comm_sms: 3 SMs move every row
  check(700, 256, 128, 16, 4, Routing::kRandom, 0.05, 700 * 4 * 8, megamoe_test::fresh_seed(),
        false, 3);
}

TEST_P(EpLayerGpu, OverCapacityIsAnErrorAndNaNs) {
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed(),
        /*expect_capacity=*/true);
}

INSTANTIATE_TEST_SUITE_P(Paths, EpLayerGpu, ::testing::ValuesIn(megamoe_test::kEpPaths),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(megamoe_test::kEpPathNames[info.param]);
                         });

}  // namespace
