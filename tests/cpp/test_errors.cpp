// Bad input to the reference entry points: the status, a message that names the argument
// and the expectation, and no write to any output.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "test_util.h"

using namespace megamoe_test;

namespace {

// The fixed problem of the header's example message: x [5, 64], w_gate_up [8, 64, 64].
class ReferenceErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(1234);
    p = random_problem(rng, Dims{5, 64, 32, 8, 2}, 8, 0.2);
    y = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 64});
    megamoe_clear_error();
  }

  // Forward with the current tensors; expects INVALID_ARGUMENT, y untouched, and
  // returns the message.
  std::string forward_error() {
    const megamoe_status st = forward(p, y);
    EXPECT_EQ(st, MEGAMOE_ERROR_INVALID_ARGUMENT) << megamoe_status_name(st);
    for (int64_t i = 0; i < y.numel(); ++i) {
      if (!std::isnan(y.get(i))) {
        ADD_FAILURE() << "y[" << i << "] written by a failing call";
        break;
      }
    }
    return megamoe_last_error();
  }

  Problem p;
  Tensor y;
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_F(ReferenceErrors, ValidCallSucceeds) {
  ASSERT_EQ(forward(p, y), MEGAMOE_SUCCESS) << megamoe_last_error();
  EXPECT_TRUE(all_finite(y.values()));
}

TEST_F(ReferenceErrors, NullDescriptorsNamed) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc(), yd = y.desc();
  struct Case {
    const char* name;
    megamoe_status st;
  } cases[] = {
      {"x", megamoe_reference_forward(nullptr, &ids, &w, &w1, &w2, &yd)},
      {"topk_ids", megamoe_reference_forward(&x, nullptr, &w, &w1, &w2, &yd)},
      {"topk_weights", megamoe_reference_forward(&x, &ids, nullptr, &w1, &w2, &yd)},
      {"w_gate_up", megamoe_reference_forward(&x, &ids, &w, nullptr, &w2, &yd)},
      {"w_down", megamoe_reference_forward(&x, &ids, &w, &w1, nullptr, &yd)},
      {"y", megamoe_reference_forward(&x, &ids, &w, &w1, &w2, nullptr)},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.st, MEGAMOE_ERROR_INVALID_ARGUMENT) << c.name;
  }
  // The message of the last one.
  EXPECT_EQ(std::string(megamoe_last_error()), "y: tensor descriptor is NULL");
}

TEST_F(ReferenceErrors, NullDataWithElements) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc(), yd = y.desc();
  w1.data = nullptr;
  EXPECT_EQ(megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "w_gate_up: data pointer is NULL"))
      << megamoe_last_error();
}

TEST_F(ReferenceErrors, ShapeMismatchMessageNamesOrigin) {
  p.w_down = Tensor(MEGAMOE_DTYPE_FLOAT64, {8, 64, 31});
  p.w_down.fill(0.5);
  EXPECT_EQ(forward_error(),
            "w_down: expected shape [E=8, H=64, I=32] (from w_gate_up [8, 64, 64] and x [5, 64]), "
            "got [8, 64, 31]");
}

TEST_F(ReferenceErrors, OtherShapeErrors) {
  const Problem good = p;
  p.ids = Tensor(MEGAMOE_DTYPE_INT64, {4, 2});
  p.ids.fill(0);
  EXPECT_TRUE(contains(forward_error(), "topk_ids: expected shape [T=5, k] (from x [5, 64])"));

  p = good;
  p.weights = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 3});
  p.weights.fill(0.5);
  EXPECT_TRUE(contains(forward_error(), "topk_weights: expected shape [T=5, k=2]"));

  p = good;
  p.w_gate_up = Tensor(MEGAMOE_DTYPE_FLOAT64, {8, 63, 64});
  p.w_gate_up.fill(0.5);
  EXPECT_TRUE(contains(forward_error(), "w_gate_up: expected an even number 2I"));

  p = good;
  p.w_gate_up = Tensor(MEGAMOE_DTYPE_FLOAT64, {8, 64, 65});
  p.w_gate_up.fill(0.5);
  EXPECT_TRUE(contains(forward_error(), "w_gate_up: expected shape [E, 2I, H=64]"));

  p = good;
  p.x = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 64, 1});
  p.x.fill(0.5);
  EXPECT_TRUE(contains(forward_error(), "x: expected 2 dimensions [T, H], got ndim=3"));

  p = good;
  y = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 63});
  EXPECT_TRUE(contains(forward_error(), "y: expected shape [T=5, H=64]"));
}

TEST_F(ReferenceErrors, ZeroSizesRejectedWhereMeaningless) {
  const Problem good = p;
  p.ids = Tensor(MEGAMOE_DTYPE_INT64, {5, 0});
  p.weights = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 0});
  EXPECT_TRUE(contains(forward_error(), "topk_ids: expected k >= 1"));

  p = good;
  p.w_gate_up = Tensor(MEGAMOE_DTYPE_FLOAT64, {0, 64, 64});
  EXPECT_TRUE(contains(forward_error(), "w_gate_up: expected at least one expert"));

  p = good;
  p.x = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 0});
  y = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 0});
  EXPECT_EQ(forward(p, y), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "x: expected hidden size H >= 1"));
}

