// The key check: the analytic backward against central finite differences of
// L = <dy, y>, in float64 storage.
#include <gtest/gtest.h>

#include "test_util.h"

using namespace megamoe_test;

namespace {

double loss(Problem& p) {
  Tensor y(MEGAMOE_DTYPE_FLOAT64, {p.d.T, p.d.H});
  EXPECT_EQ(forward(p, y), MEGAMOE_SUCCESS) << megamoe_last_error();
  double l = 0;
  for (int64_t i = 0; i < y.numel(); ++i) l += p.dy.get(i) * y.get(i);
  return l;
}

// dL/d(param) by central differences; `param` is one of p's tensors.
std::vector<double> finite_difference(Problem& p, Tensor& param, double step) {
  std::vector<double> g(param.numel());
  for (int64_t i = 0; i < param.numel(); ++i) {
    const double v = param.get(i);
    param.set(i, v + step);
    const double plus = loss(p);
    param.set(i, v - step);
    const double minus = loss(p);
    param.set(i, v);
    g[i] = (plus - minus) / (2 * step);
  }
  return g;
}

Grads run_backward(Problem& p, megamoe_dtype dt = MEGAMOE_DTYPE_FLOAT64) {
  Grads g = make_grads(p, dt);
  const megamoe_status st = backward(p, g);
  EXPECT_EQ(st, MEGAMOE_SUCCESS) << megamoe_last_error();
  for (Tensor* t : {&g.dx, &g.dw, &g.dw1, &g.dw2}) {
    EXPECT_TRUE(all_finite(t->values())) << "gradient not fully written";
  }
  return g;
}

void expect_matches_finite_differences(Problem& p) {
  Grads g = run_backward(p);
  constexpr double kStep = 1e-5, kTol = 1e-6;
  EXPECT_LT(rel_error(g.dx.values(), finite_difference(p, p.x, kStep)), kTol) << "dx";
  EXPECT_LT(rel_error(g.dw.values(), finite_difference(p, p.weights, kStep)), kTol)
      << "d_topk_weights";
  EXPECT_LT(rel_error(g.dw1.values(), finite_difference(p, p.w_gate_up, kStep)), kTol)
      << "d_w_gate_up";
  EXPECT_LT(rel_error(g.dw2.values(), finite_difference(p, p.w_down, kStep)), kTol)
      << "d_w_down";

  // Exact zeros where nothing flows: empty slots, experts without tokens.
  const Dims d = p.d;
  std::vector<bool> used(d.E, false);
  for (int64_t q = 0; q < d.T * d.k; ++q) {
    const auto e = static_cast<int64_t>(p.ids.get(q));
    if (e == -1) {
      EXPECT_EQ(g.dw.get(q), 0.0) << "slot " << q;
    } else {
      used[e] = true;
    }
  }
  for (int64_t e = 0; e < d.E; ++e) {
    if (used[e]) continue;
    for (int64_t i = 0; i < 2 * d.I * d.H; ++i) ASSERT_EQ(g.dw1.get(e * 2 * d.I * d.H + i), 0.0);
    for (int64_t i = 0; i < d.H * d.I; ++i) ASSERT_EQ(g.dw2.get(e * d.H * d.I + i), 0.0);
  }
}

class BackwardFiniteDifference : public ::testing::TestWithParam<int> {};

}  // namespace

TEST_P(BackwardFiniteDifference, RandomProblem) {
  std::mt19937_64 rng(1000 + GetParam());
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const Dims d{pick(5, 9), pick(8, 16), pick(4, 12), pick(4, 6), pick(1, 3)};
  // One or two experts receive no tokens; about one slot in six is empty (-1).
  Problem p = random_problem(rng, d, d.E - pick(1, 2), 1.0 / 6);
  p.ids.set(0, -1);  // at least one empty slot in every problem
  SCOPED_TRACE(::testing::Message() << "T=" << d.T << " H=" << d.H << " I=" << d.I
                                    << " E=" << d.E << " k=" << d.k);
  expect_matches_finite_differences(p);
}

