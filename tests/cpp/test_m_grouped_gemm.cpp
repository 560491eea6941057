// The M-grouped GEMMs with a bf16 C (m_grouped_gemm_nt, m_grouped_gemm_nn) against CPU
// products in double, over every A producer, both B majors, both tile widths, sorted and
// padded C, with empty experts and ragged tails; and the N-major descriptor-stride reading.
// Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "gemm_test_util.h"
#include "kernels/common/sm_count.h"
#include "kernels/sm90/gemm.h"

namespace {

using megamoe::sm90::RowLayout;
using megamoe_test::ALayout;
using megamoe_test::HostGroups;

struct StoreCase {
  bool b_n_major;  // m_grouped_gemm_nn; else _nt
  int64_t n;       // 256: 256-wide tiles; 384: three 128-wide ones
  ALayout a;
  RowLayout c;
};

std::string store_case_name(const ::testing::TestParamInfo<StoreCase>& info) {
  const StoreCase& p = info.param;
  return std::string(p.b_n_major ? "nn" : "nt") + "_N" + std::to_string(p.n) + "_" +
         megamoe_test::name_of(p.a) + "_C" + megamoe_test::name_of(p.c);
}

// gtest prints the parameter beside the test's name (and ctest lists it): the case's name.
void PrintTo(const StoreCase& p, std::ostream* os) {
  *os << store_case_name(::testing::TestParamInfo<StoreCase>(p, 0));
}

std::vector<StoreCase> store_cases() {
  std::vector<StoreCase> cases;
  for (bool nn : {false, true}) {
    for (int64_t n : {256, 384}) {
      for (ALayout a : {ALayout::kSorted, ALayout::kPadded, ALayout::kGathered}) {
        for (RowLayout c : {RowLayout::kSorted, RowLayout::kPadded}) cases.push_back({nn, n, a, c});
      }
    }
  }
  return cases;
}

class MGroupedGemmGpu : public megamoe_test::MGroupedGemmTest {};

class MGroupedStoreGpu : public megamoe_test::MGroupedGemmTest,
                         public ::testing::WithParamInterface<StoreCase> {
 protected:
  void check(const StoreCase& p);
};

void MGroupedStoreGpu::check(const StoreCase& p) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  const int64_t K = 320, N = p.n, E = g.num_experts();  // 5 k-blocks
  const megamoe_test::GroupedA a = make_a(g, p.a, K, 300, rng);
  // nt: B_e [N, K] at rows e * N..; nn: B_e [K, N] at rows e * K...
  const std::vector<uint16_t> b = megamoe_test::random_bf16(E * N * K, rng, 1.0 / std::sqrt(K));

  const megamoe::sm90::MGroupedGemmArgs args = gemm_args(g, a, b, K, N, N, p.c);
  if (p.b_n_major) {
    megamoe::sm90::m_grouped_gemm_nn(args, stream_);
  } else {
    megamoe::sm90::m_grouped_gemm_nt(args, stream_);
  }
  CUDA_OK(cudaGetLastError());
  const std::vector<uint16_t> c = download_bf16(args.c.data, args.c.rows * N);
  const std::vector<double> ref =
      megamoe_test::grouped_product(g, a.rows, megamoe_test::bf16_values(b), K, N, p.b_n_major);
  const double err = megamoe_test::relative_error(megamoe_test::sorted_rows_of(c, g, p.c, N), ref);
  EXPECT_LT(err, megamoe_test::kBf16Bound);
  // The store writes only the experts' rows: pad rows keep their poison.
  if (p.c == RowLayout::kPadded) {
    EXPECT_EQ(megamoe_test::bad_pad_elements(c, g, N, megamoe_test::is_poison), 0);
  }
}

TEST_P(MGroupedStoreGpu, MatchesCpu) { check(GetParam()); }

// On few SMs every block loops over many tiles (the persistent schedule's later rounds),
// which a grid as large as the problem never reaches.
TEST_P(MGroupedStoreGpu, MatchesCpuOnFewSms) {
  for (int sms : {1, 3, 16}) {
    SCOPED_TRACE("SmLimit " + std::to_string(sms));
    const megamoe::SmLimit limit(sms);
    check(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MGroupedStoreGpu, ::testing::ValuesIn(store_cases()),
                         store_case_name);

// A limit of Scope::kRoundRobinGrids caps every grid but one whose tiles are handed out
// (MEGAMOE_DYNAMIC_TILES); kEveryGrid caps both, and the smaller limit applies.
TEST_F(MGroupedGemmGpu, SmLimitScopes) {
  using megamoe::SmLimit;
  const int all = megamoe::sm_count();
  ASSERT_GT(all, 3);
  {
    const SmLimit beside_copy(3, SmLimit::Scope::kRoundRobinGrids);
    EXPECT_EQ(megamoe::sm_count(), 3);
    EXPECT_EQ(megamoe::sm_count(/*tiles_handed_out=*/true), all);
    {
      const SmLimit emulated(2);
      EXPECT_EQ(megamoe::sm_count(), 2);
      EXPECT_EQ(megamoe::sm_count(true), 2);
    }
    EXPECT_EQ(megamoe::sm_count(), 3);
  }
  EXPECT_EQ(megamoe::sm_count(), all);
  EXPECT_EQ(megamoe::sm_count(true), all);
}

// Records what the two descriptor-stride readings of an N-major B give, so a wrong default
// shows which reading the hardware uses.
TEST_F(MGroupedGemmGpu, NMajorDescriptorStrideReadings) {
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  const HostGroups g({130, 70});
  const int64_t K = 128, N = 256;
  const auto run = [&](megamoe::sm90::MnMajorStrides strides) {
    std::mt19937_64 rng(seed);
    const megamoe_test::GroupedA a = make_a(g, ALayout::kSorted, K, 0, rng);
    const std::vector<uint16_t> b = megamoe_test::random_bf16(2 * K * N, rng, 1.0 / std::sqrt(K));
    const megamoe::sm90::MGroupedGemmArgs args = gemm_args(g, a, b, K, N, N, RowLayout::kSorted);
    megamoe::sm90::m_grouped_gemm_nn(args, stream_, strides);
    const std::vector<uint16_t> c = download_bf16(args.c.data, g.rows * N);
    const std::vector<double> ref =
        megamoe_test::grouped_product(g, a.rows, megamoe_test::bf16_values(b), K, N, true);
    return megamoe_test::relative_error(megamoe_test::sorted_rows_of(c, g, RowLayout::kSorted, N), ref);
  };
  const double err_default = run({});
  const double err_swapped = run({8 * 128, 64 * 128});
  std::printf("N-major B descriptor: default (lbo 8192, sbo 1024) %.3e, swapped %.3e\n",
              err_default, err_swapped);
  EXPECT_LT(err_default, megamoe_test::kBf16Bound);
}

}  // namespace
