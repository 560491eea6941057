// The fused backward (dx, d topk_weights, d w_gate_up, d w_down) on a GPU against the
// float64 CPU reference on the same bf16-rounded inputs. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "fused/backward.h"
#include "kernels/common/gather_padded.h"
#include "gpu_test_util.h"
#include "kernels/common/routing_plan.h"
#include "kernels/sm90/grouped_gemm.h"
#include "test_util.h"

namespace {

using megamoe_test::Dims;
using megamoe_test::GpuTest;

uint16_t bf16_bits(double v) {
  const __nv_bfloat16 b = __float2bfloat16(static_cast<float>(v));
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  return bits;
}
double bf16_value(uint16_t bits) {
  const uint32_t w = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// Rounds a tensor's values to bf16 in place and returns the bf16 bits.
std::vector<uint16_t> round_to_bf16(megamoe_test::Tensor& t) {
  std::vector<double> v = t.values();
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    bits[i] = bf16_bits(v[i]);
    v[i] = bf16_value(bits[i]);
  }
  t.assign(v);
  return bits;
}

class FusedBackwardGpu : public GpuTest {
 protected:
  struct Result {
    std::vector<uint16_t> dx;
    std::vector<float> dp;
    std::vector<uint16_t> dw1, dw2;
  };

  Result run(megamoe_test::Problem& p) {
    const Dims d = p.d;
    const int64_t slots = d.T * d.k;
    std::vector<uint16_t> x = round_to_bf16(p.x), dy = round_to_bf16(p.dy),
                          w1 = round_to_bf16(p.w_gate_up), w2 = round_to_bf16(p.w_down);
    std::vector<int32_t> ids(slots);
    std::vector<float> weights(slots);
    for (int64_t s = 0; s < slots; ++s) {
      ids[s] = static_cast<int32_t>(p.ids.get(s));
      weights[s] = static_cast<float>(p.weights.get(s));
      p.weights.set(s, weights[s]);
    }
    const int64_t padded = megamoe::padded_rows_bound(slots, d.E);
    auto bf16_buffer = [&](int64_t n) {
      auto* q = alloc<uint16_t>(n);
      EXPECT_EQ(cudaMemset(q, 0xFF, n * 2), cudaSuccess);  // NaN: a read of unwritten rows shows
      return reinterpret_cast<__nv_bfloat16*>(q);
    };
    megamoe::fused::BackwardBuffers b{};
    b.plan = {alloc<int32_t>(d.E), alloc<int32_t>(d.E + 1), alloc<int32_t>(d.E + 1),
              alloc<int32_t>(slots), alloc<int32_t>(slots), alloc<int32_t>(slots),
              alloc<int32_t>(1)};
    b.plan_scratch = device_alloc(megamoe::routing_plan_scratch_bytes(slots, d.E));
    b.h = bf16_buffer(slots * 2 * d.I);
    b.dh = bf16_buffer(padded * 2 * d.I);
    b.a = bf16_buffer(padded * d.I);
    b.dxs = bf16_buffer(slots * d.H);
    b.dy_p = bf16_buffer(padded * d.H);
    b.xs = bf16_buffer(padded * d.H);
    b.dp_partial = alloc<float>(slots * megamoe::sm90::swiglu_backward_n_tiles(d.I));
    auto* dx = bf16_buffer(d.T * d.H);
    auto* dw1 = bf16_buffer(d.E * 2 * d.I * d.H);
    auto* dw2 = bf16_buffer(d.E * d.H * d.I);
    auto* dp = alloc<float>(slots);
    EXPECT_EQ(cudaMemset(dp, 0xFF, slots * 4), cudaSuccess);
    const auto bf = [](const uint16_t* q) { return reinterpret_cast<const __nv_bfloat16*>(q); };
    megamoe::fused::backward(bf(upload(dy)), bf(upload(x)), upload(ids), false, upload(weights),
                             bf(upload(w1)), bf(upload(w2)), d.T, d.k, d.H, d.I, d.E, b, dx, dp,
                             dw1, dw2, stream_);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    const auto bits = [](__nv_bfloat16* q) { return reinterpret_cast<const uint16_t*>(q); };
    return {download(bits(dx), d.T * d.H), download(dp, slots),
            download(bits(dw1), d.E * 2 * d.I * d.H), download(bits(dw2), d.E * d.H * d.I)};
  }