INSTANTIATE_TEST_SUITE_P(Seeds, BackwardFiniteDifference, ::testing::Range(0, 8));

TEST(ReferenceBackward, FiniteDifferenceAllTokensOnOneExpertKOne) {
  std::mt19937_64 rng(21);
  Problem p = random_problem(rng, Dims{7, 10, 6, 4, 1}, 1, 0.0);
  for (int64_t t = 0; t < 7; ++t) p.ids.set(t, 2);
  expect_matches_finite_differences(p);
}

TEST(ReferenceBackward, FiniteDifferenceSameExpertTwiceInOneToken) {
  std::mt19937_64 rng(22);
  Problem p = random_problem(rng, Dims{5, 8, 4, 4, 2}, 4, 0.0);
  p.ids.set(0, 1);
  p.ids.set(1, 1);
  expect_matches_finite_differences(p);
}

TEST(ReferenceBackward, NullOutputsAreSkippedAndOthersUnchanged) {
  std::mt19937_64 rng(23);
  Problem p = random_problem(rng, Dims{8, 12, 6, 5, 2}, 4, 0.2);
  Grads full = run_backward(p);
  Tensor* full_out[] = {&full.dx, &full.dw, &full.dw1, &full.dw2};
  for (int only = 0; only < 4; ++only) {
    Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
    Tensor* outs[] = {&g.dx, &g.dw, &g.dw1, &g.dw2};
    megamoe_tensor descs[4];
    megamoe_tensor* ptrs[4] = {};
    for (int i = 0; i < 4; ++i) descs[i] = outs[i]->desc();
    ptrs[only] = &descs[only];
    megamoe_tensor dy = p.dy.desc(), x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                   w1 = p.w_gate_up.desc(), w2 = p.w_down.desc();
    ASSERT_EQ(megamoe_reference_backward(&dy, &x, &ids, &w, &w1, &w2, ptrs[0], ptrs[1], ptrs[2],
                                         ptrs[3]),
              MEGAMOE_SUCCESS)
        << megamoe_last_error();
    EXPECT_EQ(outs[only]->values(), full_out[only]->values()) << "output " << only;
    for (int i = 0; i < 4; ++i) {
      if (i == only) continue;
      for (double v : outs[i]->values()) ASSERT_TRUE(std::isnan(v)) << "skipped output written";
    }
  }
  megamoe_tensor dy = p.dy.desc(), x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc();
  EXPECT_EQ(megamoe_reference_backward(&dy, &x, &ids, &w, &w1, &w2, nullptr, nullptr, nullptr,
                                       nullptr),
            MEGAMOE_SUCCESS);
}

TEST(ReferenceBackward, GradientsAreOverwrittenNotAccumulated) {
  std::mt19937_64 rng(24);
  Problem p = random_problem(rng, Dims{6, 8, 4, 4, 2}, 3, 0.2);
  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  ASSERT_EQ(backward(p, g), MEGAMOE_SUCCESS);
  const std::vector<double> first = g.dw1.values();
  ASSERT_EQ(backward(p, g), MEGAMOE_SUCCESS);
  EXPECT_EQ(g.dw1.values(), first);
}

TEST(ReferenceBackward, Float32StorageAgreesWithFloat64) {
  std::mt19937_64 rng(25);
  Problem p32 = as_dtype(random_problem(rng, Dims{9, 16, 12, 6, 3}, 5, 0.2), MEGAMOE_DTYPE_FLOAT32);
  Problem p64 = as_dtype(p32, MEGAMOE_DTYPE_FLOAT64);
  Grads g32 = run_backward(p32, MEGAMOE_DTYPE_FLOAT32), g64 = run_backward(p64);
  EXPECT_LT(rel_error(g32.dx.values(), g64.dx.values()), 1e-5);
  EXPECT_LT(rel_error(g32.dw.values(), g64.dw.values()), 1e-5);
  EXPECT_LT(rel_error(g32.dw1.values(), g64.dw1.values()), 1e-5);
  EXPECT_LT(rel_error(g32.dw2.values(), g64.dw2.values()), 1e-5);
}

