// The expert-parallel layer (first version) on every local GPU of one process with peer
// access: EP=W forward and backward against the EP=1 layer and the one-GPU fused layer on
// the same global problem, and the forward against the float64 CPU reference
// (ep_layer_test_util.h says what must match bitwise); a rank that receives nothing, every
// token on one rank, k = 1, -1 ids, repeated calls on the same buffers (bitwise equal), a
// limited number of copy SMs, and the capacity error. test_ep_emulated.cpp runs the same
// cases on ranks emulated on one GPU. EpLayerGpuEpilogueCombine runs the forward's epilogue
// combine (L2's epilogue stores rows into their sources' slots over NVLink): the same bits.
#include <gtest/gtest.h>

#include <string>

#include "ep_layer_test_util.h"

namespace {

using megamoe_test::Routing;

class EpLayerGpu : public megamoe_test::EpLayerTest {
 protected:
  void SetUp() override { use_gpus(); }
};

TEST_F(EpLayerGpu, MatchesOneGpuLayer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check(300, 256, 128, 8, 2, Routing::kRandom, 0.05, 300 * 2 * 8, seed);
  check(1000, 512, 256, 16, 4, Routing::kRandom, 0.0, 1000 * 4 * 8, seed + 1);
  check(129, 256, 128, 8, 1, Routing::kRandom, 0.1, 129 * 8, seed + 2);  // k = 1
}

TEST_F(EpLayerGpu, EveryTokenOnOneRank) {
  // Ranks other than the last receive nothing; the last receives every row.
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 200 * 2 * 8, megamoe_test::fresh_seed());
}

TEST_F(EpLayerGpu, FewCopySms) {  // num_comm_sms: 3 SMs move every row
  check(700, 256, 128, 16, 4, Routing::kRandom, 0.05, 700 * 4 * 8, megamoe_test::fresh_seed(),
        false, 3);
}

TEST_F(EpLayerGpu, OverCapacityIsAnErrorAndNaNs) {
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed(),
        /*expect_capacity=*/true);
}

class EpLayerGpuEpilogueCombine : public megamoe_test::EpLayerTest {
 protected:
  void SetUp() override {
    epilogue_combine_ = true;
    use_gpus();
  }
};

// The dispatch beside L1 on the own rows, with the default combine and with the epilogue one.
class EpLayerGpuOverlap : public megamoe_test::EpLayerTest,
                          public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override {
    overlap_dispatch_ = true;
    epilogue_combine_ = GetParam();
    use_gpus();
  }
};

TEST_P(EpLayerGpuOverlap, MatchesOneGpuLayer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check(300, 256, 128, 8, 2, Routing::kRandom, 0.05, 300 * 2 * 8, seed);
  check(1000, 512, 256, 16, 4, Routing::kRandom, 0.0, 1000 * 4 * 8, seed + 1);
  check(129, 256, 128, 8, 1, Routing::kRandom, 0.1, 129 * 8, seed + 2);  // k = 1
}

TEST_P(EpLayerGpuOverlap, EveryTokenOnOneRank) {
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 200 * 2 * 8, megamoe_test::fresh_seed());
}

TEST_P(EpLayerGpuOverlap, FewCopySms) {
  check(700, 256, 128, 16, 4, Routing::kRandom, 0.05, 700 * 4 * 8, megamoe_test::fresh_seed(),
        false, 3);
}

INSTANTIATE_TEST_SUITE_P(Paths, EpLayerGpuOverlap, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "EpilogueCombine" : "DefaultCombine");
                         });

TEST_F(EpLayerGpuEpilogueCombine, MatchesOneGpuLayer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check(300, 256, 128, 8, 2, Routing::kRandom, 0.05, 300 * 2 * 8, seed);
  check(1000, 512, 256, 16, 4, Routing::kRandom, 0.0, 1000 * 4 * 8, seed + 1);
  check(129, 256, 128, 8, 1, Routing::kRandom, 0.1, 129 * 8, seed + 2);  // k = 1
  check(200, 384, 128, 8, 2, Routing::kRandom, 0.05, 200 * 2 * 8, seed + 3);  // 128-wide L2
}

TEST_F(EpLayerGpuEpilogueCombine, EveryTokenOnOneRank) {
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 200 * 2 * 8, megamoe_test::fresh_seed());
}

TEST_F(EpLayerGpuEpilogueCombine, OverCapacityIsAnErrorAndNaNs) {
  check(200, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, 64, megamoe_test::fresh_seed(),
        /*expect_capacity=*/true);
}

}  // namespace
