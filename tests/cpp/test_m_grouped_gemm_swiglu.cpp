// The SwiGLU GEMMs against CPU products in double: m_grouped_gemm_nt_swiglu (L1, with and
// without the saved h) and m_grouped_gemm_nn_swiglu_backward (the dgrad of L2 with dh, the dp
// partials and a), over every A producer, both tile widths, sorted and padded outputs, with
// empty experts and ragged tails. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <vector>

#include "gemm_test_util.h"
#include "kernels/sm90/gemm.h"

namespace {

using megamoe::sm90::RowLayout;
using megamoe_test::ALayout;
using megamoe_test::HostGroups;

struct SwiGLUCase {
  int64_t intermediate;  // 128: 256-wide tiles (128 gate + 128 up); 192: 128-wide ones
  ALayout a;
  RowLayout c;
  bool saved_h;
};

std::string swiglu_case_name(const ::testing::TestParamInfo<SwiGLUCase>& info) {
  const SwiGLUCase& p = info.param;
  std::string name = "I";  // appended piece by piece (GCC 12 warns on "literal" + string)
  name += std::to_string(p.intermediate) + "_" + megamoe_test::name_of(p.a) + "_C" +
          megamoe_test::name_of(p.c) + (p.saved_h ? "_savedh" : "");
  return name;
}

// gtest prints the parameter beside the test's name (and ctest lists it): the case's name.
void PrintTo(const SwiGLUCase& p, std::ostream* os) {
  *os << swiglu_case_name(::testing::TestParamInfo<SwiGLUCase>(p, 0));
}

std::vector<SwiGLUCase> swiglu_cases() {
  std::vector<SwiGLUCase> cases;
  for (int64_t i : {128, 192}) {
    for (ALayout a : {ALayout::kSorted, ALayout::kPadded, ALayout::kGathered}) {
      for (RowLayout c : {RowLayout::kSorted, RowLayout::kPadded}) {
        for (bool h : {false, true}) cases.push_back({i, a, c, h});
      }
    }
  }
  return cases;
}

class SwiGLUGpu : public megamoe_test::MGroupedGemmTest,
                  public ::testing::WithParamInterface<SwiGLUCase> {};

TEST_P(SwiGLUGpu, MatchesCpu) {
  const SwiGLUCase& p = GetParam();
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  const int64_t H = 192, I = p.intermediate, E = g.num_experts();
  const megamoe_test::GroupedA x = make_a(g, p.a, H, 300, rng);
  // w_gate_up [E, 2I, H]: expert e's gate rows, then its up rows.
  const std::vector<uint16_t> w = megamoe_test::random_bf16(E * 2 * I * H, rng, 1.0 / std::sqrt(H));

  const megamoe::sm90::MGroupedGemmArgs args = gemm_args(g, x, w, H, I, I, p.c);
  const int64_t c_rows = args.c.rows;
  __nv_bfloat16* h = p.saved_h ? poisoned_bf16(c_rows * 2 * I) : nullptr;
  megamoe::sm90::m_grouped_gemm_nt_swiglu(args, h, stream_);
  CUDA_OK(cudaGetLastError());

  // h = [gate | up] is the product with all 2I rows of the expert's w_gate_up.
  const std::vector<double> ref_h =
      megamoe_test::grouped_product(g, x.rows, megamoe_test::bf16_values(w), H, 2 * I, false);
  const std::vector<double> ref_out = megamoe_test::swiglu_reference(ref_h, g.rows, I);
  const std::vector<uint16_t> out = download_bf16(args.c.data, c_rows * I);
  EXPECT_LT(megamoe_test::relative_error(megamoe_test::sorted_rows_of(out, g, p.c, I), ref_out),
            megamoe_test::kBf16Bound);
  if (p.c == RowLayout::kPadded) {
    EXPECT_EQ(megamoe_test::bad_pad_elements(out, g, I, megamoe_test::is_poison), 0);
  }
  if (p.saved_h) {
    const std::vector<uint16_t> hv = download_bf16(h, c_rows * 2 * I);
    EXPECT_LT(megamoe_test::relative_error(megamoe_test::sorted_rows_of(hv, g, p.c, 2 * I), ref_h),
              megamoe_test::kBf16Bound)
        << "saved h";
    if (p.c == RowLayout::kPadded) {
      EXPECT_EQ(megamoe_test::bad_pad_elements(hv, g, 2 * I, megamoe_test::is_poison), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, SwiGLUGpu, ::testing::ValuesIn(swiglu_cases()),
                         swiglu_case_name);

struct BackwardCase {
  int64_t intermediate;  // 256: 256-wide tiles (padded: the TMA-staged epilogue); 128: 128-wide
  ALayout a;
  RowLayout c;
  bool a_out;
};

std::string backward_case_name(const ::testing::TestParamInfo<BackwardCase>& info) {
  const BackwardCase& p = info.param;
  std::string name = "I";
  name += std::to_string(p.intermediate) + "_" + megamoe_test::name_of(p.a) + "_dh" +
          megamoe_test::name_of(p.c) + (p.a_out ? "_aout" : "");
  return name;
}

void PrintTo(const BackwardCase& p, std::ostream* os) {
  *os << backward_case_name(::testing::TestParamInfo<BackwardCase>(p, 0));
}

std::vector<BackwardCase> backward_cases() {
  std::vector<BackwardCase> cases;
  for (int64_t i : {256, 128}) {
    for (ALayout a : {ALayout::kSorted, ALayout::kPadded, ALayout::kGathered}) {
      for (RowLayout c : {RowLayout::kSorted, RowLayout::kPadded}) {
        for (bool a_out : {false, true}) cases.push_back({i, a, c, a_out});
      }
    }
  }
  return cases;
}

class SwiGLUBackwardGpu : public megamoe_test::MGroupedGemmTest,
                          public ::testing::WithParamInterface<BackwardCase> {};

TEST_P(SwiGLUBackwardGpu, MatchesCpu) {
  const BackwardCase& p = GetParam();
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  const int64_t H = 192, I = p.intermediate, E = g.num_experts();
  const int64_t block_n = I % 256 == 0 ? 256 : 128;
  const megamoe_test::GroupedA dy = make_a(g, p.a, H, 300, rng);
  // w_down [E, H, I], read N-major (K = H, N = I).
  const std::vector<uint16_t> w = megamoe_test::random_bf16(E * H * I, rng, 1.0 / std::sqrt(H));
  const std::vector<uint16_t> h = megamoe_test::random_bf16(g.rows * 2 * I, rng, 1.5);
  const std::vector<double> hv = megamoe_test::bf16_values(h);
  const megamoe_test::SwiGLUSlots slots = megamoe_test::random_swiglu_slots(g.rows, rng);

  const megamoe::sm90::MGroupedGemmArgs args = gemm_args(g, dy, w, H, I, 2 * I, p.c);  // C = dh
  const int64_t c_rows = args.c.rows;
  const int64_t dp_cols = megamoe::sm90::swiglu_backward_dp_columns(I);
  ASSERT_EQ(dp_cols, I / block_n);
  const megamoe::sm90::SwiGLUGradArgs grads =
      swiglu_grads(h, slots, g.rows, dp_cols, p.a_out ? poisoned_bf16(c_rows * I) : nullptr);
  float* dp = grads.dp_partial;
  megamoe::sm90::m_grouped_gemm_nn_swiglu_backward(args, grads, stream_);
  CUDA_OK(cudaGetLastError());

  // z = dy . w_down_e, then the SwiGLU backward of each element.
  const std::vector<double> z =
      megamoe_test::grouped_product(g, dy.rows, megamoe_test::bf16_values(w), H, I, true);
  const megamoe_test::SwiGLUBackwardReference ref =
      megamoe_test::swiglu_backward_reference(z, hv, slots, g.rows, I, block_n);
  const std::vector<double>&ref_dh = ref.dh, &ref_a = ref.a, &ref_dp = ref.dp;
  const std::vector<uint16_t> dh = download_bf16(args.c.data, c_rows * 2 * I);
  EXPECT_LT(megamoe_test::relative_error(megamoe_test::sorted_rows_of(dh, g, p.c, 2 * I), ref_dh),
            megamoe_test::kBf16Bound)
      << "dh";
  const std::vector<float> dp_got = download(dp, g.rows * dp_cols);
  EXPECT_LT(megamoe_test::relative_error(std::vector<double>(dp_got.begin(), dp_got.end()), ref_dp),
            megamoe_test::kFloatBound)
      << "dp partials";
  // Padded: the pad rows of dh and a are the weight gradients' operands, written as zeros.
  if (p.c == RowLayout::kPadded) {
    EXPECT_EQ(megamoe_test::bad_pad_elements(dh, g, 2 * I, megamoe_test::is_zero), 0) << "dh";
  }
  if (p.a_out) {
    const std::vector<uint16_t> a = download_bf16(grads.a_out, c_rows * I);
    EXPECT_LT(megamoe_test::relative_error(megamoe_test::sorted_rows_of(a, g, p.c, I), ref_a),
              megamoe_test::kBf16Bound)
        << "a";
    if (p.c == RowLayout::kPadded) {
      EXPECT_EQ(megamoe_test::bad_pad_elements(a, g, I, megamoe_test::is_zero), 0) << "a";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, SwiGLUBackwardGpu, ::testing::ValuesIn(backward_cases()),
                         backward_case_name);

}  // namespace