TEST(ReferenceBackward, StridedViewsGiveSameResult) {
  std::mt19937_64 rng(26);
  Problem p = random_problem(rng, Dims{7, 12, 6, 5, 2}, 4, 0.2);
  Grads contiguous = run_backward(p);
  p.dy = p.dy.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 0}, 3);
  p.x = p.x.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 0}, 2);
  p.ids = p.ids.relayout(MEGAMOE_DTYPE_INT32, {1, 0}, 2);
  p.weights = p.weights.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 0}, 1);
  p.w_gate_up = p.w_gate_up.relayout(MEGAMOE_DTYPE_FLOAT64, {0, 2, 1}, 2);
  p.w_down = p.w_down.relayout(MEGAMOE_DTYPE_FLOAT64, {1, 2, 0}, 1);
  const Dims d = p.d;
  Grads g{Tensor(MEGAMOE_DTYPE_FLOAT64, {d.T, d.H}, {1, 0}, 2),
          Tensor(MEGAMOE_DTYPE_FLOAT64, {d.T, d.k}, {1, 0}, 1),
          Tensor(MEGAMOE_DTYPE_FLOAT64, {d.E, 2 * d.I, d.H}, {2, 1, 0}, 1),
          Tensor(MEGAMOE_DTYPE_FLOAT64, {d.E, d.H, d.I}, {0, 2, 1}, 3)};
  ASSERT_EQ(backward(p, g), MEGAMOE_SUCCESS) << megamoe_last_error();
  EXPECT_EQ(g.dx.values(), contiguous.dx.values());
  EXPECT_EQ(g.dw.values(), contiguous.dw.values());
  EXPECT_EQ(g.dw1.values(), contiguous.dw1.values());
  EXPECT_EQ(g.dw2.values(), contiguous.dw2.values());
}

TEST(ReferenceBackward, ZeroTokensZeroWeightGradients) {
  std::mt19937_64 rng(27);
  Problem p = random_problem(rng, Dims{0, 8, 4, 3, 2}, 3, 0.0);
  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  ASSERT_EQ(backward(p, g), MEGAMOE_SUCCESS) << megamoe_last_error();
  for (double v : g.dw1.values()) ASSERT_EQ(v, 0.0);
  for (double v : g.dw2.values()) ASSERT_EQ(v, 0.0);
}

TEST(ReferenceBackward, ThreadedSizeMatchesSerialSize) {
  // 600 tokens run on several threads, 3 tokens on one. With dy = 0 past token 3, every
  // gradient of the big problem equals the small problem's exactly: the extra tokens add
  // exact zeros to the weight gradients, and the first tokens' dx and dp are independent.
  std::mt19937_64 rng(28);
  Problem big = random_problem(rng, Dims{600, 64, 32, 8, 2}, 8, 0.1);
  for (int64_t i = 3 * 64; i < big.dy.numel(); ++i) big.dy.set(i, 0.0);
  Grads gb = run_backward(big);
  Problem small = big;
  small.d.T = 3;
  for (Tensor* t : {&small.x, &small.ids, &small.weights, &small.dy}) {
    std::vector<int64_t> shape = t->shape();
    shape[0] = 3;
    Tensor cut(t->dtype(), shape);
    for (int64_t i = 0; i < cut.numel(); ++i) cut.set(i, t->get(i));
    *t = cut;
  }
  Grads gs = run_backward(small);
  for (int64_t i = 0; i < gs.dx.numel(); ++i) ASSERT_EQ(gs.dx.get(i), gb.dx.get(i));
  for (int64_t i = 0; i < gs.dw.numel(); ++i) ASSERT_EQ(gs.dw.get(i), gb.dw.get(i));
  EXPECT_EQ(gs.dw1.values(), gb.dw1.values());
  EXPECT_EQ(gs.dw2.values(), gb.dw2.values());
}