TEST_F(ReferenceErrors, NegativeSizeAndBadRank) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc(), yd = y.desc();
  x.shape[0] = -5;
  EXPECT_EQ(megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "x: shape [-5, 64] has a negative size"))
      << megamoe_last_error();
  x = p.x.desc();
  x.ndim = 1000;  // garbage rank must not be read past shape[]
  EXPECT_EQ(megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "x: expected 2 dimensions")) << megamoe_last_error();
}

TEST_F(ReferenceErrors, WrongDtypes) {
  const Problem good = p;
  p.x = p.x.relayout(MEGAMOE_DTYPE_INT32, {0, 1}, 1);
  EXPECT_EQ(forward_error(), "x: expected dtype float32 or float64, got int32 (4)");

  p = good;
  p.ids = p.ids.relayout(MEGAMOE_DTYPE_FLOAT64, {0, 1}, 1);
  EXPECT_TRUE(contains(forward_error(), "topk_ids: expected dtype int32 or int64, got float64"));

  p = good;
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc(), yd = y.desc();
  x.dtype = static_cast<megamoe_dtype>(77);
  EXPECT_EQ(megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "got unknown dtype (77)")) << megamoe_last_error();
}

TEST_F(ReferenceErrors, MixedFloatDtypesRejected) {
  const Problem good = p;
  p.w_down = p.w_down.relayout(MEGAMOE_DTYPE_FLOAT32, {0, 1, 2}, 1);
  EXPECT_TRUE(contains(forward_error(),
                       "w_down: expected dtype float64 like x (all floating tensors of one "
                       "call share one dtype), got float32"));

  p = good;
  p.weights = p.weights.relayout(MEGAMOE_DTYPE_FLOAT32, {0, 1}, 1);
  EXPECT_TRUE(contains(forward_error(), "topk_weights: expected dtype float64 like x"));

  p = good;
  y = Tensor(MEGAMOE_DTYPE_FLOAT32, {5, 64});
  EXPECT_TRUE(contains(forward_error(), "y: expected dtype float64 like x"));

  p = good;
  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  g.dw1 = Tensor(MEGAMOE_DTYPE_FLOAT32, {8, 64, 64});
  EXPECT_EQ(backward(p, g), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "d_w_gate_up: expected dtype float64 like x"));
}

TEST_F(ReferenceErrors, ExpertIdMinusOneAllowedOthersRejected) {
  p.ids.set(0, -1);
  ASSERT_EQ(forward(p, y), MEGAMOE_SUCCESS) << megamoe_last_error();

  const double original = p.ids.get(3 * 2 + 1);
  for (double bad : {-2.0, 8.0, 1e9}) {
    y = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 64});
    p.ids.set(3 * 2 + 1, bad);  // token 3, slot 1
    const std::string msg = forward_error();
    p.ids.set(3 * 2 + 1, original);
    const std::string value = std::to_string(static_cast<int64_t>(bad));
    EXPECT_TRUE(contains(msg, "topk_ids[3, 1] = " + value + " is out of range")) << msg;
    EXPECT_TRUE(contains(msg, "[0, 8)")) << msg;
  }
}

TEST_F(ReferenceErrors, BadIdInt32AndBackwardWritesNothing) {
  p.ids = p.ids.relayout(MEGAMOE_DTYPE_INT32, {0, 1}, 1);
  p.ids.set(4 * 2 + 0, 8);
  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  EXPECT_EQ(backward(p, g), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "topk_ids[4, 0] = 8 is out of range"))
      << megamoe_last_error();
  for (Tensor* t : {&g.dx, &g.dw, &g.dw1, &g.dw2}) {
    for (double v : t->values()) ASSERT_TRUE(std::isnan(v)) << "gradient written on failure";
  }
}

TEST_F(ReferenceErrors, AliasedOutputRejected) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc();
  megamoe_tensor yd = x;  // y written over x
  EXPECT_EQ(megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "y: output memory overlaps x"))
      << megamoe_last_error();

  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  megamoe_tensor dy = p.dy.desc(), dx = g.dx.desc(), dw = g.dw.desc(), dw1 = g.dw1.desc();
  megamoe_tensor dw2 = dw1;  // two gradients into one buffer (shape differs but checked later)
  dw2.shape[1] = 64;
  dw2.shape[2] = 32;
  EXPECT_EQ(megamoe_reference_backward(&dy, &x, &ids, &w, &w1, &w2, &dx, &dw, &dw1, &dw2),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "d_w_down: output memory overlaps d_w_gate_up"))
      << megamoe_last_error();
}

TEST_F(ReferenceErrors, BackwardChecksDy) {
  Grads g = make_grads(p, MEGAMOE_DTYPE_FLOAT64);
  p.dy = Tensor(MEGAMOE_DTYPE_FLOAT64, {5, 65});
  EXPECT_EQ(backward(p, g), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "dy: expected shape [T=5, H=64]"))
      << megamoe_last_error();
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc();
  EXPECT_EQ(megamoe_reference_backward(nullptr, &x, &ids, &w, &w1, &w2, nullptr, nullptr,
                                       nullptr, nullptr),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(megamoe_last_error()), "dy: tensor descriptor is NULL");
}

