#include <gtest/gtest.h>

#include "test_util.h"

using namespace megamoe_test;

namespace {

std::vector<double> run_forward(Problem& p, megamoe_dtype dt = MEGAMOE_DTYPE_FLOAT64) {
  Tensor y(dt, {p.d.T, p.d.H});
  const megamoe_status st = forward(p, y);
  EXPECT_EQ(st, MEGAMOE_SUCCESS) << megamoe_last_error();
  const std::vector<double> v = y.values();
  EXPECT_TRUE(all_finite(v)) << "y not fully written";
  return v;
}

}  // namespace

// Two tokens, H = 2, I = 1, two experts; values chosen so y can be worked out by hand.
TEST(ReferenceForward, HandCheckedCase) {
  Problem p{Dims{2, 2, 1, 2, 2},
            Tensor(MEGAMOE_DTYPE_FLOAT64, {2, 2}),
            Tensor(MEGAMOE_DTYPE_INT32, {2, 2}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {2, 2}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {2, 2, 2}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {2, 2, 1}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {2, 2})};
  p.x.assign({1, 2, -1, 0.5});
  p.ids.assign({0, 1, 1, -1});
  p.weights.assign({0.25, 0.75, 0.5, 0.9});
  // expert 0: gate row [1, 0], up row [0, 1]; expert 1: gate [0.5, 0.5], up [1, -1]
  p.w_gate_up.assign({1, 0, 0, 1, 0.5, 0.5, 1, -1});
  // expert 0: w_down = [[2], [1]]; expert 1: [[-1], [3]]
  p.w_down.assign({2, 1, -1, 3});

  // Token 0: expert 0 has g = 1, u = 2, a = 2 silu(1), o = [2a, a];
  //          expert 1 has g = 1.5, u = -1, a = -silu(1.5), o = [-a, 3a].
  // Token 1: expert 1 has g = -0.25, u = -1.5, a = -1.5 silu(-0.25); slot 1 is empty.
  const double s1 = silu(1.0), s15 = silu(1.5), sm = silu(-0.25);
  const std::vector<double> expected = {s1 + 0.75 * s15, 0.5 * s1 - 2.25 * s15, 0.75 * sm,
                                        -2.25 * sm};
  const std::vector<double> y = run_forward(p);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], expected[i], 1e-14) << i;
}

TEST(ReferenceForward, MatchesNaiveOnRandomProblems) {
  std::mt19937_64 rng(11);
  for (Dims d : {Dims{7, 16, 8, 5, 2}, Dims{1, 8, 4, 4, 3}, Dims{9, 12, 12, 6, 1},
                 Dims{6, 10, 5, 4, 4}}) {
    Problem p = random_problem(rng, d, d.E - 1, 0.2);
    EXPECT_LT(rel_error(run_forward(p), naive_forward(p)), 1e-13);
  }
}

TEST(ReferenceForward, ThreadedSizeMatchesNaive) {
  // Big enough for the reference to split tokens over threads.
  std::mt19937_64 rng(12);
  Problem p = random_problem(rng, Dims{600, 64, 32, 8, 2}, 8, 0.1);
  EXPECT_LT(rel_error(run_forward(p), naive_forward(p)), 1e-13);
}

TEST(ReferenceForward, KEqualsOne) {
  std::mt19937_64 rng(13);
  Problem p = random_problem(rng, Dims{7, 16, 8, 4, 1}, 4, 0.2);
  EXPECT_LT(rel_error(run_forward(p), naive_forward(p)), 1e-13);
}

TEST(ReferenceForward, AllTokensOnOneExpert) {
  std::mt19937_64 rng(14);
  Problem p = random_problem(rng, Dims{9, 16, 8, 5, 1}, 1, 0.0);
  for (int64_t t = 0; t < 9; ++t) p.ids.set(t, 3);
  EXPECT_LT(rel_error(run_forward(p), naive_forward(p)), 1e-13);
}

TEST(ReferenceForward, AllSlotsEmptyGiveZero) {
  std::mt19937_64 rng(15);
  Problem p = random_problem(rng, Dims{4, 8, 4, 4, 2}, 4, 0.0);
  p.ids.fill(-1);
  for (double v : run_forward(p)) EXPECT_EQ(v, 0.0);
}

TEST(ReferenceForward, ZeroTokens) {
  std::mt19937_64 rng(16);
  Problem p = random_problem(rng, Dims{0, 8, 4, 4, 2}, 4, 0.0);
  Tensor y(MEGAMOE_DTYPE_FLOAT64, {0, 8});
  ASSERT_EQ(y.desc().data, nullptr);  // frameworks pass NULL for empty tensors
  EXPECT_EQ(forward(p, y), MEGAMOE_SUCCESS) << megamoe_last_error();
}

TEST(ReferenceForward, Int32IdsSameAsInt64) {
  std::mt19937_64 rng(17);
  Problem p = random_problem(rng, Dims{8, 12, 6, 5, 2}, 4, 0.2);
  const std::vector<double> y64 = run_forward(p);
  p.ids = p.ids.relayout(MEGAMOE_DTYPE_INT32, {0, 1}, 1);
  EXPECT_EQ(run_forward(p), y64);
}

TEST(ReferenceForward, Float32StorageAgreesWithFloat64) {
  std::mt19937_64 rng(18);
  Problem p32 = as_dtype(random_problem(rng, Dims{9, 16, 12, 6, 3}, 5, 0.2), MEGAMOE_DTYPE_FLOAT32);
  // The float64 problem holds exactly the float32 values, so only storage rounding differs.
  Problem p64 = as_dtype(p32, MEGAMOE_DTYPE_FLOAT64);
  EXPECT_LT(rel_error(run_forward(p32, MEGAMOE_DTYPE_FLOAT32), run_forward(p64)), 1e-5);
}

TEST(ReferenceForward, StridedViewsGiveSameResult) {
  std::mt19937_64 rng(19);
  Problem p = random_problem(rng, Dims{7, 12, 6, 5, 2}, 4, 0.2);
  const std::vector<double> contiguous = run_forward(p);
  // Transposed weights and x, every innermost stride 2 or more, ids column-major.
  p.x = p.x.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 0}, 2);
  p.ids = p.ids.relayout(MEGAMOE_DTYPE_INT64, {1, 0}, 3);
  p.weights = p.weights.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 0}, 2);
  p.w_gate_up = p.w_gate_up.relayout(MEGAMOE_DTYPE_FLOAT64, {0, 2, 1}, 1);
  p.w_down = p.w_down.relayout(MEGAMOE_DTYPE_FLOAT64, {2, 0, 1}, 2);
  Tensor y(MEGAMOE_DTYPE_FLOAT64, {7, 12}, {1, 0}, 2);
  ASSERT_EQ(forward(p, y), MEGAMOE_SUCCESS) << megamoe_last_error();
  // Sums run in logical order whatever the layout: bitwise equal.
  EXPECT_EQ(y.values(), contiguous);
}
