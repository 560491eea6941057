// The expert-parallel layer (first version) on every local GPU of one process with peer
// access: EP=W forward and backward against the one-GPU fused layer on the same global
// problem (d topk_weights and weight gradients bitwise; y and dx within 5e-3, as they add
// one bf16 rounding per owner rank) and the forward against the float64 CPU reference; a
// rank that receives nothing, every token on one rank, k = 1, -1 ids, repeated calls on
// the same buffers (bitwise equal), a limited number of copy SMs, and the capacity error.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "comm/ep_layer.h"
#include "multi_gpu_test_util.h"
#include "test_util.h"

namespace {

using megamoe_test::Dims;
using megamoe_test::bf16_bits;
using megamoe_test::bf16_value;
using megamoe_test::dense_tensor;
using megamoe_test::round_to_bf16;

std::vector<double> decode(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_value(bits[i]);
  return v;
}
constexpr double kEpVsOneGpu = 5e-3;  // y and dx: one bf16 rounding per owner's partial sum
enum class Routing { kRandom, kAllOnLastRank };

class EpLayerGpu : public megamoe_test::MultiGpuTest {
 protected:
  template <class T>
  T* upload_on(int device, const std::vector<T>& h) {
    auto* d = static_cast<T*>(alloc_on(device, h.size() * sizeof(T)));
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }

  // tokens: per rank. Returns nothing; checks inside.
  void check(int64_t tokens, int64_t H, int64_t I, int64_t E, int64_t k, Routing routing,
             double p_none, int64_t max_recv_rows, uint64_t seed, bool expect_capacity = false,
             int32_t comm_sms = 0) {
    SEEDED(seed);
    const int W = world_;
    ASSERT_EQ(E % W, 0);
    const int64_t e_local = E / W, T_all = tokens * W;
    std::mt19937_64 rng(seed);
    const int64_t used = routing == Routing::kAllOnLastRank ? e_local : E;
    megamoe_test::Problem p =
        megamoe_test::random_problem(rng, {T_all, H, I, E, k}, std::min(used, E), p_none);
    if (routing == Routing::kAllOnLastRank) {  // every id into the last rank's experts
      for (int64_t s = 0; s < T_all * k; ++s) {
        if (p.ids.get(s) >= 0) p.ids.set(s, p.ids.get(s) + (W - 1) * e_local);
      }
    }
    const std::vector<uint16_t> x = round_to_bf16(p.x), w1 = round_to_bf16(p.w_gate_up),
                                w2 = round_to_bf16(p.w_down), dy = round_to_bf16(p.dy);
    std::vector<int32_t> ids(T_all * k);
    std::vector<float> weights(T_all * k);
    for (int64_t s = 0; s < T_all * k; ++s) {
      ids[s] = static_cast<int32_t>(p.ids.get(s));
      weights[s] = static_cast<float>(p.weights.get(s));
      p.weights.set(s, weights[s]);
    }

    megamoe::ep::Group group{};
    group.num_experts = E;
    group.max_tokens = tokens;
    group.topk = k;
    group.hidden = H;
    group.max_recv_rows = max_recv_rows;
    group.timeout_ns = 10'000'000'000;
    group.comm_sms = comm_sms;
    group.peers.world_size = W;
    const size_t buffer_bytes = [&] {
      megamoe::ep::Group g = group;
      for (int r = 0; r < W; ++r) g.peers.buffers[r] = reinterpret_cast<char*>(1);
      return megamoe::ep::buffer_layout(g).total;
    }();
    std::vector<megamoe::comm::PeerTable> tables = make_tables(buffer_bytes);

    struct Rank {
      megamoe::ep::Group g;
      __nv_bfloat16 *x, *w1, *w2, *y, *dy, *dx, *dw1, *dw2, *saved_h;
      float *acc1, *acc2;  // fp32 weight-gradient accumulators (saved-mode call)
      int32_t* ids;
      float *weights, *dp;
      void *workspace, *bwd_workspace;
      size_t workspace_size, bwd_workspace_size;
    };
    std::vector<Rank> ranks(W);
    for (int r = 0; r < W; ++r) {
      Rank& rk = ranks[r];
      rk.g = group;
      rk.g.peers = tables[r];
      const auto slice = [](const auto& v, int64_t from, int64_t n) {
        return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + from,
                                                                          v.begin() + from + n);
      };
      rk.x = reinterpret_cast<__nv_bfloat16*>(upload_on(r, slice(x, r * tokens * H, tokens * H)));
      rk.ids = upload_on(r, slice(ids, r * tokens * k, tokens * k));
      rk.weights = upload_on(r, slice(weights, r * tokens * k, tokens * k));
      rk.w1 = reinterpret_cast<__nv_bfloat16*>(
          upload_on(r, slice(w1, r * e_local * 2 * I * H, e_local * 2 * I * H)));
      rk.w2 = reinterpret_cast<__nv_bfloat16*>(
          upload_on(r, slice(w2, r * e_local * H * I, e_local * H * I)));
      rk.y = static_cast<__nv_bfloat16*>(alloc_on(r, tokens * H * 2));
      rk.dy = reinterpret_cast<__nv_bfloat16*>(upload_on(r, slice(dy, r * tokens * H, tokens * H)));
      rk.dx = static_cast<__nv_bfloat16*>(alloc_on(r, tokens * H * 2));
      rk.dp = static_cast<float*>(alloc_on(r, tokens * k * 4));
      rk.dw1 = static_cast<__nv_bfloat16*>(alloc_on(r, e_local * 2 * I * H * 2));
      rk.dw2 = static_cast<__nv_bfloat16*>(alloc_on(r, e_local * H * I * 2));
      rk.workspace_size = megamoe::ep::forward_workspace_bytes(rk.g, tokens, I);
      rk.workspace = alloc_on(r, rk.workspace_size);
      rk.saved_h = static_cast<__nv_bfloat16*>(alloc_on(r, max_recv_rows * 2 * I * 2));
      rk.acc1 = static_cast<float*>(alloc_on(r, e_local * 2 * I * H * 4));
      rk.acc2 = static_cast<float*>(alloc_on(r, e_local * H * I * 4));
      // Recompute mode needs the larger workspace; saved mode uses the same one.
      rk.bwd_workspace_size = megamoe::ep::backward_workspace_bytes(rk.g, tokens, I, false);
      EXPECT_LE(megamoe::ep::backward_workspace_bytes(rk.g, tokens, I, true), rk.bwd_workspace_size);
      rk.bwd_workspace = alloc_on(r, rk.bwd_workspace_size);
    }