TEST(LastError, SetOnFailureKeptUntilNextFailureOrClear) {
  megamoe_clear_error();
  EXPECT_STREQ(megamoe_last_error(), "");
  EXPECT_EQ(megamoe_cuda_device_count(nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  const std::string first = megamoe_last_error();
  EXPECT_FALSE(first.empty());
  // A successful call leaves the message of the last failed call in place.
  EXPECT_STREQ(megamoe_version(), "0.1.0");
  int32_t n = 0;
  EXPECT_EQ(megamoe_cuda_device_count(&n), MEGAMOE_SUCCESS);
  EXPECT_EQ(std::string(megamoe_last_error()), first);
  megamoe_clear_error();
  EXPECT_STREQ(megamoe_last_error(), "");
}

TEST(LastError, PerThread) {
  megamoe_clear_error();
  EXPECT_EQ(megamoe_cuda_device_count(nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  const std::string mine = megamoe_last_error();
  ASSERT_FALSE(mine.empty());
  std::string other_before, other_after;
  std::thread([&] {
    other_before = megamoe_last_error();
    megamoe_tensor* none = nullptr;
    megamoe_reference_forward(none, none, none, none, none, none);
    other_after = megamoe_last_error();
  }).join();
  EXPECT_EQ(other_before, "");
  EXPECT_EQ(other_after, "x: tensor descriptor is NULL");
  EXPECT_EQ(std::string(megamoe_last_error()), mine);
}

TEST(RoutingCountsErrors, DescriptorChecksNeedNoGpu) {
  Tensor ids(MEGAMOE_DTYPE_INT32, {4, 2});
  ids.fill(1);
  Tensor counts(MEGAMOE_DTYPE_INT32, {8}), invalid(MEGAMOE_DTYPE_INT32, {1});
  megamoe_tensor i = ids.desc(), c = counts.desc(), v = invalid.desc();

  EXPECT_EQ(megamoe_routing_counts(nullptr, 8, &c, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(megamoe_last_error(), "topk_ids: tensor descriptor is NULL");

  megamoe_tensor bad = i;
  bad.dtype = MEGAMOE_DTYPE_FLOAT32;
  EXPECT_EQ(megamoe_routing_counts(&bad, 8, &c, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "topk_ids: expected dtype int32 or int64"));

  Tensor strided = ids.relayout(MEGAMOE_DTYPE_INT32, {1, 0}, 1);
  bad = strided.desc();
  EXPECT_EQ(megamoe_routing_counts(&bad, 8, &c, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "topk_ids: expected a contiguous"))
      << megamoe_last_error();

  EXPECT_EQ(megamoe_routing_counts(&i, 0, &c, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "num_experts: expected a value in [1, "));

  EXPECT_EQ(megamoe_routing_counts(&i, 9, &c, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "expert_counts: expected shape [n=9]"))
      << megamoe_last_error();

  bad = c;
  bad.dtype = MEGAMOE_DTYPE_INT64;
  EXPECT_EQ(megamoe_routing_counts(&i, 8, &bad, &v, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "expert_counts: expected dtype int32"));

  EXPECT_EQ(megamoe_routing_counts(&i, 8, &c, nullptr, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(megamoe_last_error(), "invalid_count: tensor descriptor is NULL");
}

TEST(RoutingCountsErrors, HostMemoryIsNotAccepted) {
  int32_t devices = 0;
  ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS);
  Tensor ids(MEGAMOE_DTYPE_INT32, {4, 2});
  ids.fill(1);
  Tensor counts(MEGAMOE_DTYPE_INT32, {8}), invalid(MEGAMOE_DTYPE_INT32, {1});
  megamoe_tensor i = ids.desc(), c = counts.desc(), v = invalid.desc();
  const megamoe_status st = megamoe_routing_counts(&i, 8, &c, &v, nullptr);
  if (devices == 0) {
    // Without a GPU the pointer query itself fails: a CUDA error, not a crash.
    EXPECT_EQ(st, MEGAMOE_ERROR_CUDA) << megamoe_last_error();
    EXPECT_TRUE(contains(megamoe_last_error(), "cudaPointerGetAttributes(topk_ids) failed"))
        << megamoe_last_error();
  } else {
    EXPECT_EQ(st, MEGAMOE_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(megamoe_last_error(), "topk_ids: expected CUDA device memory"))
        << megamoe_last_error();
  }
}

// The fused forward takes y = NULL only with saved_h (it then computes saved_h alone); the
// argument check comes before any device work.
TEST_F(ReferenceErrors, FusedForwardNullYNeedsSavedH) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc();
  EXPECT_EQ(megamoe_fused_forward(&x, &ids, &w, &w1, &w2, nullptr, nullptr, nullptr, 0, nullptr),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(megamoe_last_error(), "y: expected a tensor, got NULL (NULL only with "
                                             "saved_h"))
      << megamoe_last_error();
}
