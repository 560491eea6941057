// sm90 grouped GEMM with an N-major B (the backward's dgrad layout: w_down [E, H, I] read
// as K = H, N = I) against a float64 CPU product, and the SwiGLU backward's copy of its
// gathered rows against gather_rows_padded. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/routing_plan.h"
#include "kernels/sm90/grouped_gemm.h"

namespace {

using megamoe_test::GpuTest;

uint16_t to_bf16_bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16(v);
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  return bits;
}
double from_bf16_bits(uint16_t bits) {
  uint32_t w = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

class GroupedGemmGpu : public GpuTest {
 protected:
  // Runs C = A_e . B_e for experts with the given row counts; returns ||C - ref|| / ||ref||
  // over the valid rows (NaN-poisoned C: an unwritten element gives NaN).
  double run_n_major(const std::vector<int32_t>& counts, int64_t K, int64_t N, uint64_t seed,
                     megamoe::sm90::MnMajorStrides strides) {
    const int64_t E = static_cast<int64_t>(counts.size());
    std::vector<int32_t> offsets(E + 1, 0), tiles(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      offsets[e + 1] = offsets[e] + counts[e];
      tiles[e + 1] = tiles[e] + (counts[e] + 127) / 128;
    }
    const int64_t rows = offsets[E];
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<uint16_t> a(rows * K), b(E * K * N);
    for (auto& v : a) v = to_bf16_bits(normal(rng));
    for (auto& v : b) v = to_bf16_bits(normal(rng) / std::sqrt(float(K)));

    auto* d_a = upload(a);
    auto* d_b = upload(b);
    auto* d_c = alloc<uint16_t>(rows * N);
    EXPECT_EQ(cudaMemset(d_c, 0xFF, rows * N * 2), cudaSuccess);
    megamoe::sm90::GroupedGemmArgs args{};
    args.a = reinterpret_cast<const __nv_bfloat16*>(d_a);
    args.a_rows = rows;
    args.b = reinterpret_cast<const __nv_bfloat16*>(d_b);
    args.k = K;
    args.n = N;
    args.num_experts = E;
    args.expert_offsets = upload(offsets);
    args.tile_offsets = upload(tiles);
    args.c = reinterpret_cast<__nv_bfloat16*>(d_c);
    args.ldc = N;
    megamoe::sm90::grouped_gemm_b_n_major(args, stream_, strides);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<uint16_t> c = download(d_c, rows * N);

    double num = 0, den = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        for (int64_t n = 0; n < N; ++n) {
          double ref = 0;
          for (int64_t k = 0; k < K; ++k) {
            ref += from_bf16_bits(a[r * K + k]) * from_bf16_bits(b[(e * K + k) * N + n]);
          }
          const double got = from_bf16_bits(c[r * N + n]);
          num += (got - ref) * (got - ref);
          den += ref * ref;
        }
      }
    }
    return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
  }
};

TEST_F(GroupedGemmGpu, NMajorBMatchesCpu) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const megamoe::sm90::MnMajorStrides layout{};
  // Ragged experts (one empty, one below a tile), N = 256 (wide tiles) and N = 128.
  for (int64_t N : {256, 128}) {
    const double err = run_n_major({200, 0, 77, 131}, 256, N, seed + N, layout);
    std::printf("N-major B, N=%ld: rel err %.3e\n", static_cast<long>(N), err);
    EXPECT_LT(err, 1e-2) << "N=" << N;
  }
}

// Records what the two descriptor-stride readings give, so a wrong default shows which
// reading the hardware uses.
TEST_F(GroupedGemmGpu, NMajorDescriptorStrideReadings) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const megamoe::sm90::MnMajorStrides swapped{8 * 128, 64 * 128};
  const double err_default = run_n_major({130, 70}, 128, 256, seed, {});
  const double err_swapped = run_n_major({130, 70}, 128, 256, seed, swapped);
  std::printf("N-major B descriptor: default (lbo 8192, sbo 1024) %.3e, swapped %.3e\n",
              err_default, err_swapped);
  EXPECT_LT(err_default, 1e-2);
}

