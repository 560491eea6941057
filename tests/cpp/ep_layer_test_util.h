// EpLayerTest: the expert-parallel layer's cases, shared by the tests on one rank per GPU
// (test_ep_layer.cpp) and on ranks emulated on one GPU (test_ep_emulated.cpp). A global
// problem is cut into every rank's tokens and experts; check() runs EP=W forward and
// backward (recompute and saved mode) on it and compares them with
//   - the EP=1 layer on GPU 0 (one rank, every expert): d topk_weights, the bf16 weight
//     gradients and the saved mode's fp32 accumulators bitwise; y and dx bitwise against
//     the EP=1 layer's per-owner parts (below), but with the epilogue combine;
//   - the one-GPU fused layer: d topk_weights and weight gradients bitwise, y and dx
//     within 5e-3 (one bf16 rounding per owner rank), or bitwise with the epilogue combine
//     (which folds every slot's row on the token's rank, as the one-GPU layer does), and
//     the forward against the float64 CPU reference;
//   - its own first call: later calls on the same buffers bitwise equal.
// Every rank has the same number of tokens unless uneven_tokens_ says otherwise; a rank with
// none gives the layer null token tensors, as torch does for empty ones.
// With epilogue_combine_, overlap_dispatch_, fp8_bf16_dispatch_ or overlap_backward_ set
// before prepare(), every EP=W group runs the forward's epilogue combine, its dispatch beside
// the own rows' chain, (FP8) its bf16 dispatch, or the backward's dx send beside its weight
// gradients (the Group fields of the same names); the EP=1
// references stay on the default path, so the comparisons above also say that the paths give
// the same bits (the epilogue combine's y and dx: the one-GPU layer's).
// Owner o's partial row of a token is the sum over its slots on o, rounded once to bf16:
// what the EP=1 layer gives with every slot on another rank's expert set to -1 (a row's
// GEMM results do not depend on the other rows). The source sums the partials in rank order
// in fp32 and rounds once more, so y and dx are that sum of EP=1 results, bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "comm/ep_layer.h"
#include "multi_gpu_test_util.h"
#include "test_util.h"

namespace megamoe_test {

inline std::vector<double> decode(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_value(bits[i]);
  return v;
}
constexpr double kEpVsOneGpu = 5e-3;  // y and dx: one bf16 rounding per owner's partial sum
constexpr int64_t kLongTimeoutNs = 10'000'000'000;
enum class Routing { kRandom, kAllOnLastRank };

// The EP forward's paths, by their Group switches (docs/expert-parallel.md, "Forward
// overlap"); every one must give the default path's bits, but the epilogue combine's y and
// dx, which must be the one-GPU layer's (docs/expert-parallel.md, "Bits"). The overlapped ones
// also send the backward's dx rows beside its weight gradients (Group::overlap_backward), as
// a user who turns on both switches runs them.
enum EpPath { kDefault = 0, kEpilogueCombine = 1, kOverlapDispatch = 2, kOverlapAndEpilogue = 3 };
inline const char* const kEpPathNames[] = {"Default", "EpilogueCombine", "OverlapDispatch",
                                           "Overlap_EpilogueCombine"};
inline constexpr int kEpPaths[] = {kDefault, kEpilogueCombine, kOverlapDispatch,
                                   kOverlapAndEpilogue};

// Tokens of W ranks for EpLayerTest::uneven_tokens_: none on the first rank, `most` on the
// last, counts between on the others.
inline std::vector<int64_t> uneven_token_counts(int W, int64_t most) {
  std::vector<int64_t> counts(W);
  for (int r = 0; r < W; ++r) counts[r] = r == 0 ? 0 : r == W - 1 ? most : 1 + (29 * r) % most;
  return counts;
}

// Bytes of each rank's symmetric buffer for g (whose buffers need not exist yet).
inline size_t ep_buffer_bytes(megamoe::ep::Group g) {
  for (int r = 0; r < g.peers.world_size; ++r) g.peers.buffers[r] = reinterpret_cast<char*>(1);
  return megamoe::ep::buffer_layout(g).total;
}

// y (or dx) of the EP layer from its owners' partials [W][T * H]: summed in rank order in
// fp32, rounded to bf16, as the final combine does.
inline std::vector<uint16_t> sum_partials(const std::vector<std::vector<uint16_t>>& partials) {
  std::vector<uint16_t> out(partials.at(0).size());
  for (size_t i = 0; i < out.size(); ++i) {
    float acc = 0.f;
    for (const auto& p : partials) acc += static_cast<float>(bf16_value(p[i]));
    out[i] = bf16_bits(acc);
  }
  return out;
}

class EpLayerTest : public RanksTest {
 protected:
  // The library forgets the side streams prepare() gave it before RanksTest destroys them
  // (a later group whose buffer lands at the same address makes its own).
  void TearDown() override {
    for (const megamoe::ep::Group& g : side_stream_groups_) {
      cudaSetDevice(0);  // emulated
      try {
        megamoe::ep::set_side_stream(g, nullptr);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "set_side_stream(g, nullptr): " << e.what();
      }
    }
    side_stream_groups_.clear();
    RanksTest::TearDown();
  }

