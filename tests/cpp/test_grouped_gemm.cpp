// sm90 grouped GEMM with an N-major B (the backward's dgrad layout: w_down [E, H, I] read
// as K = H, N = I) against a float64 CPU product. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_test_util.h"
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

}  // namespace
