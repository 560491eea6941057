// k_grouped_gemm_tn (the weight gradients) against CPU products in double: bf16 written and
// fp32 accumulated, both tile widths, over experts with no rows, one row and ragged tails.
// Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <vector>

#include "gemm_test_util.h"
#include "kernels/sm90/gemm.h"

namespace {

using megamoe_test::HostGroups;

struct WgradCase {
  int64_t m, n;  // n = 256: 256-wide tiles; 128 and 384: 128-wide ones
  bool accumulate;
};

std::string wgrad_case_name(const ::testing::TestParamInfo<WgradCase>& info) {
  const WgradCase& p = info.param;
  std::string name = "M";  // appended piece by piece (GCC 12 warns on "literal" + string)
  name += std::to_string(p.m) + "_N" + std::to_string(p.n) + (p.accumulate ? "_f32add" : "_bf16");
  return name;
}

// gtest prints the parameter beside the test's name (and ctest lists it): the case's name.
void PrintTo(const WgradCase& p, std::ostream* os) {
  *os << wgrad_case_name(::testing::TestParamInfo<WgradCase>(p, 0));
}

class KGroupedGemmGpu : public megamoe_test::GpuTest,
                        public ::testing::WithParamInterface<WgradCase> {};

TEST_P(KGroupedGemmGpu, MatchesCpu) {
  const WgradCase& p = GetParam();
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  const int64_t M = p.m, N = p.n, E = g.num_experts(), P = g.padded_rows;
  // a [P, M] and b [P, N] in the padded layout, pad rows zero (the contract).
  std::vector<uint16_t> a(P * M, 0), b(P * N, 0);
  const std::vector<bool> used = g.padded_rows_used();
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t r = 0; r < P; ++r) {
    if (!used[r]) continue;
    for (int64_t i = 0; i < M; ++i) a[r * M + i] = megamoe_test::bf16_bits(normal(rng));
    for (int64_t j = 0; j < N; ++j) b[r * N + j] = megamoe_test::bf16_bits(normal(rng) / 16);
  }
  std::vector<float> c0(E * M * N);
  for (auto& v : c0) v = static_cast<float>(normal(rng));

  megamoe::sm90::KGroupedGemmArgs args;
  args.a = reinterpret_cast<const __nv_bfloat16*>(upload(a));
  args.b = reinterpret_cast<const __nv_bfloat16*>(upload(b));
  args.padded_rows = P;
  args.m = M;
  args.n = N;
  args.num_experts = E;
  args.tile_offsets = upload(g.tiles);
  if (p.accumulate) {
    args.c_accumulate = upload(c0);
  } else {
    auto* c = alloc<uint16_t>(E * M * N);
    CUDA_OK(cudaMemset(c, 0xFF, E * M * N * 2));  // NaN: every element must be written
    args.c = reinterpret_cast<__nv_bfloat16*>(c);
  }
  megamoe::sm90::k_grouped_gemm_tn(args, stream_);
  CUDA_OK(cudaGetLastError());

  // C_e = a_e^T b_e over expert e's padded rows (zero for an expert without rows).
  std::vector<double> ref(E * M * N, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = int64_t(g.tiles[e]) * 128; r < int64_t(g.tiles[e + 1]) * 128; ++r) {
      for (int64_t i = 0; i < M; ++i) {
        const double x = megamoe_test::bf16_value(a[r * M + i]);
        if (x == 0.0) continue;
        for (int64_t j = 0; j < N; ++j) ref[(e * M + i) * N + j] += x * megamoe_test::bf16_value(b[r * N + j]);
      }
    }
  }
  std::vector<double> got(E * M * N);
  if (p.accumulate) {
    const std::vector<float> c = download(args.c_accumulate, E * M * N);
    for (size_t i = 0; i < got.size(); ++i) {
      got[i] = c[i];
      ref[i] += c0[i];
    }
    EXPECT_LT(megamoe_test::relative_error(got, ref), megamoe_test::kFloatBound);
  } else {
    const std::vector<uint16_t> c = download(reinterpret_cast<const uint16_t*>(args.c), E * M * N);
    for (size_t i = 0; i < got.size(); ++i) got[i] = megamoe_test::bf16_value(c[i]);
    EXPECT_LT(megamoe_test::relative_error(got, ref), megamoe_test::kBf16Bound);
    // The experts without rows get exact zeros.
    for (int64_t e = 0; e < E; ++e) {
      if (g.counts[e] != 0) continue;
      int64_t nonzero = 0;
      for (int64_t i = 0; i < M * N; ++i) nonzero += got[e * M * N + i] != 0.0;
      EXPECT_EQ(nonzero, 0) << "expert " << e << " has no rows";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, KGroupedGemmGpu,
                         ::testing::Values(WgradCase{128, 256, false}, WgradCase{128, 256, true},
                                           WgradCase{256, 384, false}, WgradCase{256, 384, true},
                                           WgradCase{128, 128, false}, WgradCase{128, 128, true}),
                         wgrad_case_name);

}  // namespace
