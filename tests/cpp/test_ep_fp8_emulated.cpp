// Blockwise FP8 through the expert-parallel layer, with the ranks emulated on GPU 0 (as in
// test_ep_emulated.cpp; skipped without a GPU): precisions "fp8" and "fp8_bwd", forward and
// both backward modes, on the same global problem as
//   - the one-GPU FP8 layer (megamoe_fused_fp8_*): d topk_weights and the weight gradients
//     bitwise, y and dx within one bf16 rounding per owner (kEpVsOneGpu);
//   - the EP=1 layer at the same precision (one rank, every expert): d topk_weights, the bf16
//     weight gradients and the saved mode's fp32 accumulators bitwise, and y and dx bitwise
//     equal to the sums of its per-owner results (ep_layer_test_util.h: a row's FP8 GEMM
//     results depend only on the row, its 1x128 blocks being its own, so the owner's bf16
//     partial sum is the only difference from one GPU, as in bf16);
//   - its own first call: a second call on the same buffers bitwise equal;
// and with ranks of different numbers of tokens, one of them with none.
// Each rank's FP8 weight copies are its experts' part of what the quantizer makes of the
// global weights (128 x 128 blocks never cross experts). "fp8" runs twice: with the default
// dispatch (x quantized on its rank, e4m3 rows and scales moved) and with the bf16 one
// (Group::fp8_bf16_dispatch: the owner quantizes the bf16 rows it receives), and a third time
// with the backward's dx send beside its weight gradients (Group::overlap_backward); the EP=1
// references always take the default paths, so every path must give their bits. "fp8" and
// "fp8_bwd" run once more with the epilogue combine (Group::epilogue_combine), whose y and dx
// must be the one-GPU FP8 layer's, bit for bit (docs/expert-parallel.md, "Bits").
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ep_layer_test_util.h"
#include "gpu_test_util.h"