// The dgrad of L2 with a_copy and a_out_weighted (the fused backward's dW_down operands):
// the copy equals gather_rows_padded's rows bitwise, zeros in pad rows included; dh and
// the dp partials equal those of the plain call bitwise; a_out is p a. Both tile widths
// (I % 256 == 0: the TMA epilogue; otherwise 128-wide tiles), skewed routing with ids of -1
// and an expert without rows; NaN-poisoned outputs.
TEST_F(GroupedGemmGpu, SwiGLUBackwardCopiesGatheredRows) {
  namespace sm90 = megamoe::sm90;
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const int64_t I : {256, 384}) {
    SCOPED_TRACE("I=" + std::to_string(I));
    const int64_t T = 300, k = 4, E = 6, H = 192, slots = T * k;
    std::vector<int32_t> ids(slots);
    for (int64_t s = 0; s < slots; ++s) {
      // Expert 0 takes most rows (several M-tiles), expert 4 none, every 7th slot is -1.
      const int32_t e = static_cast<int32_t>(rng() % 8);
      ids[s] = s % 7 == 3 ? -1 : e >= 5 ? 0 : e == 4 ? 5 : e;
    }
    std::vector<float> weights(slots);
    for (auto& w : weights) w = 0.25f + 0.5f * float(rng() % 1000) / 1000.f;
    std::vector<uint16_t> dy(T * H), h(slots * 2 * I), w_down(E * H * I);
    for (auto& v : dy) v = to_bf16_bits(normal(rng));
    for (auto& v : h) v = to_bf16_bits(normal(rng));
    for (auto& v : w_down) v = to_bf16_bits(normal(rng) / std::sqrt(float(H)));

    megamoe::RoutingPlan plan{};
    plan.expert_counts = alloc<int32_t>(E);
    plan.expert_offsets = alloc<int32_t>(E + 1);
    plan.tile_offsets = alloc<int32_t>(E + 1);
    plan.row_token = alloc<int32_t>(slots);
    plan.row_slot = alloc<int32_t>(slots);
    plan.slot_row = alloc<int32_t>(slots);
    plan.invalid_count = alloc<int32_t>(1);
    void* scratch = device_alloc(megamoe::routing_plan_scratch_bytes(slots, E));
    megamoe::build_routing_plan(upload(ids), false, T, k, E, sm90::kGroupedGemmBlockM, plan,
                                scratch, stream_);
    const int64_t padded = megamoe::padded_rows_bound(slots, E);
    const int64_t n_tiles = sm90::swiglu_backward_n_tiles(I);

    const auto* d_dy = reinterpret_cast<const __nv_bfloat16*>(upload(dy));
    const auto* d_h = reinterpret_cast<const __nv_bfloat16*>(upload(h));
    const auto* d_weights = upload(weights);
    sm90::GroupedGemmArgs args{};
    args.a = d_dy;
    args.a_row_index = plan.row_token;
    args.a_source_rows = T;
    args.a_rows = slots;
    args.b = reinterpret_cast<const __nv_bfloat16*>(upload(w_down));
    args.k = H;
    args.n = I;
    args.num_experts = E;
    args.expert_offsets = plan.expert_offsets;
    args.tile_offsets = plan.tile_offsets;
    args.c_padded = true;
    args.c_rows = padded;
    const auto poisoned = [&](int64_t count) {
      auto* q = alloc<uint16_t>(count);
      EXPECT_EQ(cudaMemset(q, 0xFF, count * 2), cudaSuccess);
      return q;
    };
    struct Out {
      uint16_t *dh, *a, *copy;
      float* dp;
    };
    const auto run = [&](bool copy) {
      Out o{poisoned(padded * 2 * I), poisoned(padded * I), poisoned(padded * H),
            alloc<float>(slots * n_tiles)};
      EXPECT_EQ(cudaMemset(o.dp, 0xFF, slots * n_tiles * 4), cudaSuccess);
      sm90::SwiGLUBackwardArgs bw{d_h, reinterpret_cast<__nv_bfloat16*>(o.dh), d_weights,
                                  plan.row_slot, o.dp, reinterpret_cast<__nv_bfloat16*>(o.a)};
      if (copy) {
        bw.a_copy = reinterpret_cast<__nv_bfloat16*>(o.copy);
        bw.a_out_weighted = true;
      }
      sm90::grouped_gemm_swiglu_backward(args, bw, stream_);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
      return o;
    };
    const Out plain = run(false), copied = run(true);
    auto* gathered = poisoned(padded * H);
    megamoe::gather_rows_padded(d_dy, H, plan, E, nullptr, padded,
                                reinterpret_cast<__nv_bfloat16*>(gathered), stream_);

    const std::vector<int32_t> tiles = download(plan.tile_offsets, E + 1);
    const std::vector<int32_t> offsets = download(plan.expert_offsets, E + 1);
    const int64_t used = int64_t(tiles[E]) * 128;  // padded rows the kernels write
    ASSERT_GE(tiles[1] - tiles[0], 2);  // expert 0 spans several M-tiles
    EXPECT_EQ(download(copied.copy, used * H), download(gathered, used * H));
    EXPECT_EQ(download(copied.dh, used * 2 * I), download(plain.dh, used * 2 * I));
    EXPECT_EQ(download(copied.dp, offsets[E] * n_tiles), download(plain.dp, offsets[E] * n_tiles));
    const std::vector<uint16_t> a = download(plain.a, used * I);
    const std::vector<uint16_t> pa = download(copied.a, used * I);
    const std::vector<int32_t> row_slot = download(plan.row_slot, slots);
    int64_t checked = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t row = int64_t(tiles[e]) * 128; row < int64_t(tiles[e + 1]) * 128; ++row) {
        const int64_t i = row - int64_t(tiles[e]) * 128;
        const bool pad = i >= offsets[e + 1] - offsets[e];
        const double p = pad ? 0.0 : weights[row_slot[offsets[e] + i]];
        for (int64_t c = 0; c < I; ++c) {
          const double want = p * from_bf16_bits(a[row * I + c]);
          const double got = from_bf16_bits(pa[row * I + c]);
          // p a is rounded once from fp32; p times the rounded a differs by <= 2 bf16 ulps.
          ASSERT_LE(std::fabs(got - want), std::fabs(want) * (1.0 / 64) + 1e-30)
              << "row " << row << " col " << c;
          ++checked;
        }
      }
    }
    EXPECT_EQ(checked, used * I);
  }
}

}  // namespace

