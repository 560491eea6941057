// The grouped GEMM scheduler's expert search (kernels/common/expert_search.h) on the host,
// against std::upper_bound over the same offsets: every M-tile of random expert layouts
// with empty experts anywhere (first, last, in runs), one expert, and counts around the
// probe count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/common/expert_search.h"

namespace {

// tile_offsets [E + 1] of per-expert M-tile counts.
std::vector<int32_t> offsets_of(const std::vector<int32_t>& tiles) {
  std::vector<int32_t> offsets(tiles.size() + 1, 0);
  for (size_t e = 0; e < tiles.size(); ++e) offsets[e + 1] = offsets[e] + tiles[e];
  return offsets;
}

void expect_every_tile_found(const std::vector<int32_t>& tiles) {
  const std::vector<int32_t> offsets = offsets_of(tiles);
  const int E = static_cast<int>(tiles.size());
  const auto load = [&](int e) { return offsets.at(e); };
  for (int32_t m = 0; m < offsets[E]; ++m) {
    const int want =
        static_cast<int>(std::upper_bound(offsets.begin(), offsets.begin() + E, m) - offsets.begin()) - 1;
    const int got = megamoe::last_expert_at_most(load, E, m);
    ASSERT_EQ(got, want) << "M-tile " << m << " of " << offsets[E] << ", " << E << " experts";
    ASSERT_GT(tiles[got], 0) << "M-tile " << m << " found in an expert without tiles";
  }
}

TEST(ExpertSearch, FindsTheExpertOfEveryTile) {
  std::mt19937 rng(20261204);
  for (const int E : {1, 2, 3, 7, 8, 15, 16, 17, 18, 33, 128, 255, 256, 289, 1000}) {
    for (int trial = 0; trial < 8; ++trial) {
      SCOPED_TRACE("E = " + std::to_string(E) + ", trial " + std::to_string(trial));
      // Trial 0: every expert one tile; then more and more empty experts.
      std::uniform_int_distribution<int> count(0, 3);
      std::bernoulli_distribution empty(trial / 8.0);
      std::vector<int32_t> tiles(E);
      for (int e = 0; e < E; ++e) tiles[e] = trial == 0 ? 1 : (empty(rng) ? 0 : count(rng));
      expect_every_tile_found(tiles);
    }
  }
}

TEST(ExpertSearch, EmptyExpertsAtTheEnds) {
  for (const int E : {2, 17, 128}) {
    std::vector<int32_t> tiles(E, 0);
    tiles[0] = 3;
    expect_every_tile_found(tiles);  // only the first
    std::fill(tiles.begin(), tiles.end(), 0);
    tiles[E - 1] = 3;
    expect_every_tile_found(tiles);  // only the last
    std::fill(tiles.begin(), tiles.end(), 0);
    tiles[E / 2] = 1;
    expect_every_tile_found(tiles);  // one in the middle
  }
}

}  // namespace
