// The fused backward through its C ABI (dx, d topk_weights, d w_gate_up, d w_down; the
// recompute and the saved-h modes; bf16 weight gradients written or fp32 ones accumulated)
// on a GPU against the float64 CPU reference on the same bf16-rounded inputs. Skipped
// without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_test_util.h"
#include "test_util.h"

namespace {

using megamoe_test::Dims;
using megamoe_test::GpuTest;
using megamoe_test::bf16_bits;
using megamoe_test::bf16_value;
using megamoe_test::dense_tensor;
using megamoe_test::round_to_bf16;



enum class Mode { kRecompute, kSaved };
enum class WeightGrads { kBf16, kAccumulateF32 };
constexpr float kAccumulatorStart = 0.5f;  // what the fp32 gradient buffers hold before

class FusedBackwardGpu : public GpuTest {
 protected:
  struct Result {
    std::vector<uint16_t> dx;
    std::vector<float> dp;
    std::vector<double> dw1, dw2;
  };

  // Device copies of a problem's inputs, rounded to bf16 (and fp32 router weights).
  struct Inputs {
    megamoe_tensor x, dy, ids, weights, w1, w2;
  };

  Inputs upload_inputs(megamoe_test::Problem& p) {
    const Dims d = p.d;
    const int64_t slots = d.T * d.k;
    std::vector<int32_t> ids(slots);
    std::vector<float> weights(slots);
    for (int64_t s = 0; s < slots; ++s) {
      ids[s] = static_cast<int32_t>(p.ids.get(s));
      weights[s] = static_cast<float>(p.weights.get(s));
      p.weights.set(s, weights[s]);
    }
    const auto bf16 = MEGAMOE_DTYPE_BFLOAT16;
    return {dense_tensor(upload(round_to_bf16(p.x)), bf16, {d.T, d.H}),
            dense_tensor(upload(round_to_bf16(p.dy)), bf16, {d.T, d.H}),
            dense_tensor(upload(ids), MEGAMOE_DTYPE_INT32, {d.T, d.k}),
            dense_tensor(upload(weights), MEGAMOE_DTYPE_FLOAT32, {d.T, d.k}),
            dense_tensor(upload(round_to_bf16(p.w_gate_up)), bf16, {d.E, 2 * d.I, d.H}),
            dense_tensor(upload(round_to_bf16(p.w_down)), bf16, {d.E, d.H, d.I})};
  }

  // Poisoned (NaN) device memory: a read of an unwritten element shows.
  void* poisoned(size_t bytes) {
    void* q = device_alloc(bytes);
    EXPECT_EQ(cudaMemset(q, 0xFF, bytes), cudaSuccess);
    return q;
  }