namespace {

using megamoe::chain::Precision;
using megamoe::chain::WeightGrad;
using megamoe_test::Routing;

// An FP8 weight copy on GPU 0 (values, values^T, scales) of w [E, N, K] bf16.
struct Fp8Copy {
  void *q = nullptr, *q_t = nullptr, *scales = nullptr;
};

// The precision, and for "fp8" the forward's dispatch or the backward's overlap; either
// precision with the epilogue combine.
enum Fp8Case {
  kFp8 = 0,
  kFp8Bwd = 1,
  kFp8Bf16Dispatch = 2,
  kFp8OverlapBackward = 3,
  kFp8EpilogueCombine = 4,
  kFp8BwdEpilogueCombine = 5
};
const char* const kFp8CaseNames[] = {"Fp8",
                                     "Fp8Bwd",
                                     "Fp8_Bf16Dispatch",
                                     "Fp8_OverlapBackward",
                                     "Fp8_EpilogueCombine",
                                     "Fp8Bwd_EpilogueCombine"};

// Parameters: the emulated world size, the case.
class EpFp8Emulated : public megamoe_test::EpLayerTest,
                      public ::testing::WithParamInterface<std::tuple<int, int>> {
 protected:
  void SetUp() override {
    const int c = std::get<1>(GetParam());
    fp8_bf16_dispatch_ = c == kFp8Bf16Dispatch;
    overlap_backward_ = c == kFp8OverlapBackward;
    epilogue_combine_ = c == kFp8EpilogueCombine || c == kFp8BwdEpilogueCombine;
    // The backward overlap's side streams made with the ranks' own (kQueuePerEmulatedRank):
    // one the library made at a later call could share a hardware queue with another rank's.
    emulate(std::get<0>(GetParam()), overlap_backward_);
  }
  // The forward in FP8 ("fp8") or bf16 ("fp8_bwd").
  bool forward_fp8() const {
    return std::get<1>(GetParam()) != kFp8Bwd && std::get<1>(GetParam()) != kFp8BwdEpilogueCombine;
  }
  Precision precision() const { return forward_fp8() ? Precision::kFp8 : Precision::kFp8Backward; }

  Fp8Copy quantize(const void* w, int64_t E, int64_t N, int64_t K) {
    Fp8Copy c{alloc_on(0, E * N * K), alloc_on(0, E * N * K), alloc_on(0, E * N / 128 * K / 128 * 4)};
    megamoe_tensor tw = megamoe_test::dense_tensor(const_cast<void*>(w), MEGAMOE_DTYPE_BFLOAT16, {E, N, K});
    megamoe_tensor tq = megamoe_test::dense_tensor(c.q, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, N, K});
    megamoe_tensor tt = megamoe_test::dense_tensor(c.q_t, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, K, N});
    megamoe_tensor ts = megamoe_test::dense_tensor(c.scales, MEGAMOE_DTYPE_FLOAT32, {E, N / 128, K / 128});
    EXPECT_EQ(megamoe_quantize_fp8_128x128(&tw, &tq, &tt, &ts, nullptr), MEGAMOE_SUCCESS)
        << megamoe_last_error();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return c;
  }

  // Experts over w_gate_up w1 and w_down w2 on GPU 0 with their FP8 copies, at this test's
  // precision.
  megamoe::chain::Experts experts(const void* w1, const void* w2, const Fp8Copy& g,
                                  const Fp8Copy& d) const {
    megamoe::chain::Experts x{static_cast<const __nv_bfloat16*>(w1),
                              static_cast<const __nv_bfloat16*>(w2), H(), I()};
    x.precision = precision();
    x.fp8_gate_up = {static_cast<const __nv_fp8_e4m3*>(g.q), static_cast<const __nv_fp8_e4m3*>(g.q_t),
                     static_cast<const float*>(g.scales)};
    x.fp8_down = {static_cast<const __nv_fp8_e4m3*>(d.q), static_cast<const __nv_fp8_e4m3*>(d.q_t),
                  static_cast<const float*>(d.scales)};
    return x;
  }
  // Rank r's experts.
  megamoe::chain::Experts rank_experts(int r) const {
    return experts(ranks_[r].w1, ranks_[r].w2, gate_up_[r], down_[r]);
  }

  // Every expert's weights and FP8 copies on GPU 0 (global_, for the one-GPU and EP=1 layers).
  void make_global_experts() {
    const int64_t H = this->H(), I = this->I(), E = p_.d.E;
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    global_w1_ = upload_on(0, w1_);
    global_w2_ = upload_on(0, w2_);
    global_gate_up_ = quantize(global_w1_, E, 2 * I, H);
    global_down_ = quantize(global_w2_, E, H, I);
    global_ = experts(global_w1_, global_w2_, global_gate_up_, global_down_);
  }

  // The one-GPU FP8 layer on the whole problem (make_global_experts() first): forward,
  // backward in recompute mode with bf16 weight gradients.
  SingleRank one_gpu_fp8() {
    const int64_t T = T_all(), H = this->H(), I = this->I(), E = p_.d.E, k = this->k();
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    using megamoe_test::dense_tensor;
    const Fp8Copy& g = global_gate_up_;
    const Fp8Copy& d = global_down_;
    megamoe_tensor gx = dense_tensor(upload_on(0, x_), MEGAMOE_DTYPE_BFLOAT16, {T, H});
    megamoe_tensor gids = dense_tensor(upload_on(0, ids_), MEGAMOE_DTYPE_INT32, {T, k});
    megamoe_tensor gp = dense_tensor(upload_on(0, weights_), MEGAMOE_DTYPE_FLOAT32, {T, k});
    megamoe_tensor gw1 = dense_tensor(global_w1_, MEGAMOE_DTYPE_BFLOAT16, {E, 2 * I, H});
    megamoe_tensor gw2 = dense_tensor(global_w2_, MEGAMOE_DTYPE_BFLOAT16, {E, H, I});
    megamoe_tensor q1 = dense_tensor(g.q, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, 2 * I, H});
    megamoe_tensor t1 = dense_tensor(g.q_t, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, H, 2 * I});
    megamoe_tensor s1 = dense_tensor(g.scales, MEGAMOE_DTYPE_FLOAT32, {E, 2 * I / 128, H / 128});
    megamoe_tensor q2 = dense_tensor(d.q, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, H, I});
    megamoe_tensor t2 = dense_tensor(d.q_t, MEGAMOE_DTYPE_FLOAT8_E4M3, {E, I, H});
    megamoe_tensor s2 = dense_tensor(d.scales, MEGAMOE_DTYPE_FLOAT32, {E, H / 128, I / 128});
    megamoe_tensor gy = dense_tensor(alloc_on(0, T * H * 2), MEGAMOE_DTYPE_BFLOAT16, {T, H});
    size_t bytes = 0;
    if (forward_fp8()) {
      EXPECT_EQ(megamoe_fused_fp8_workspace_size(T, k, H, I, E, &bytes), MEGAMOE_SUCCESS);
      EXPECT_EQ(megamoe_fused_fp8_forward(&gx, &gids, &gp, &gw1, &gw2, &q1, &s1, &q2, &s2, &gy,
                                          nullptr, alloc_on(0, bytes), bytes, nullptr),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
    } else {
      EXPECT_EQ(megamoe_fused_workspace_size(T, k, H, I, E, &bytes), MEGAMOE_SUCCESS);
      EXPECT_EQ(megamoe_fused_forward(&gx, &gids, &gp, &gw1, &gw2, &gy, nullptr,
                                      alloc_on(0, bytes), bytes, nullptr),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
    }
    OneGpuGrads gr = one_gpu_grads();
    EXPECT_EQ(megamoe_fused_fp8_backward_workspace_size(T, k, H, I, E, 0, forward_fp8(), &bytes),
              MEGAMOE_SUCCESS);
    EXPECT_EQ(megamoe_fused_fp8_backward(&gr.dy, &gx, &gids, &gp, &gw1, &gw2, &q1, &t1, &s1, &t2,
                                         &s2, forward_fp8(), nullptr, &gr.dx, &gr.dp, &gr.d1,
                                         &gr.d2, alloc_on(0, bytes), bytes, nullptr),
              MEGAMOE_SUCCESS)
        << megamoe_last_error();
    return download_one_gpu(gy, gr);
  }

  // The EP layer at this precision against the one-GPU and EP=1 FP8 layers (the header
  // comment lists what).
  void check_fp8(int64_t tokens, int64_t H, int64_t I, int64_t E, int64_t k, Routing routing,
                 double p_none, uint64_t seed) {
    SEEDED(seed);
    const int W = world_;
    prepare(tokens, H, I, E, k, routing, p_none, tokens * k * W, seed);
    if (HasFatalFailure()) return;
    make_global_experts();
    const SingleRank fused = one_gpu_fp8();
    const SingleRank ep1 = single_rank(ids_, true, false, false, &global_);
    std::vector<uint16_t> expected_y, expected_dx;
    owner_sums(ids_, expected_y, expected_dx, &global_);
    if (epilogue_combine_) {  // every slot's row folded on its token's rank, as on one GPU
      expected_y = fused.y;
      expected_dx = fused.dx;
    }
    const char* expected_name =
        epilogue_combine_ ? "the one-GPU FP8 layer's" : "the EP=1 FP8 owners' sum";
    const int64_t e = e_local_;
    gate_up_.clear();
    down_.clear();
    for (int r = 0; r < W; ++r) {
      gate_up_.push_back(quantize(ranks_[r].w1, e, 2 * I, H));
      down_.push_back(quantize(ranks_[r].w2, e, H, I));
    }
    // FP8 workspaces (the bf16 ones prepare() made may be smaller).
    std::vector<void*> fwd_ws(W), bwd_ws(W);
    std::vector<size_t> fwd_bytes(W), bwd_bytes(W);
    for (int r = 0; r < W; ++r) {
      const int64_t T = rank_tokens_[r];
      fwd_bytes[r] = megamoe::ep::forward_workspace_bytes(ranks_[r].g, T, I, precision());
      bwd_bytes[r] = megamoe::ep::backward_workspace_bytes(ranks_[r].g, T, I, false, precision());
      EXPECT_LE(megamoe::ep::backward_workspace_bytes(ranks_[r].g, T, I, true, precision()),
                bwd_bytes[r]);
      fwd_ws[r] = alloc_on(device_of(r), fwd_bytes[r]);
      bwd_ws[r] = alloc_on(device_of(r), bwd_bytes[r]);
    }
    const auto forward = [&](bool keep_h) {
      for (int r = 0; r < W; ++r) {
        const OnRank on = on_rank(r);
        Rank& rk = ranks_[r];
        const int64_t T = rank_tokens_[r];
        if (T > 0) {
          EXPECT_EQ(cudaMemsetAsync(rk.y, 0xFF, T * H * 2, streams_[r]), cudaSuccess);
        }
        megamoe::ep::forward(rk.g, rk.x, rk.ids, false, rk.weights, rank_experts(r), T, rk.y,
                             keep_h ? rk.saved_h : nullptr, fwd_ws[r], fwd_bytes[r], streams_[r]);
      }
      sync_ranks();
      expect_no_errors("forward");
      return gather_tokens<uint16_t>(&Rank::y, H);
    };
    // Recompute or saved mode; the weight gradients written in bf16, or added into the
    // zeroed fp32 accumulators.
    const auto backward = [&](bool saved, bool fp32) {
      for (int r = 0; r < W; ++r) {
        const OnRank on = on_rank(r);
        Rank& rk = ranks_[r];
        const int64_t T = rank_tokens_[r];
        if (T > 0) {
          EXPECT_EQ(cudaMemsetAsync(rk.dx, 0xFF, T * H * 2, streams_[r]), cudaSuccess);
          EXPECT_EQ(cudaMemsetAsync(rk.dp, 0xFF, T * k * 4, streams_[r]), cudaSuccess);
        }
        EXPECT_EQ(cudaMemsetAsync(rk.dw1, 0xFF, e * 2 * I * H * 2, streams_[r]), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(rk.dw2, 0xFF, e * H * I * 2, streams_[r]), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(rk.acc1, 0, e * 2 * I * H * 4, streams_[r]), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(rk.acc2, 0, e * H * I * 4, streams_[r]), cudaSuccess);
        megamoe::ep::backward(rk.g, rk.dy, rk.x, rk.ids, false, rk.weights, rank_experts(r), T,
                              saved ? rk.saved_h : nullptr, rk.dx, rk.dp,
                              fp32 ? WeightGrad::of(rk.acc1, true) : WeightGrad::of(rk.dw1, false),
                              fp32 ? WeightGrad::of(rk.acc2, true) : WeightGrad::of(rk.dw2, false),
                              bwd_ws[r], bwd_bytes[r], streams_[r]);
      }
      sync_ranks();
      expect_no_errors(saved ? "backward (saved)" : "backward");
    };

    const std::vector<uint16_t> y = forward(false);
    const double y_err = megamoe_test::rel_error(megamoe_test::decode(y), megamoe_test::decode(fused.y));
    std::printf("EP=%d (emulated) %s T/rank=%ld H=%ld I=%ld E=%ld k=%ld: y vs one GPU %.3e\n", W,
                forward_fp8() ? "fp8" : "fp8_bwd", long(tokens), long(H), long(I), long(E), long(k),
                y_err);
    EXPECT_LT(y_err, megamoe_test::kEpVsOneGpu);
    EXPECT_EQ(y, expected_y) << "EP=" << W << " y differs from " << expected_name;
    EXPECT_EQ(forward(false), y) << "a second forward on the same buffers differs from the first";

    // Recompute mode, saved mode (bf16 weight gradients: the same as recompute mode's), saved
    // mode into fp32 accumulators.
    const std::pair<bool, bool> passes[] = {{false, false}, {true, false}, {true, true}};
    for (const auto& [saved, fp32] : passes) {
      SCOPED_TRACE(std::string(saved ? "saved mode" : "recompute mode") +
                   (fp32 ? ", fp32 accumulators" : ", bf16 weight gradients"));
      if (saved) {
        EXPECT_EQ(forward(true), y) << "the forward that keeps h changed y";
      }
      backward(saved, fp32);
      const auto dx = gather_tokens<uint16_t>(&Rank::dx, H);
      const auto dp = gather_tokens<float>(&Rank::dp, k);
      const double dx_err = megamoe_test::rel_error(megamoe_test::decode(dx), megamoe_test::decode(fused.dx));
      std::printf("  backward (%s%s) dx vs one GPU %.3e\n", saved ? "saved" : "recompute",
                  fp32 ? ", fp32" : "", dx_err);
      EXPECT_LT(dx_err, megamoe_test::kEpVsOneGpu);
      EXPECT_EQ(dx, expected_dx) << "EP=" << W << " dx differs from " << expected_name;
      EXPECT_EQ(std::memcmp(dp.data(), fused.dp.data(), dp.size() * 4), 0)
          << "d topk_weights differs from the one-GPU FP8 layer";
      EXPECT_EQ(std::memcmp(dp.data(), ep1.dp.data(), dp.size() * 4), 0)
          << "d topk_weights differs from the EP=1 FP8 layer";
      if (!fp32) {
        const auto dw1 = gather<uint16_t>(&Rank::dw1, e * 2 * I * H);
        const auto dw2 = gather<uint16_t>(&Rank::dw2, e * H * I);
        EXPECT_EQ(dw1, fused.dw1) << "d w_gate_up differs from the one-GPU FP8 layer";
        EXPECT_EQ(dw2, fused.dw2) << "d w_down differs from the one-GPU FP8 layer";
        EXPECT_EQ(dw1, ep1.dw1) << "d w_gate_up differs from the EP=1 FP8 layer";
        EXPECT_EQ(dw2, ep1.dw2) << "d w_down differs from the EP=1 FP8 layer";
        continue;
      }
      const auto acc1 = gather<float>(&Rank::acc1, e * 2 * I * H);
      const auto acc2 = gather<float>(&Rank::acc2, e * H * I);
      EXPECT_EQ(std::memcmp(acc1.data(), ep1.acc1.data(), acc1.size() * 4), 0)
          << "fp32 d w_gate_up differs from the EP=1 FP8 layer's saved mode";
      EXPECT_EQ(std::memcmp(acc2.data(), ep1.acc2.data(), acc2.size() * 4), 0)
          << "fp32 d w_down differs from the EP=1 FP8 layer's saved mode";
      // fp32 sums against their bf16 rounding: every element within 2^-9 relative.
      const std::vector<double> a1(acc1.begin(), acc1.end()), a2(acc2.begin(), acc2.end());
      EXPECT_LT(megamoe_test::rel_error(megamoe_test::decode(fused.dw1), a1), 2e-3) << "fp32 d w_gate_up";
      EXPECT_LT(megamoe_test::rel_error(megamoe_test::decode(fused.dw2), a2), 2e-3) << "fp32 d w_down";
    }
  }

  std::vector<Fp8Copy> gate_up_, down_;  // each rank's
  void *global_w1_ = nullptr, *global_w2_ = nullptr;
  Fp8Copy global_gate_up_, global_down_;
  megamoe::chain::Experts global_{};
};