    // The one-GPU fused forward of the whole problem on GPU 0: what EP must reproduce.
    std::vector<uint16_t> expected(T_all * H), expected_dx, expected_dw1, expected_dw2;
    std::vector<float> expected_dp;
    {
      CUDA_OK(cudaSetDevice(0));
      megamoe_tensor gx = dense_tensor(upload_on(0, x), MEGAMOE_DTYPE_BFLOAT16, {T_all, H});
      megamoe_tensor gids = dense_tensor(upload_on(0, ids), MEGAMOE_DTYPE_INT32, {T_all, k});
      megamoe_tensor gp = dense_tensor(upload_on(0, weights), MEGAMOE_DTYPE_FLOAT32, {T_all, k});
      megamoe_tensor gw_gate_up = dense_tensor(upload_on(0, w1), MEGAMOE_DTYPE_BFLOAT16, {E, 2 * I, H});
      megamoe_tensor gw_down = dense_tensor(upload_on(0, w2), MEGAMOE_DTYPE_BFLOAT16, {E, H, I});
      megamoe_tensor gy = dense_tensor(alloc_on(0, T_all * H * 2), MEGAMOE_DTYPE_BFLOAT16, {T_all, H});
      size_t bytes = 0;
      ASSERT_EQ(megamoe_fused_workspace_size(T_all, k, H, I, E, &bytes), MEGAMOE_SUCCESS);
      ASSERT_EQ(megamoe_fused_forward(&gx, &gids, &gp, &gw_gate_up, &gw_down, &gy, nullptr, alloc_on(0, bytes),
                                      bytes, nullptr),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(expected.data(), gy.data, T_all * H * 2, cudaMemcpyDeviceToHost));
      // ... and its backward (recompute mode), for the EP backward to reproduce.
      megamoe_tensor ddy = dense_tensor(upload_on(0, dy),
                                         MEGAMOE_DTYPE_BFLOAT16, {T_all, H});
      megamoe_tensor gdx = dense_tensor(alloc_on(0, T_all * H * 2), MEGAMOE_DTYPE_BFLOAT16, {T_all, H});
      megamoe_tensor gdp = dense_tensor(alloc_on(0, T_all * k * 4), MEGAMOE_DTYPE_FLOAT32, {T_all, k});
      megamoe_tensor gw1 = dense_tensor(alloc_on(0, E * 2 * I * H * 2), MEGAMOE_DTYPE_BFLOAT16, {E, 2 * I, H});
      megamoe_tensor gw2 = dense_tensor(alloc_on(0, E * H * I * 2), MEGAMOE_DTYPE_BFLOAT16, {E, H, I});
      ASSERT_EQ(megamoe_fused_backward_workspace_size(T_all, k, H, I, E, 0, &bytes), MEGAMOE_SUCCESS);
      ASSERT_EQ(megamoe_fused_backward(&ddy, &gx, &gids, &gp, &gw_gate_up, &gw_down, nullptr, &gdx, &gdp, &gw1,
                                       &gw2, alloc_on(0, bytes), bytes, nullptr),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
      CUDA_OK(cudaDeviceSynchronize());
      expected_dx.resize(T_all * H);
      expected_dp.resize(T_all * k);
      expected_dw1.resize(E * 2 * I * H);
      expected_dw2.resize(E * H * I);
      CUDA_OK(cudaMemcpy(expected_dx.data(), gdx.data, T_all * H * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(expected_dp.data(), gdp.data, T_all * k * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(expected_dw1.data(), gw1.data, E * 2 * I * H * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(expected_dw2.data(), gw2.data, E * H * I * 2, cudaMemcpyDeviceToHost));
    }

    std::vector<uint16_t> first_y;
    for (int call = 0; call < 3; ++call) {  // the same buffers again: generations, no reset
      for (int r = 0; r < W; ++r) {  // every rank's launches first: they wait on each other
        CUDA_OK(cudaSetDevice(r));
        CUDA_OK(cudaMemsetAsync(ranks[r].y, 0xFF, tokens * H * 2, streams_[r]));
        megamoe::ep::forward(ranks[r].g, ranks[r].x, ranks[r].ids, false, ranks[r].weights,
                             ranks[r].w1, ranks[r].w2, tokens, I, ranks[r].y, nullptr,
                             ranks[r].workspace, ranks[r].workspace_size, streams_[r]);
      }
      std::vector<uint16_t> got(T_all * H);
      for (int r = 0; r < W; ++r) {
        CUDA_OK(cudaSetDevice(r));
        CUDA_OK(cudaStreamSynchronize(streams_[r]));
        CUDA_OK(cudaMemcpy(got.data() + r * tokens * H, ranks[r].y, tokens * H * 2,
                           cudaMemcpyDeviceToHost));
        int32_t code = -1;
        CUDA_OK(cudaMemcpy(&code, tables[r].buffers[r] + megamoe::ep::buffer_layout(ranks[r].g).error,
                           4, cudaMemcpyDeviceToHost));
        if (expect_capacity) {
          EXPECT_NE(megamoe::comm::describe_error(code).find("capacity"), std::string::npos)
              << "rank " << r << ": " << megamoe::comm::describe_error(code);
        } else {
          EXPECT_EQ(code, 0) << "rank " << r << ": " << megamoe::comm::describe_error(code);
        }
      }
      if (expect_capacity) {
        for (uint16_t v : got) ASSERT_TRUE(std::isnan(bf16_value(v)));
        continue;
      }
      if (call > 0) {
        EXPECT_EQ(got, first_y) << "EP=" << W << " forward differs from its first call, call " << call;
        continue;
      }
      first_y = got;
      const std::vector<double> y = decode(got);
      const double vs_one_gpu = megamoe_test::rel_error(y, decode(expected));
      megamoe_test::Tensor y_ref(MEGAMOE_DTYPE_FLOAT64, {T_all, H});
      ASSERT_EQ(megamoe_test::forward(p, y_ref), MEGAMOE_SUCCESS) << megamoe_last_error();
      const double err = megamoe_test::rel_error(y, y_ref.values());
      std::printf("EP=%d T/rank=%ld H=%ld I=%ld E=%ld k=%ld: rel err %.3e (vs one GPU %.3e)\n", W,
                  long(tokens), long(H), long(I), long(E), long(k), err, vs_one_gpu);
      EXPECT_LT(err, 1e-2);
      EXPECT_LT(vs_one_gpu, kEpVsOneGpu);
    }
    if (expect_capacity) return;

    // The backward, twice on the same buffers (after the forwards above), then once in saved
    // mode (after a forward that keeps h) adding the weight gradients into fp32 buffers.
    std::vector<uint16_t> first_dx;
    for (int call = 0; call < 3; ++call) {
      const bool saved = call == 2;
      if (saved) {
        std::vector<uint16_t> y_saved(T_all * H);
        for (int r = 0; r < W; ++r) {
          CUDA_OK(cudaSetDevice(r));
          Rank& rk = ranks[r];
          megamoe::ep::forward(rk.g, rk.x, rk.ids, false, rk.weights, rk.w1, rk.w2, tokens, I,
                               rk.y, rk.saved_h, rk.workspace, rk.workspace_size, streams_[r]);
        }
        for (int r = 0; r < W; ++r) {
          CUDA_OK(cudaSetDevice(r));
          CUDA_OK(cudaStreamSynchronize(streams_[r]));
          CUDA_OK(cudaMemcpy(y_saved.data() + r * tokens * H, ranks[r].y, tokens * H * 2,
                             cudaMemcpyDeviceToHost));
        }
        EXPECT_EQ(y_saved, first_y) << "the forward that keeps h changed y";
      }
      for (int r = 0; r < W; ++r) {
        CUDA_OK(cudaSetDevice(r));
        Rank& rk = ranks[r];
        CUDA_OK(cudaMemsetAsync(rk.dx, 0xFF, tokens * H * 2, streams_[r]));
        CUDA_OK(cudaMemsetAsync(rk.dw1, 0xFF, e_local * 2 * I * H * 2, streams_[r]));
        CUDA_OK(cudaMemsetAsync(rk.acc1, 0, e_local * 2 * I * H * 4, streams_[r]));
        CUDA_OK(cudaMemsetAsync(rk.acc2, 0, e_local * H * I * 4, streams_[r]));
        using megamoe::chain::WeightGrad;
        const WeightGrad g1 = saved ? WeightGrad::of(rk.acc1, true) : WeightGrad::of(rk.dw1, false);
        const WeightGrad g2 = saved ? WeightGrad::of(rk.acc2, true) : WeightGrad::of(rk.dw2, false);
        megamoe::ep::backward(rk.g, rk.dy, rk.x, rk.ids, false, rk.weights, rk.w1, rk.w2, tokens,
                              I, saved ? rk.saved_h : nullptr, rk.dx, rk.dp, g1, g2,
                              rk.bwd_workspace, rk.bwd_workspace_size, streams_[r]);
      }
      std::vector<uint16_t> dx_all(T_all * H), dw1_all(E * 2 * I * H), dw2_all(E * H * I);
      std::vector<float> dp_all(T_all * k), acc1_all(E * 2 * I * H), acc2_all(E * H * I);
      for (int r = 0; r < W; ++r) {
        CUDA_OK(cudaSetDevice(r));
        CUDA_OK(cudaStreamSynchronize(streams_[r]));
        const Rank& rk = ranks[r];
        CUDA_OK(cudaMemcpy(dx_all.data() + r * tokens * H, rk.dx, tokens * H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dp_all.data() + r * tokens * k, rk.dp, tokens * k * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dw1_all.data() + r * e_local * 2 * I * H, rk.dw1, e_local * 2 * I * H * 2,
                           cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dw2_all.data() + r * e_local * H * I, rk.dw2, e_local * H * I * 2,
                           cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(acc1_all.data() + r * e_local * 2 * I * H, rk.acc1,
                           e_local * 2 * I * H * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(acc2_all.data() + r * e_local * H * I, rk.acc2, e_local * H * I * 4,
                           cudaMemcpyDeviceToHost));
        int32_t code = -1;
        CUDA_OK(cudaMemcpy(&code, tables[r].buffers[r] + megamoe::ep::buffer_layout(rk.g).error, 4,
                           cudaMemcpyDeviceToHost));
        EXPECT_EQ(code, 0) << "rank " << r << ": " << megamoe::comm::describe_error(code);
      }
      if (call == 0) {
        first_dx = dx_all;
        const double vs_one_gpu = megamoe_test::rel_error(decode(dx_all), decode(expected_dx));
        std::printf("  backward dx vs one GPU: %.3e\n", vs_one_gpu);
        EXPECT_LT(vs_one_gpu, kEpVsOneGpu);
      } else {
        EXPECT_EQ(dx_all, first_dx) << "EP backward dx differs from its first call, call " << call;
      }
      EXPECT_EQ(std::memcmp(dp_all.data(), expected_dp.data(), dp_all.size() * 4), 0)
          << "EP backward d topk_weights differs from one GPU, call " << call;
      if (!saved) {
        EXPECT_EQ(dw1_all, expected_dw1) << "EP backward d w_gate_up differs, call " << call;
        EXPECT_EQ(dw2_all, expected_dw2) << "EP backward d w_down differs, call " << call;
        continue;
      }
      // fp32 sums against their bf16 rounding: every element within 2^-9 relative.
      const std::vector<double> a1(acc1_all.begin(), acc1_all.end()),
          a2(acc2_all.begin(), acc2_all.end());
      EXPECT_LT(megamoe_test::rel_error(decode(expected_dw1), a1), 2e-3) << "saved mode, fp32 d w_gate_up";
      EXPECT_LT(megamoe_test::rel_error(decode(expected_dw2), a2), 2e-3) << "saved mode, fp32 d w_down";
    }
  }
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

}  // namespace