  struct Rank {
    megamoe::ep::Group g;
    __nv_bfloat16 *x, *w1, *w2, *y, *dy, *dx, *dw1, *dw2, *saved_h;
    float *acc1, *acc2;  // fp32 weight-gradient accumulators (saved-mode call)
    int32_t* ids;
    float *weights, *dp;
    void *workspace, *bwd_workspace;
    size_t workspace_size, bwd_workspace_size;
  };

  // Outputs of the EP=1 layer on the whole problem (acc1, acc2: saved mode only).
  struct SingleRank {
    std::vector<uint16_t> y, dx, dw1, dw2;
    std::vector<float> dp, acc1, acc2;
  };

  template <class T>
  T* upload_on(int device, const std::vector<T>& h) {
    auto* d = static_cast<T*>(alloc_on(device, h.size() * sizeof(T)));
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }
  // Rank r's part [r * per_rank, (r + 1) * per_rank) of a global array, on its device.
  template <class T>
  T* upload_part(int r, const std::vector<T>& global, int64_t per_rank) {
    return upload_on(device_of(r), std::vector<T>(global.begin() + r * per_rank,
                                                  global.begin() + (r + 1) * per_rank));
  }
  // Rank r's tokens' part of a global per-token array of `per_token` elements a token; null
  // for a rank with no tokens, as torch gives an empty tensor's data.
  template <class T>
  T* upload_tokens(int r, const std::vector<T>& global, int64_t per_token) {
    if (rank_tokens_[r] == 0) return nullptr;
    const auto first = global.begin() + rank_first_[r] * per_token;
    return upload_on(device_of(r), std::vector<T>(first, first + rank_tokens_[r] * per_token));
  }
  template <class T>
  std::vector<T> download(const void* d, int64_t count) {
    std::vector<T> h(count);
    EXPECT_EQ(cudaMemcpy(h.data(), d, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  // One call's part of every rank's array of per-call outputs (elements [call * per_rank,
  // (call + 1) * per_rank) of bufs[r]), in rank order: that call's global output.
  template <class T, class Buf>
  std::vector<T> gather_call(const std::vector<Buf*>& bufs, int call, int64_t per_rank) {
    std::vector<T> out;
    for (const Buf* b : bufs) {
      const std::vector<T> part = download<T>(b + call * per_rank, per_rank);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }

  // The global problem of every rank's tokens, in rank order, and every rank's part of it on
  // its device, on fresh zeroed symmetric buffers. tokens: per rank, the group's max_tokens;
  // every rank has that many unless uneven_tokens_ gives each rank's count.
  void prepare(int64_t tokens, int64_t H, int64_t I, int64_t E, int64_t k, Routing routing,
               double p_none, int64_t max_recv_rows, uint64_t seed, int32_t comm_sms = 0,
               int64_t timeout_ns = kLongTimeoutNs) {
    const int W = world_;
    ASSERT_EQ(E % W, 0);
    e_local_ = E / W;
    if (uneven_tokens_.empty()) {
      rank_tokens_.assign(W, tokens);
    } else {
      ASSERT_EQ(uneven_tokens_.size(), size_t(W)) << "uneven_tokens_: one count per rank";
      rank_tokens_ = uneven_tokens_;
    }
    rank_first_.assign(W, 0);
    int64_t T_all = 0;
    for (int r = 0; r < W; ++r) {
      ASSERT_TRUE(rank_tokens_[r] >= 0 && rank_tokens_[r] <= tokens) << "rank " << r;
      rank_first_[r] = T_all;
      T_all += rank_tokens_[r];
    }
    std::mt19937_64 rng(seed);
    const int64_t used = routing == Routing::kAllOnLastRank ? e_local_ : E;
    p_ = random_problem(rng, {T_all, H, I, E, k}, std::min(used, E), p_none);
    if (routing == Routing::kAllOnLastRank) {  // every id into the last rank's experts
      for (int64_t s = 0; s < T_all * k; ++s) {
        if (p_.ids.get(s) >= 0) p_.ids.set(s, p_.ids.get(s) + (W - 1) * e_local_);
      }
    }
    x_ = round_to_bf16(p_.x);
    w1_ = round_to_bf16(p_.w_gate_up);
    w2_ = round_to_bf16(p_.w_down);
    dy_ = round_to_bf16(p_.dy);
    ids_.assign(T_all * k, 0);
    weights_.assign(T_all * k, 0.f);
    for (int64_t s = 0; s < T_all * k; ++s) {
      ids_[s] = static_cast<int32_t>(p_.ids.get(s));
      weights_[s] = static_cast<float>(p_.weights.get(s));
      p_.weights.set(s, weights_[s]);
    }

    group_ = {};
    group_.num_experts = E;
    group_.max_tokens = tokens;
    group_.topk = k;
    group_.hidden = H;
    group_.max_recv_rows = max_recv_rows;
    group_.timeout_ns = timeout_ns;
    group_.comm_sms = comm_sms;
    group_.epilogue_combine = epilogue_combine_;
    group_.overlap_dispatch = overlap_dispatch_;
    group_.fp8_bf16_dispatch = fp8_bf16_dispatch_;
    group_.overlap_backward = overlap_backward_;
    group_.peers.world_size = W;
    tables_ = make_tables(ep_buffer_bytes(group_));

    const int64_t e = e_local_;
    ranks_.assign(W, Rank{});
    for (int r = 0; r < W; ++r) {
      Rank& rk = ranks_[r];
      const int dev = device_of(r);
      rk.g = group_;
      rk.g.peers = tables_[r];
      if (!side_streams_.empty()) {  // emulated: the rank's side stream is the one made for it
        ASSERT_EQ(cudaSetDevice(dev), cudaSuccess);
        ASSERT_NO_THROW(megamoe::ep::set_side_stream(rk.g, side_streams_[r]));
        side_stream_groups_.push_back(rk.g);
      }
      const auto bf16 = [](void* p) { return static_cast<__nv_bfloat16*>(p); };
      const int64_t T = rank_tokens_[r];
      rk.x = bf16(upload_tokens(r, x_, H));
      rk.ids = upload_tokens(r, ids_, k);
      rk.weights = upload_tokens(r, weights_, k);
      rk.w1 = bf16(upload_part(r, w1_, e * 2 * I * H));
      rk.w2 = bf16(upload_part(r, w2_, e * H * I));
      const auto alloc_tokens = [&](int64_t bytes_per_token) {
        return T > 0 ? alloc_on(dev, T * bytes_per_token) : nullptr;
      };
      rk.y = bf16(alloc_tokens(H * 2));
      rk.dy = bf16(upload_tokens(r, dy_, H));
      rk.dx = bf16(alloc_tokens(H * 2));
      rk.dp = static_cast<float*>(alloc_tokens(k * 4));
      rk.dw1 = bf16(alloc_on(dev, e * 2 * I * H * 2));
      rk.dw2 = bf16(alloc_on(dev, e * H * I * 2));
      rk.workspace_size = megamoe::ep::forward_workspace_bytes(rk.g, T, I);
      rk.workspace = alloc_on(dev, rk.workspace_size);
      rk.saved_h = bf16(alloc_on(dev, max_recv_rows * 2 * I * 2));
      rk.acc1 = static_cast<float*>(alloc_on(dev, e * 2 * I * H * 4));
      rk.acc2 = static_cast<float*>(alloc_on(dev, e * H * I * 4));
      // Recompute mode needs the larger workspace; saved mode uses the same one.
      rk.bwd_workspace_size = megamoe::ep::backward_workspace_bytes(rk.g, T, I, false);
      EXPECT_LE(megamoe::ep::backward_workspace_bytes(rk.g, T, I, true), rk.bwd_workspace_size);
      rk.bwd_workspace = alloc_on(dev, rk.bwd_workspace_size);
    }
  }

  int64_t H() const { return p_.d.H; }
  int64_t I() const { return p_.d.I; }
  int64_t k() const { return p_.d.k; }
  int64_t T_all() const { return p_.d.T; }

  // Rank r's forward into y (null: its own), keeping h when asked. ids: null for its own.
  void launch_forward(int r, bool keep_h, const int32_t* ids = nullptr,
                      __nv_bfloat16* y = nullptr) {
    const OnRank on = on_rank(r);
    Rank& rk = ranks_[r];
    megamoe::ep::forward(rk.g, rk.x, ids ? ids : rk.ids, false, rk.weights, rk.w1, rk.w2,
                         rank_tokens_[r], I(), y ? y : rk.y, keep_h ? rk.saved_h : nullptr,
                         rk.workspace, rk.workspace_size, streams_[r]);
  }

  // Rank r's backward: recompute mode into bf16 dw1, dw2, or saved mode added into acc1,
  // acc2 (zeroed first); with the rank's ids or `ids`, into its dx and dp or `dx` and `dp`.
  // dx, dp and dw1 are poisoned first unless !nan_first, which leaves them as they are.
  void launch_backward(int r, bool saved, const int32_t* ids = nullptr,
                       __nv_bfloat16* dx = nullptr, float* dp = nullptr, bool nan_first = true) {
    const OnRank on = on_rank(r);
    Rank& rk = ranks_[r];
    const int64_t e = e_local_, H = this->H(), I = this->I();
    if (dx == nullptr) dx = rk.dx;
    if (dp == nullptr) dp = rk.dp;
    const int64_t T = rank_tokens_[r];
    if (nan_first) {
      if (T > 0) {
        CUDA_OK(cudaMemsetAsync(dx, 0xFF, T * H * 2, streams_[r]));
        CUDA_OK(cudaMemsetAsync(dp, 0xFF, T * k() * 4, streams_[r]));
      }
      CUDA_OK(cudaMemsetAsync(rk.dw1, 0xFF, e * 2 * I * H * 2, streams_[r]));
    }
    CUDA_OK(cudaMemsetAsync(rk.acc1, 0, e * 2 * I * H * 4, streams_[r]));
    CUDA_OK(cudaMemsetAsync(rk.acc2, 0, e * H * I * 4, streams_[r]));
    using megamoe::chain::WeightGrad;
    const WeightGrad g1 = saved ? WeightGrad::of(rk.acc1, true) : WeightGrad::of(rk.dw1, false);
    const WeightGrad g2 = saved ? WeightGrad::of(rk.acc2, true) : WeightGrad::of(rk.dw2, false);
    megamoe::ep::backward(rk.g, rk.dy, rk.x, ids ? ids : rk.ids, false, rk.weights, rk.w1,
                          rk.w2, T, I, saved ? rk.saved_h : nullptr, dx, dp, g1, g2,
                          rk.bwd_workspace, rk.bwd_workspace_size, streams_[r]);
  }

  void sync_ranks() {
    for (int r = 0; r < world_; ++r) {
      CUDA_OK(cudaSetDevice(device_of(r)));
      CUDA_OK(cudaStreamSynchronize(streams_[r]));
    }
  }

  // Rank r's error word after its last call (its stream synced).
  int32_t error_of(int r) { return error_words(r)[0]; }
  // Rank r's two error words (its stream synced): its last call's code and the first
  // failure's since the buffer was made.
  std::vector<int32_t> error_words(int r) {
    EXPECT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
    return download<int32_t>(tables_[r].buffers[r] + megamoe::ep::buffer_layout(ranks_[r].g).error,
                             2);
  }
  void expect_no_errors(const std::string& what) {
    for (int r = 0; r < world_; ++r) {
      const int32_t code = error_of(r);
      EXPECT_EQ(code, 0) << what << ", rank " << r << ": " << megamoe::comm::describe_error(code);
    }
  }

  // Every rank's `per_rank` elements of an output, in rank order (the streams synced).
  template <class Host, class Device>
  std::vector<Host> gather(Device* Rank::*output, int64_t per_rank) {
    static_assert(sizeof(Host) == sizeof(Device));
    std::vector<Host> all(world_ * per_rank);
    for (int r = 0; r < world_; ++r) {
      EXPECT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(all.data() + r * per_rank, ranks_[r].*output, per_rank * sizeof(Host),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return all;
  }

  // Every rank's tokens' rows of a per-token output of `per_token` elements a token, in rank
  // order: the global problem's rows (the streams synced).
  template <class Host, class Device>
  std::vector<Host> gather_tokens(Device* Rank::*output, int64_t per_token) {
    static_assert(sizeof(Host) == sizeof(Device));
    std::vector<Host> all(T_all() * per_token);
    for (int r = 0; r < world_; ++r) {
      if (rank_tokens_[r] == 0) continue;
      EXPECT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(all.data() + rank_first_[r] * per_token, ranks_[r].*output,
                           rank_tokens_[r] * per_token * sizeof(Host), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return all;
  }

  // Global ids with only owner o's experts kept (every other slot -1).
  std::vector<int32_t> owner_ids(std::vector<int32_t> ids, int o) const {
    for (int32_t& id : ids) {
      if (id >= 0 && id / e_local_ != o) id = -1;
    }
    return ids;
  }

  // The EP=1 layer (one rank, every expert) on GPU 0 on the whole problem with `ids`:
  // forward, backward in recompute mode, and with saved_mode the saved-mode backward into
  // fp32 accumulators; on the default path unless epilogue_combine. experts: null for the
  // problem's bf16 weights, or every expert's weights on GPU 0 at their precision (FP8).
  SingleRank single_rank(const std::vector<int32_t>& ids, bool saved_mode,
                         bool epilogue_combine = false, bool overlap_dispatch = false,
                         const megamoe::chain::Experts* experts = nullptr) {
    SingleRank out;
    const int64_t T = T_all(), H = this->H(), I = this->I(), E = p_.d.E, k = this->k();
    megamoe::ep::Group g = group_;
    g.peers = {};
    g.peers.world_size = 1;
    g.max_tokens = T;
    g.max_recv_rows = T * k;
    g.comm_sms = 0;
    g.epilogue_combine = epilogue_combine;
    g.overlap_dispatch = overlap_dispatch;
    g.overlap_backward = false;   // the references' backward on the default path
    g.fp8_bf16_dispatch = false;  // the FP8 forward's default (quantized) dispatch
    g.peers.buffers[0] = static_cast<char*>(alloc_on(0, ep_buffer_bytes(g)));
    const auto bf16 = [](void* p) { return static_cast<__nv_bfloat16*>(p); };
    const auto* x = bf16(upload_on(0, x_));
    const auto* dy = bf16(upload_on(0, dy_));
    const megamoe::chain::Experts ex =
        experts != nullptr ? *experts
                           : megamoe::chain::Experts{bf16(upload_on(0, w1_)),
                                                     bf16(upload_on(0, w2_)), H, I};
    const int32_t* d_ids = upload_on(0, ids);
    const float* weights = upload_on(0, weights_);
    auto* y = bf16(alloc_on(0, T * H * 2));
    auto* dx = bf16(alloc_on(0, T * H * 2));
    auto* dp = static_cast<float*>(alloc_on(0, T * k * 4));
    auto* dw1 = bf16(alloc_on(0, E * 2 * I * H * 2));
    auto* dw2 = bf16(alloc_on(0, E * H * I * 2));
    auto* acc1 = static_cast<float*>(alloc_on(0, E * 2 * I * H * 4));  // zeroed
    auto* acc2 = static_cast<float*>(alloc_on(0, E * H * I * 4));
    auto* saved_h = saved_mode ? bf16(alloc_on(0, g.max_recv_rows * 2 * I * 2)) : nullptr;
    const size_t fwd_bytes = megamoe::ep::forward_workspace_bytes(g, T, I, ex.precision);
    const size_t bwd_bytes = megamoe::ep::backward_workspace_bytes(g, T, I, false, ex.precision);
    void* fwd_ws = alloc_on(0, fwd_bytes);
    void* bwd_ws = alloc_on(0, bwd_bytes);
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    cudaStream_t s = streams_[0];  // on GPU 0 in either mode; nothing else is in flight
    using megamoe::chain::WeightGrad;
    megamoe::ep::forward(g, x, d_ids, false, weights, ex, T, y, saved_h, fwd_ws, fwd_bytes, s);
    megamoe::ep::backward(g, dy, x, d_ids, false, weights, ex, T, nullptr, dx, dp,
                          WeightGrad::of(dw1, false), WeightGrad::of(dw2, false), bwd_ws,
                          bwd_bytes, s);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    out.y = download<uint16_t>(y, T * H);
    out.dx = download<uint16_t>(dx, T * H);
    out.dp = download<float>(dp, T * k);
    out.dw1 = download<uint16_t>(dw1, E * 2 * I * H);
    out.dw2 = download<uint16_t>(dw2, E * H * I);
    if (saved_mode) {
      megamoe::ep::backward(g, dy, x, d_ids, false, weights, ex, T, saved_h, dx, dp,
                            WeightGrad::of(acc1, true), WeightGrad::of(acc2, true), bwd_ws,
                            bwd_bytes, s);
      EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      out.acc1 = download<float>(acc1, E * 2 * I * H);
      out.acc2 = download<float>(acc2, E * H * I);
    }
    int32_t code = -1;
    EXPECT_EQ(cudaMemcpy(&code, g.peers.buffers[0] + megamoe::ep::buffer_layout(g).error, 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(code, 0) << "EP=1: " << megamoe::comm::describe_error(code);
    return out;
  }

  // What EP=W's y and dx must be for the global `ids`, bit for bit: sums of the EP=1
  // layer's per-owner results (experts: as in single_rank).
  void owner_sums(const std::vector<int32_t>& ids, std::vector<uint16_t>& y,
                  std::vector<uint16_t>& dx, const megamoe::chain::Experts* experts = nullptr) {
    std::vector<std::vector<uint16_t>> ys, dxs;
    for (int o = 0; o < world_; ++o) {
      SingleRank part = single_rank(owner_ids(ids, o), false, false, false, experts);
      ys.push_back(std::move(part.y));
      dxs.push_back(std::move(part.dx));
    }
    y = sum_partials(ys);
    dx = sum_partials(dxs);
  }

  // The one-GPU layers' backward tensors on device 0 (dy uploaded, the gradients allocated)
  // and the download of their results (one_gpu, and the FP8 tests' one_gpu_fp8).
  struct OneGpuGrads {
    megamoe_tensor dy, dx, dp, d1, d2;
  };
  OneGpuGrads one_gpu_grads() {
    const int64_t T = T_all(), H = this->H(), I = this->I(), E = p_.d.E, k = this->k();
    return {dense_tensor(upload_on(0, dy_), MEGAMOE_DTYPE_BFLOAT16, {T, H}),
            dense_tensor(alloc_on(0, T * H * 2), MEGAMOE_DTYPE_BFLOAT16, {T, H}),
            dense_tensor(alloc_on(0, T * k * 4), MEGAMOE_DTYPE_FLOAT32, {T, k}),
            dense_tensor(alloc_on(0, E * 2 * I * H * 2), MEGAMOE_DTYPE_BFLOAT16, {E, 2 * I, H}),
            dense_tensor(alloc_on(0, E * H * I * 2), MEGAMOE_DTYPE_BFLOAT16, {E, H, I})};
  }
  SingleRank download_one_gpu(const megamoe_tensor& y, const OneGpuGrads& g) {
    const int64_t T = T_all(), H = this->H(), I = this->I(), E = p_.d.E, k = this->k();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    SingleRank out;
    out.y = download<uint16_t>(y.data, T * H);
    out.dx = download<uint16_t>(g.dx.data, T * H);
    out.dp = download<float>(g.dp.data, T * k);
    out.dw1 = download<uint16_t>(g.d1.data, E * 2 * I * H);
    out.dw2 = download<uint16_t>(g.d2.data, E * H * I);
    return out;
  }

  // The one-GPU fused layer (forward, backward in recompute mode) on the whole problem, with
  // the problem's ids or `ids`.
  SingleRank one_gpu(const std::vector<int32_t>* ids = nullptr) {
    const int64_t T = T_all(), H = this->H(), I = this->I(), E = p_.d.E, k = this->k();
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    megamoe_tensor gx = dense_tensor(upload_on(0, x_), MEGAMOE_DTYPE_BFLOAT16, {T, H});
    megamoe_tensor gids =
        dense_tensor(upload_on(0, ids != nullptr ? *ids : ids_), MEGAMOE_DTYPE_INT32, {T, k});
    megamoe_tensor gp = dense_tensor(upload_on(0, weights_), MEGAMOE_DTYPE_FLOAT32, {T, k});
    megamoe_tensor gw1 = dense_tensor(upload_on(0, w1_), MEGAMOE_DTYPE_BFLOAT16, {E, 2 * I, H});
    megamoe_tensor gw2 = dense_tensor(upload_on(0, w2_), MEGAMOE_DTYPE_BFLOAT16, {E, H, I});
    megamoe_tensor gy = dense_tensor(alloc_on(0, T * H * 2), MEGAMOE_DTYPE_BFLOAT16, {T, H});
    size_t bytes = 0;
    EXPECT_EQ(megamoe_fused_workspace_size(T, k, H, I, E, &bytes), MEGAMOE_SUCCESS);
    EXPECT_EQ(megamoe_fused_forward(&gx, &gids, &gp, &gw1, &gw2, &gy, nullptr, alloc_on(0, bytes),
                                    bytes, nullptr),
              MEGAMOE_SUCCESS)
        << megamoe_last_error();
    OneGpuGrads g = one_gpu_grads();
    EXPECT_EQ(megamoe_fused_backward_workspace_size(T, k, H, I, E, 0, &bytes), MEGAMOE_SUCCESS);
    EXPECT_EQ(megamoe_fused_backward(&g.dy, &gx, &gids, &gp, &gw1, &gw2, nullptr, &g.dx, &g.dp,
                                     &g.d1, &g.d2, alloc_on(0, bytes), bytes, nullptr),
              MEGAMOE_SUCCESS)
        << megamoe_last_error();
    return download_one_gpu(gy, g);
  }

  // The whole comparison of a case (the header comment lists it). tokens: per rank.
  void check(int64_t tokens, int64_t H, int64_t I, int64_t E, int64_t k, Routing routing,
             double p_none, int64_t max_recv_rows, uint64_t seed, bool expect_capacity = false,
             int32_t comm_sms = 0) {
    SEEDED(seed);
    prepare(tokens, H, I, E, k, routing, p_none, max_recv_rows, seed, comm_sms);
    if (HasFatalFailure()) return;
    const int W = world_;
    const int64_t T_all = this->T_all();

    const SingleRank fused = one_gpu();
    SingleRank ep1;
    std::vector<uint16_t> expected_y, expected_dx;
    if (!expect_capacity) {
      ep1 = single_rank(ids_, true);
      owner_sums(ids_, expected_y, expected_dx);
      if (epilogue_combine_) {
        expected_y = fused.y;
        expected_dx = fused.dx;
      }
    }

    std::vector<uint16_t> first_y;
    for (int call = 0; call < 3; ++call) {  // the same buffers again: generations, no reset
      for (int r = 0; r < W; ++r) {  // every rank's launches first: they wait on each other
        {
          const OnRank on = on_rank(r);
          if (ranks_[r].y) {
            CUDA_OK(cudaMemsetAsync(ranks_[r].y, 0xFF, rank_tokens_[r] * H * 2, streams_[r]));
          }
        }
        launch_forward(r, false);
      }
      sync_ranks();
      const std::vector<uint16_t> got = gather_tokens<uint16_t>(&Rank::y, H);
      for (int r = 0; r < W; ++r) {
        const int32_t code = error_of(r);
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
      EXPECT_EQ(got, expected_y) << "EP=" << W << " y differs from the "
                                 << (epilogue_combine_ ? "one-GPU layer's" : "EP=1 owners' sum");
      const std::vector<double> y = decode(got);
      const double vs_one_gpu = rel_error(y, decode(fused.y));
      Tensor y_ref(MEGAMOE_DTYPE_FLOAT64, {T_all, H});
      ASSERT_EQ(forward(p_, y_ref), MEGAMOE_SUCCESS) << megamoe_last_error();
      const double err = rel_error(y, y_ref.values());
      std::printf("EP=%d%s T/rank%s%ld H=%ld I=%ld E=%ld k=%ld: rel err %.3e (vs one GPU %.3e)\n",
                  W, emulated_ ? " (emulated)" : "", uneven_tokens_.empty() ? "=" : "<=",
                  long(tokens), long(H), long(I), long(E), long(k), err, vs_one_gpu);
      EXPECT_LT(err, 1e-2);
      EXPECT_LT(vs_one_gpu, kEpVsOneGpu);
    }
    if (expect_capacity) return;

    // The backward, twice on the same buffers (after the forwards above), then once in saved
    // mode (after a forward that keeps h) adding the weight gradients into fp32 buffers.
    const int64_t e = e_local_;
    std::vector<uint16_t> first_dx;
    for (int call = 0; call < 3; ++call) {
      const bool saved = call == 2;
      if (saved) {
        for (int r = 0; r < W; ++r) launch_forward(r, true);
        sync_ranks();
        EXPECT_EQ(gather_tokens<uint16_t>(&Rank::y, H), first_y)
            << "the forward that keeps h changed y";
      }
      for (int r = 0; r < W; ++r) launch_backward(r, saved);
      sync_ranks();
      expect_no_errors("backward call " + std::to_string(call));
      const auto dx_all = gather_tokens<uint16_t>(&Rank::dx, H);
      const auto dp_all = gather_tokens<float>(&Rank::dp, k);
      const auto dw1_all = gather<uint16_t>(&Rank::dw1, e * 2 * I * H);
      const auto dw2_all = gather<uint16_t>(&Rank::dw2, e * H * I);
      const auto acc1_all = gather<float>(&Rank::acc1, e * 2 * I * H);
      const auto acc2_all = gather<float>(&Rank::acc2, e * H * I);
      if (call == 0) {
        first_dx = dx_all;
        EXPECT_EQ(dx_all, expected_dx)
            << "EP=" << W << " dx differs from the "
            << (epilogue_combine_ ? "one-GPU layer's" : "EP=1 owners' sum");
        const double vs_one_gpu = rel_error(decode(dx_all), decode(fused.dx));
        std::printf("  backward dx vs one GPU: %.3e\n", vs_one_gpu);
        EXPECT_LT(vs_one_gpu, kEpVsOneGpu);
      } else {
        EXPECT_EQ(dx_all, first_dx) << "EP backward dx differs from its first call, call " << call;
      }
      EXPECT_EQ(std::memcmp(dp_all.data(), fused.dp.data(), dp_all.size() * 4), 0)
          << "EP backward d topk_weights differs from one GPU, call " << call;
      EXPECT_EQ(std::memcmp(dp_all.data(), ep1.dp.data(), dp_all.size() * 4), 0)
          << "EP backward d topk_weights differs from EP=1, call " << call;
      if (!saved) {
        EXPECT_EQ(dw1_all, fused.dw1) << "EP backward d w_gate_up differs from one GPU, call " << call;
        EXPECT_EQ(dw2_all, fused.dw2) << "EP backward d w_down differs from one GPU, call " << call;
        EXPECT_EQ(dw1_all, ep1.dw1) << "EP backward d w_gate_up differs from EP=1, call " << call;
        EXPECT_EQ(dw2_all, ep1.dw2) << "EP backward d w_down differs from EP=1, call " << call;
        continue;
      }
      EXPECT_EQ(std::memcmp(acc1_all.data(), ep1.acc1.data(), acc1_all.size() * 4), 0)
          << "saved mode, fp32 d w_gate_up differs from EP=1";
      EXPECT_EQ(std::memcmp(acc2_all.data(), ep1.acc2.data(), acc2_all.size() * 4), 0)
          << "saved mode, fp32 d w_down differs from EP=1";
      // fp32 sums against their bf16 rounding: every element within 2^-9 relative.
      const std::vector<double> a1(acc1_all.begin(), acc1_all.end()),
          a2(acc2_all.begin(), acc2_all.end());
      EXPECT_LT(rel_error(decode(fused.dw1), a1), 2e-3) << "saved mode, fp32 d w_gate_up";
      EXPECT_LT(rel_error(decode(fused.dw2), a2), 2e-3) << "saved mode, fp32 d w_down";
    }
  }

  // The EP=W groups' forward path (read by prepare()).
  void use_path(int path) {
    epilogue_combine_ = (path & kEpilogueCombine) != 0;
    overlap_dispatch_ = (path & kOverlapDispatch) != 0;
    overlap_backward_ = overlap_dispatch_;
  }
  bool epilogue_combine_ = false;
  bool overlap_dispatch_ = false;
  bool fp8_bf16_dispatch_ = false;  // the EP=W groups' Group::fp8_bf16_dispatch
  bool overlap_backward_ = false;   // the EP=W groups' Group::overlap_backward
  Problem p_;
  // Each rank's tokens for the next prepare() (empty: its `tokens` on every rank).
  std::vector<int64_t> uneven_tokens_;
  // Set by prepare(): each rank's tokens, and the global index of its first.
  std::vector<int64_t> rank_tokens_, rank_first_;
  int64_t e_local_ = 0;
  std::vector<uint16_t> x_, w1_, w2_, dy_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_;
  megamoe::ep::Group group_{};
  std::vector<megamoe::comm::PeerTable> tables_;
  std::vector<Rank> ranks_;
  std::vector<megamoe::ep::Group> side_stream_groups_;  // given a side stream by prepare()
};

}  // namespace megamoe_test