TEST_P(EpFp8Emulated, MatchesOneGpuFp8Layer) {
  const uint64_t seed = megamoe_test::fresh_seed();
  check_fp8(96, 256, 128, 16, 4, Routing::kRandom, 0.05, seed);
  check_fp8(100, 512, 256, 16, 2, Routing::kRandom, 0.0, seed + 1);
}

TEST_P(EpFp8Emulated, KIsOne) {
  check_fp8(129, 256, 128, 8, 1, Routing::kRandom, 0.1, megamoe_test::fresh_seed());
}

TEST_P(EpFp8Emulated, EveryTokenOnOneRank) {
  // Ranks other than the last receive nothing; the last receives every row.
  check_fp8(64, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, megamoe_test::fresh_seed());
}

// Ranks with different numbers of tokens, the first with none (its token tensors null, so
// nothing of its own to quantize); then the counts reversed and every row on the last rank,
// which has no tokens.
TEST_P(EpFp8Emulated, UnevenTokensAndARankWithNone) {
  const uint64_t seed = megamoe_test::fresh_seed();
  constexpr int64_t kMost = 96;
  uneven_tokens_ = megamoe_test::uneven_token_counts(world_, kMost);
  check_fp8(kMost, 256, 128, 16, 4, Routing::kRandom, 0.05, seed);
  std::reverse(uneven_tokens_.begin(), uneven_tokens_.end());
  check_fp8(kMost, 256, 128, 8, 2, Routing::kAllOnLastRank, 0.0, seed + 1);
}

INSTANTIATE_TEST_SUITE_P(Emulated, EpFp8Emulated,
                         ::testing::Combine(::testing::Values(2, 8),
                                            ::testing::Values(kFp8, kFp8Bwd, kFp8Bf16Dispatch,
                                                              kFp8OverlapBackward,
                                                              kFp8EpilogueCombine,
                                                              kFp8BwdEpilogueCombine)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return "EP" + std::to_string(std::get<0>(info.param)) + "_" +
                                  kFp8CaseNames[std::get<1>(info.param)];
                         });

}  // namespace