  Result run(const Dims& d, const Inputs& in, Mode mode, WeightGrads wg) {
    const int64_t slots = d.T * d.k;
    megamoe_tensor saved_h{};
    if (mode == Mode::kSaved) {  // the forward writes h next to y
      size_t fwd_bytes = 0;
      EXPECT_EQ(megamoe_fused_workspace_size(d.T, d.k, d.H, d.I, d.E, &fwd_bytes),
                MEGAMOE_SUCCESS);
      megamoe_tensor y =
          dense_tensor(poisoned(d.T * d.H * 2), MEGAMOE_DTYPE_BFLOAT16, {d.T, d.H});
      saved_h = dense_tensor(poisoned(slots * 2 * d.I * 2), MEGAMOE_DTYPE_BFLOAT16,
                              {slots, 2 * d.I});
      EXPECT_EQ(megamoe_fused_forward(&in.x, &in.ids, &in.weights, &in.w1, &in.w2, &y, &saved_h,
                                      poisoned(fwd_bytes), fwd_bytes, stream_),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
    }
    size_t bytes = 0;
    EXPECT_EQ(megamoe_fused_backward_workspace_size(d.T, d.k, d.H, d.I, d.E,
                                                    mode == Mode::kSaved, &bytes),
              MEGAMOE_SUCCESS);
    const int64_t n1 = d.E * 2 * d.I * d.H, n2 = d.E * d.H * d.I;
    megamoe_tensor dx = dense_tensor(poisoned(d.T * d.H * 2), MEGAMOE_DTYPE_BFLOAT16, {d.T, d.H});
    megamoe_tensor dp = dense_tensor(poisoned(slots * 4), MEGAMOE_DTYPE_FLOAT32, {d.T, d.k});
    megamoe_tensor dw1, dw2;
    if (wg == WeightGrads::kBf16) {
      dw1 = dense_tensor(poisoned(n1 * 2), MEGAMOE_DTYPE_BFLOAT16, {d.E, 2 * d.I, d.H});
      dw2 = dense_tensor(poisoned(n2 * 2), MEGAMOE_DTYPE_BFLOAT16, {d.E, d.H, d.I});
    } else {
      dw1 = dense_tensor(upload(std::vector<float>(n1, kAccumulatorStart)), MEGAMOE_DTYPE_FLOAT32,
                          {d.E, 2 * d.I, d.H});
      dw2 = dense_tensor(upload(std::vector<float>(n2, kAccumulatorStart)), MEGAMOE_DTYPE_FLOAT32,
                          {d.E, d.H, d.I});
    }
    EXPECT_EQ(megamoe_fused_backward(&in.dy, &in.x, &in.ids, &in.weights, &in.w1, &in.w2,
                                     mode == Mode::kSaved ? &saved_h : nullptr, &dx, &dp, &dw1,
                                     &dw2, poisoned(bytes), bytes, stream_),
              MEGAMOE_SUCCESS)
        << megamoe_last_error();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    Result r{download(static_cast<const uint16_t*>(dx.data), d.T * d.H),
             download(static_cast<const float*>(dp.data), slots), {}, {}};
    const auto values = [&](const megamoe_tensor& g, int64_t n) {
      std::vector<double> v(n);
      if (wg == WeightGrads::kBf16) {
        const auto bits = download(static_cast<const uint16_t*>(g.data), n);
        for (int64_t i = 0; i < n; ++i) v[i] = bf16_value(bits[i]);
      } else {  // what was added
        const auto f = download(static_cast<const float*>(g.data), n);
        for (int64_t i = 0; i < n; ++i) v[i] = double(f[i]) - kAccumulatorStart;
      }
      return v;
    };
    r.dw1 = values(dw1, n1);
    r.dw2 = values(dw2, n2);
    return r;
  }

  void check(Dims d, int64_t used_experts, double p_none, uint64_t seed) {
    SEEDED(seed);
    std::mt19937_64 rng(seed);
    megamoe_test::Problem p = megamoe_test::random_problem(rng, d, used_experts, p_none);
    const Inputs in = upload_inputs(p);
    const Result got = run(d, in, Mode::kRecompute, WeightGrads::kBf16);
    const Result again = run(d, in, Mode::kRecompute, WeightGrads::kBf16);
    EXPECT_EQ(got.dx, again.dx) << "dx not bitwise reproducible";
    EXPECT_EQ(got.dw1, again.dw1) << "d w_gate_up not bitwise reproducible";
    EXPECT_EQ(got.dw2, again.dw2) << "d w_down not bitwise reproducible";
    EXPECT_EQ(std::memcmp(got.dp.data(), again.dp.data(), got.dp.size() * 4), 0)
        << "d topk_weights not bitwise reproducible";
    // The forward's saved h is the recompute's h bit for bit (same GEMM, same K order).
    const Result saved = run(d, in, Mode::kSaved, WeightGrads::kBf16);
    EXPECT_EQ(saved.dx, got.dx) << "saved mode differs from recompute mode";
    EXPECT_EQ(saved.dw1, got.dw1) << "saved mode differs from recompute mode";
    EXPECT_EQ(saved.dw2, got.dw2) << "saved mode differs from recompute mode";

    megamoe_test::Grads ref = megamoe_test::make_grads(p, MEGAMOE_DTYPE_FLOAT64);
    ASSERT_EQ(megamoe_test::backward(p, ref), MEGAMOE_SUCCESS) << megamoe_last_error();
    std::vector<double> dx(got.dx.size()), dp(got.dp.begin(), got.dp.end());
    for (size_t i = 0; i < dx.size(); ++i) dx[i] = bf16_value(got.dx[i]);
    const double err_dx = megamoe_test::rel_error(dx, ref.dx.values());
    const double err_dp = megamoe_test::rel_error(dp, ref.dw.values());
    const double err_dw1 = megamoe_test::rel_error(got.dw1, ref.dw1.values());
    const double err_dw2 = megamoe_test::rel_error(got.dw2, ref.dw2.values());
    std::printf("T=%ld H=%ld I=%ld E=%ld k=%ld: dx %.3e, d topk_weights %.3e, d w_gate_up %.3e, "
                "d w_down %.3e\n", long(d.T), long(d.H), long(d.I), long(d.E), long(d.k),
                err_dx, err_dp, err_dw1, err_dw2);
    EXPECT_LT(err_dx, 1e-2);
    EXPECT_LT(err_dp, 1e-2);
    EXPECT_LT(err_dw1, 1e-2);
    EXPECT_LT(err_dw2, 1e-2);
    // Experts without tokens get exactly zero weight gradients.
    for (int64_t e = used_experts; e < d.E; ++e) {
      for (int64_t i = 0; i < d.H * d.I; ++i) ASSERT_EQ(got.dw2[e * d.H * d.I + i], 0.0) << e;
    }
    for (int64_t s = 0; s < d.T * d.k; ++s) {
      if (p.ids.get(s) < 0) {
        EXPECT_EQ(got.dp[s], 0.0f) << "slot " << s;
      }
    }
    // fp32 accumulation adds the unrounded fp32 gradient: within bf16 rounding of the
    // written one, and as accurate.
    const Result acc = run(d, in, Mode::kRecompute, WeightGrads::kAccumulateF32);
    const double acc_dw1 = megamoe_test::rel_error(acc.dw1, ref.dw1.values());
    const double acc_dw2 = megamoe_test::rel_error(acc.dw2, ref.dw2.values());
    std::printf("  fp32-accumulated: d w_gate_up %.3e, d w_down %.3e\n", acc_dw1, acc_dw2);
    EXPECT_LT(acc_dw1, 1e-2);
    EXPECT_LT(acc_dw2, 1e-2);
    EXPECT_LT(megamoe_test::rel_error(acc.dw1, got.dw1), 1e-2);
  }
};

TEST_F(FusedBackwardGpu, MatchesReference) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check({300, 256, 128, 8, 2}, 7, 0.1, seed);        // one expert without tokens, -1 ids
  check({1000, 512, 256, 16, 4}, 16, 0.05, seed + 1);  // wide tiles everywhere
  check({129, 256, 384, 4, 1}, 4, 0.0, seed + 2);    // I = 384: 128-wide dgrad tiles
  check({1, 128, 128, 8, 8}, 8, 0.0, seed + 3);      // one token over all experts
}

TEST_F(FusedBackwardGpu, NoTokensZeroesBf16WeightGradients) {
  const Dims d{0, 128, 128, 4, 2};
  std::mt19937_64 rng(1);
  megamoe_test::Problem p = megamoe_test::random_problem(rng, d, 4, 0.0);
  const Inputs in = upload_inputs(p);
  const Result r = run(d, in, Mode::kRecompute, WeightGrads::kBf16);
  for (double v : r.dw1) ASSERT_EQ(v, 0.0);
  for (double v : r.dw2) ASSERT_EQ(v, 0.0);
  const Result acc = run(d, in, Mode::kRecompute, WeightGrads::kAccumulateF32);
  for (double v : acc.dw1) ASSERT_EQ(v, 0.0);  // nothing added
}

TEST_F(FusedBackwardGpu, RejectsBadArguments) {
  const Dims d{16, 128, 128, 4, 2};
  std::mt19937_64 rng(2);
  megamoe_test::Problem p = megamoe_test::random_problem(rng, d, 4, 0.0);
  Inputs in = upload_inputs(p);
  size_t bytes = 0;
  ASSERT_EQ(megamoe_fused_backward_workspace_size(d.T, d.k, d.H, d.I, d.E, 0, &bytes),
            MEGAMOE_SUCCESS);
  void* ws = device_alloc(bytes);
  megamoe_tensor dx = dense_tensor(alloc<uint16_t>(d.T * d.H), MEGAMOE_DTYPE_BFLOAT16, {d.T, d.H});
  const auto expect_error = [&](megamoe_status st, const char* fragment) {
    EXPECT_EQ(st, MEGAMOE_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find(fragment), std::string::npos)
        << megamoe_last_error();
  };
  expect_error(megamoe_fused_backward(&in.dy, &in.x, &in.ids, &in.weights, &in.w1, &in.w2,
                                      nullptr, &dx, nullptr, nullptr, nullptr, ws, bytes - 256,
                                      stream_),
               "megamoe_fused_backward_workspace_size");
  megamoe_tensor bf16_weights = in.weights;
  bf16_weights.dtype = MEGAMOE_DTYPE_BFLOAT16;
  expect_error(megamoe_fused_backward(&in.dy, &in.x, &in.ids, &bf16_weights, &in.w1, &in.w2,
                                      nullptr, &dx, nullptr, nullptr, nullptr, ws, bytes, stream_),
               "topk_weights");
  megamoe_tensor short_h =
      dense_tensor(alloc<uint16_t>(d.T * 2 * d.I), MEGAMOE_DTYPE_BFLOAT16, {d.T, 2 * d.I});
  expect_error(megamoe_fused_backward(&in.dy, &in.x, &in.ids, &in.weights, &in.w1, &in.w2,
                                      &short_h, &dx, nullptr, nullptr, nullptr, ws, bytes, stream_),
               "saved_h");
  megamoe_tensor aliased = in.dy;  // dx over dy
  expect_error(megamoe_fused_backward(&in.dy, &in.x, &in.ids, &in.weights, &in.w1, &in.w2,
                                      nullptr, &aliased, nullptr, nullptr, nullptr, ws, bytes,
                                      stream_),
               "dx");
}

}  // namespace
