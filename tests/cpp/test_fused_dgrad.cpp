// The fused backward's data gradients (dx, d topk_weights) on a GPU against the float64 CPU
// reference on the same bf16-rounded inputs. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "fused/backward_dgrad.h"
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

class FusedDgradGpu : public GpuTest {
 protected:
  struct Result {
    std::vector<uint16_t> dx;
    std::vector<float> dp;
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
    megamoe::fused::DgradBuffers b{};
    b.plan = {alloc<int32_t>(d.E), alloc<int32_t>(d.E + 1), alloc<int32_t>(d.E + 1),
              alloc<int32_t>(slots), alloc<int32_t>(slots), alloc<int32_t>(slots),
              alloc<int32_t>(1)};
    b.plan_scratch = device_alloc(megamoe::routing_plan_scratch_bytes(slots, d.E));
    b.h = reinterpret_cast<__nv_bfloat16*>(alloc<uint16_t>(slots * 2 * d.I));
    b.dh = reinterpret_cast<__nv_bfloat16*>(alloc<uint16_t>(slots * 2 * d.I));
    b.dxs = reinterpret_cast<__nv_bfloat16*>(alloc<uint16_t>(slots * d.H));
    b.dp_partial = alloc<float>(slots * megamoe::sm90::swiglu_backward_n_tiles(d.I));
    auto* dx = alloc<uint16_t>(d.T * d.H);
    auto* dp = alloc<float>(slots);
    EXPECT_EQ(cudaMemset(dx, 0xFF, d.T * d.H * 2), cudaSuccess);  // NaN: unwritten shows
    EXPECT_EQ(cudaMemset(dp, 0xFF, slots * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(b.h, 0xFF, slots * 2 * d.I * 2), cudaSuccess);
    const auto bf = [](const uint16_t* q) { return reinterpret_cast<const __nv_bfloat16*>(q); };
    megamoe::fused::backward_dgrad(bf(upload(dy)), bf(upload(x)), upload(ids), false,
                                   upload(weights), bf(upload(w1)), bf(upload(w2)), d.T, d.k,
                                   d.H, d.I, d.E, b, reinterpret_cast<__nv_bfloat16*>(dx), dp,
                                   stream_);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return {download(dx, d.T * d.H), download(dp, slots)};
  }

  void check(Dims d, int64_t used_experts, double p_none, uint64_t seed) {
    SEEDED(seed);
    std::mt19937_64 rng(seed);
    megamoe_test::Problem p = megamoe_test::random_problem(rng, d, used_experts, p_none);
    const Result got = run(p);
    const Result again = run(p);
    EXPECT_EQ(got.dx, again.dx) << "dx not bitwise reproducible";
    EXPECT_EQ(std::memcmp(got.dp.data(), again.dp.data(), got.dp.size() * 4), 0)
        << "d topk_weights not bitwise reproducible";

    megamoe_test::Grads ref = megamoe_test::make_grads(p, MEGAMOE_DTYPE_FLOAT64);
    ASSERT_EQ(megamoe_test::backward(p, ref), MEGAMOE_SUCCESS) << megamoe_last_error();
    std::vector<double> dx(got.dx.size()), dp(got.dp.begin(), got.dp.end());
    for (size_t i = 0; i < dx.size(); ++i) dx[i] = bf16_value(got.dx[i]);
    const double err_dx = megamoe_test::rel_error(dx, ref.dx.values());
    const double err_dp = megamoe_test::rel_error(dp, ref.dw.values());
    std::printf("T=%ld H=%ld I=%ld E=%ld k=%ld: dx %.3e, d topk_weights %.3e\n", long(d.T),
                long(d.H), long(d.I), long(d.E), long(d.k), err_dx, err_dp);
    EXPECT_LT(err_dx, 1e-2);
    EXPECT_LT(err_dp, 1e-2);
    for (int64_t s = 0; s < d.T * d.k; ++s) {
      if (p.ids.get(s) < 0) {
        EXPECT_EQ(got.dp[s], 0.0f) << "slot " << s;
      }
    }
  }
};

TEST_F(FusedDgradGpu, MatchesReference) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check({300, 256, 128, 8, 2}, 7, 0.1, seed);        // one expert without tokens, -1 ids
  check({1000, 512, 256, 16, 4}, 16, 0.05, seed + 1);  // wide tiles everywhere
  check({129, 256, 384, 4, 1}, 4, 0.0, seed + 2);    // I = 384: 128-wide dgrad tiles
}

}  // namespace