  void check(Dims d, int64_t used_experts, double p_none, uint64_t seed) {
    SEEDED(seed);
    std::mt19937_64 rng(seed);
    megamoe_test::Problem p = megamoe_test::random_problem(rng, d, used_experts, p_none);
    const Result got = run(p);
    const Result again = run(p);
    EXPECT_EQ(got.dx, again.dx) << "dx not bitwise reproducible";
    EXPECT_EQ(got.dw1, again.dw1) << "d w_gate_up not bitwise reproducible";
    EXPECT_EQ(got.dw2, again.dw2) << "d w_down not bitwise reproducible";
    EXPECT_EQ(std::memcmp(got.dp.data(), again.dp.data(), got.dp.size() * 4), 0)
        << "d topk_weights not bitwise reproducible";

    megamoe_test::Grads ref = megamoe_test::make_grads(p, MEGAMOE_DTYPE_FLOAT64);
    ASSERT_EQ(megamoe_test::backward(p, ref), MEGAMOE_SUCCESS) << megamoe_last_error();
    std::vector<double> dx(got.dx.size()), dp(got.dp.begin(), got.dp.end());
    for (size_t i = 0; i < dx.size(); ++i) dx[i] = bf16_value(got.dx[i]);
    const auto as_double = [](const std::vector<uint16_t>& q) {
      std::vector<double> v(q.size());
      for (size_t i = 0; i < q.size(); ++i) v[i] = bf16_value(q[i]);
      return v;
    };
    const double err_dx = megamoe_test::rel_error(dx, ref.dx.values());
    const double err_dp = megamoe_test::rel_error(dp, ref.dw.values());
    const double err_dw1 = megamoe_test::rel_error(as_double(got.dw1), ref.dw1.values());
    const double err_dw2 = megamoe_test::rel_error(as_double(got.dw2), ref.dw2.values());
    std::printf("T=%ld H=%ld I=%ld E=%ld k=%ld: dx %.3e, d topk_weights %.3e, d w_gate_up %.3e, "
                "d w_down %.3e\n", long(d.T), long(d.H), long(d.I), long(d.E), long(d.k),
                err_dx, err_dp, err_dw1, err_dw2);
    EXPECT_LT(err_dx, 1e-2);
    EXPECT_LT(err_dp, 1e-2);
    EXPECT_LT(err_dw1, 1e-2);
    EXPECT_LT(err_dw2, 1e-2);
    // Experts without tokens get exactly zero weight gradients.
    const std::vector<double> dw2_all = as_double(got.dw2);
    for (int64_t e = used_experts; e < d.E; ++e) {
      for (int64_t i = 0; i < d.H * d.I; ++i) ASSERT_EQ(dw2_all[e * d.H * d.I + i], 0.0) << e;
    }
    for (int64_t s = 0; s < d.T * d.k; ++s) {
      if (p.ids.get(s) < 0) {
        EXPECT_EQ(got.dp[s], 0.0f) << "slot " << s;
      }
    }
  }
};

TEST_F(FusedBackwardGpu, MatchesReference) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check({300, 256, 128, 8, 2}, 7, 0.1, seed);        // one expert without tokens, -1 ids
  check({1000, 512, 256, 16, 4}, 16, 0.05, seed + 1);  // wide tiles everywhere
  check({129, 256, 384, 4, 1}, 4, 0.0, seed + 2);    // I = 384: 128-wide dgrad tiles
}

}  // namespace
