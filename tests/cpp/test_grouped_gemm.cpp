// The M-grouped GEMMs with a bf16 C (m_grouped_gemm_nt, m_grouped_gemm_nn) against CPU
// products in double, over every A producer, both B majors, both tile widths, sorted and
// padded C, with empty experts and ragged tails; the N-major descriptor-stride reading; and
// the first host API (grouped_gemm.h) against the one it forwards to. Skipped without a GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "gemm_test_util.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/grouped_gemm.h"

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

class GroupedGemmGpu : public megamoe_test::MGroupedGemmTest {};

class MGroupedStoreGpu : public megamoe_test::MGroupedGemmTest,
                         public ::testing::WithParamInterface<StoreCase> {};

TEST_P(MGroupedStoreGpu, MatchesCpu) {
  const StoreCase& p = GetParam();
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

INSTANTIATE_TEST_SUITE_P(Variants, MGroupedStoreGpu, ::testing::ValuesIn(store_cases()),
                         store_case_name);

// Records what the two descriptor-stride readings of an N-major B give, so a wrong default
// shows which reading the hardware uses.
TEST_F(GroupedGemmGpu, NMajorDescriptorStrideReadings) {
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

// Every function of grouped_gemm.h gives bit for bit what the gemm.h function it forwards to
// gives (the callers move from one to the other).
TEST_F(GroupedGemmGpu, FirstApiForwardsBitForBit) {
  namespace sm90 = megamoe::sm90;
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g({0, 150, 1, 90});
  const int64_t T = 120, H = 128, I = 128, E = g.num_experts();
  const megamoe_test::GroupedA x = make_a(g, ALayout::kGathered, H, T, rng);
  const auto* w_gate_up = reinterpret_cast<const __nv_bfloat16*>(
      upload(megamoe_test::random_bf16(E * 2 * I * H, rng, 0.1)));
  const auto* w_down = reinterpret_cast<const __nv_bfloat16*>(
      upload(megamoe_test::random_bf16(E * H * I, rng, 0.1)));
  const sm90::ExpertGroups groups = upload_groups(g);
  const auto compare = [&](const __nv_bfloat16* old_out, const __nv_bfloat16* new_out,
                           int64_t count, const char* what) {
    EXPECT_EQ(download_bf16(old_out, count), download_bf16(new_out, count)) << what;
  };

  sm90::GroupedGemmArgs old_args{};
  old_args.a = x.device.data;
  old_args.a_row_index = x.device.gather;
  old_args.a_source_rows = T;
  old_args.a_rows = g.rows;
  old_args.k = H;
  old_args.num_experts = E;
  old_args.expert_offsets = groups.expert_offsets;
  old_args.tile_offsets = groups.tile_offsets;
  sm90::MGroupedGemmArgs new_args;
  new_args.groups = groups;
  new_args.a = x.device;
  new_args.k = H;

  // L1 with the saved h: grouped_gemm_swiglu / m_grouped_gemm_nt_swiglu.
  sm90::GroupedGemmArgs l1 = old_args;
  l1.b = w_gate_up;
  l1.b_rows_per_expert = 2 * I;
  l1.c = poisoned_bf16(g.rows * I);
  l1.ldc = I;
  l1.h_out = poisoned_bf16(g.rows * 2 * I);
  sm90::grouped_gemm_swiglu(l1, I, stream_);
  sm90::MGroupedGemmArgs n1 = new_args;
  n1.b = w_gate_up;
  n1.n = I;
  n1.c = {poisoned_bf16(g.rows * I), I, g.rows, RowLayout::kSorted};
  __nv_bfloat16* h = poisoned_bf16(g.rows * 2 * I);
  sm90::m_grouped_gemm_nt_swiglu(n1, h, stream_);
  compare(l1.c, n1.c.data, g.rows * I, "swiglu");
  compare(l1.h_out, h, g.rows * 2 * I, "saved h");

  // The L1 recompute: grouped_gemm / m_grouped_gemm_nt.
  sm90::GroupedGemmArgs r1 = l1;
  r1.h_out = nullptr;
  r1.c = poisoned_bf16(g.rows * 2 * I);
  r1.ldc = 2 * I;
  sm90::grouped_gemm(r1, stream_);
  sm90::MGroupedGemmArgs m1 = n1;
  m1.n = 2 * I;
  m1.c = {poisoned_bf16(g.rows * 2 * I), 2 * I, g.rows, RowLayout::kSorted};
  sm90::m_grouped_gemm_nt(m1, stream_);
  compare(r1.c, m1.c.data, g.rows * 2 * I, "nt");

  // The dgrad of L2: grouped_gemm_swiglu_backward / m_grouped_gemm_nn_swiglu_backward, padded.
  std::vector<float> weights(T * 2);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  for (auto& w : weights) w = uniform(rng);
  std::vector<int32_t> slots(g.rows);
  for (int64_t r = 0; r < g.rows; ++r) slots[r] = static_cast<int32_t>((r * 7) % (T * 2));
  const float* d_weights = upload(weights);
  const int32_t* d_slots = upload(slots);
  const int64_t dp_cols = sm90::swiglu_backward_n_tiles(I);
  EXPECT_EQ(dp_cols, sm90::swiglu_backward_dp_columns(I));
  sm90::GroupedGemmArgs l2 = old_args;
  l2.b = w_down;
  l2.n = I;
  l2.c_padded = true;
  l2.c_rows = g.padded_rows;
  sm90::SwiGLUBackwardArgs bw{h, poisoned_bf16(g.padded_rows * 2 * I), d_weights, d_slots,
                              alloc<float>(g.rows * dp_cols), poisoned_bf16(g.padded_rows * I)};
  sm90::grouped_gemm_swiglu_backward(l2, bw, stream_);
  sm90::MGroupedGemmArgs n2 = new_args;
  n2.b = w_down;
  n2.n = I;
  n2.c = {poisoned_bf16(g.padded_rows * 2 * I), 2 * I, g.padded_rows, RowLayout::kPadded};
  sm90::SwiGLUGradArgs grads{h, d_weights, d_slots, alloc<float>(g.rows * dp_cols),
                             poisoned_bf16(g.padded_rows * I)};
  sm90::m_grouped_gemm_nn_swiglu_backward(n2, grads, stream_);
  compare(bw.dh, n2.c.data, g.padded_rows * 2 * I, "dh");
  compare(bw.a_out, grads.a_out, g.padded_rows * I, "a");
  EXPECT_EQ(download(bw.dp_partial, g.rows * dp_cols), download(grads.dp_partial, g.rows * dp_cols));

  // The dgrad of L1: grouped_gemm_b_n_major / m_grouped_gemm_nn, A padded.
  sm90::GroupedGemmArgs d1 = old_args;
  d1.a = bw.dh;
  d1.a_row_index = nullptr;
  d1.a_padded = true;
  d1.a_rows = g.padded_rows;
  d1.b = w_gate_up;
  d1.k = 2 * I;
  d1.n = H;
  d1.c = poisoned_bf16(g.rows * H);
  d1.ldc = H;
  d1.c_rows = g.rows;
  sm90::grouped_gemm_b_n_major(d1, stream_);
  sm90::MGroupedGemmArgs m3 = new_args;
  m3.groups.rows = g.padded_rows;  // as the forward passes a_rows
  m3.a = {bw.dh, g.padded_rows, RowLayout::kPadded, nullptr};
  m3.b = w_gate_up;
  m3.k = 2 * I;
  m3.n = H;
  m3.c = {poisoned_bf16(g.rows * H), H, g.rows, RowLayout::kSorted};
  sm90::m_grouped_gemm_nn(m3, stream_);
  compare(d1.c, m3.c.data, g.rows * H, "nn");

  // A weight gradient: grouped_gemm_wgrad / k_grouped_gemm_tn.
  sm90::WgradArgs w{bw.dh, bw.a_out, g.padded_rows, 2 * I, I, E, groups.tile_offsets,
                    poisoned_bf16(E * 2 * I * I)};
  sm90::grouped_gemm_wgrad(w, stream_);
  sm90::KGroupedGemmArgs k = w;
  k.c = poisoned_bf16(E * 2 * I * I);
  sm90::k_grouped_gemm_tn(k, stream_);
  compare(w.c, k.c, E * 2 * I * I, "tn");
  CUDA_OK(cudaGetLastError());
}

}  // namespace
