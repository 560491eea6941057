// The blockwise-FP8 grouped GEMMs (gemm_fp8.h) against CPU products in double of the
// dequantized operands (q * scale), which isolates the GEMM's accumulation from the
// quantization: every A layout, sorted and padded C, both scale layouts of B (W and the W^T
// reading of W's scales), the SwiGLU and SwiGLU-backward epilogues, and the weight gradient,
// over empty experts and ragged tails, with NaN-poisoned outputs and scales that differ per
// block; and the SwiGLU output written as FP8 rows against the bf16 one quantized by the rows
// quantizer, bit for bit. Skipped without a GPU.
//
// The bound, 1e-3: an output rounded to bf16 can be no closer to the exact product than its
// own rounding (~1.3e-3 in the Frobenius norm), so a bf16 output is held to 1e-3 of error
// beyond that rounding (error_beyond_rounding); fp32 outputs are compared with the exact
// values directly.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "gemm_test_util.h"
#include "kernels/common/quantize_fp8.h"
#include "kernels/common/sm_count.h"
#include "kernels/sm90/gemm_fp8.h"

namespace {

using megamoe::sm90::RowLayout;
using megamoe_test::ALayout;
using megamoe_test::HostGroups;

constexpr double kFp8GemmBound = 1e-3;

uint8_t e4m3_bits(double v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(static_cast<float>(v), __NV_SATFINITE, __NV_E4M3));
}
double e4m3_value(uint8_t bits) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(bits, __NV_E4M3);
  return static_cast<double>(__half2float(__half(h)));
}

// Random e4m3 values (a normal distribution spread over e4m3's range) and one random fp32
// scale per block: `blocks` scales, block_of(i) naming element i's.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<double> values;  // q * its scale
};
template <class BlockOf>
Quantized random_quantized(int64_t count, int64_t blocks, BlockOf&& block_of, std::mt19937_64& rng,
                           double target_rms) {
  Quantized r;
  std::normal_distribution<double> normal(0.0, 96.0);
  std::uniform_real_distribution<double> log_scale(-3.0, 3.0);
  r.scales.resize(blocks);
  // Scales spread over 2^-3..2^3 of target_rms / 96, so a wrong block index shows.
  for (auto& s : r.scales) s = static_cast<float>(target_rms / 96.0 * std::exp2(log_scale(rng)));
  r.q.resize(count);
  r.values.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    r.q[i] = e4m3_bits(normal(rng));
    r.values[i] = e4m3_value(r.q[i]) * double(r.scales[block_of(i)]);
  }
  return r;
}

// The error of a bf16 output beyond its own rounding: with e = ||got - ref|| / ||ref|| and
// e_round the same for bf16(ref), sqrt(e^2 - e_round^2) (a GEMM's error before the output's
// rounding adds to that rounding in quadrature). Both are printed.
double error_beyond_rounding(const std::vector<double>& got, const std::vector<double>& ref,
                             const char* what) {
  std::vector<double> rounded(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) rounded[i] = megamoe_test::bf16_value(megamoe_test::bf16_bits(ref[i]));
  const double e = megamoe_test::relative_error(got, ref);
  const double e_round = megamoe_test::relative_error(rounded, ref);
  const double beyond = std::sqrt(std::max(0.0, e * e - e_round * e_round));
  std::printf("%s: error %.3e, of bf16(exact) %.3e, beyond the rounding %.3e\n", what, e, e_round,
              beyond);
  return std::isfinite(e) ? beyond : e;
}

// An M-grouped FP8 A: its logical rows (dequantized) and the device operand.
struct Fp8A {
  std::vector<double> rows;  // [sorted rows, k]
  megamoe::sm90::MGroupedFp8A device;
  std::vector<double> row_factor;  // [sorted rows] the power of two a row's scales carry
};

// Experts' weights B_e [n, k] with 128 x 128 block scales, stored either [E, n/128, k/128]
// (W's own layout) or [E, k/128, n/128] (read with swapped strides, as W^T reads W's).
struct Fp8B {
  std::vector<double> values;  // [E * n, k]
  megamoe::sm90::Fp8Weights device;
};

class Fp8GemmGpu : public megamoe_test::MGroupedGemmTest {
 protected:
  // With `spread`, each stored row's scales also carry a random power of two 2^-spread ..
  // 2^spread (row_factor).
  Fp8A make_fp8_a(const HostGroups& g, ALayout layout, int64_t k, int64_t tokens,
                  std::mt19937_64& rng, int spread = 0) {
    const int64_t kb = k / 128;
    const bool gathered = layout == ALayout::kGathered;
    const RowLayout rl = layout == ALayout::kPadded ? RowLayout::kPadded : RowLayout::kSorted;
    const int64_t stored_rows = gathered ? tokens : g.rows_in(rl);
    const int64_t ld = (stored_rows + 3) / 4 * 4 + 4;  // a scale_ld beyond the rows
    Quantized qa = random_quantized(stored_rows * k, kb * ld,
                                    [&](int64_t i) { return (i % k) / 128 * ld + i / k; }, rng, 1.0);
    std::vector<double> factor(stored_rows, 1.0);
    if (spread > 0) {
      std::uniform_int_distribution<int> exponent(-spread, spread);
      for (int64_t p = 0; p < stored_rows; ++p) {
        factor[p] = std::ldexp(1.0, exponent(rng));
        for (int64_t b = 0; b < kb; ++b) qa.scales[b * ld + p] *= static_cast<float>(factor[p]);
        for (int64_t j = 0; j < k; ++j) qa.values[p * k + j] *= factor[p];
      }
    }
    Fp8A a;
    a.rows.assign(g.rows * k, 0.0);
    a.row_factor.assign(g.rows, 1.0);
    std::vector<int32_t> index(g.rows);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(tokens) - 1);
    for (int64_t r = 0; r < g.rows; ++r) {
      const int64_t src = gathered ? (index[r] = pick(rng)) : g.row_in(rl, r);
      for (int64_t j = 0; j < k; ++j) a.rows[r * k + j] = qa.values[src * k + j];
      a.row_factor[r] = factor[src];
    }
    if (!gathered) {
      // Pad rows hold NaN (0x7F) with NaN scales: no valid output may read them.
      const std::vector<bool> used = rl == RowLayout::kPadded ? g.padded_rows_used()
                                                              : std::vector<bool>(g.rows, true);
      for (int64_t p = 0; p < stored_rows; ++p) {
        if (used[p]) continue;
        for (int64_t j = 0; j < k; ++j) qa.q[p * k + j] = 0x7F;
        for (int64_t b = 0; b < kb; ++b) qa.scales[b * ld + p] = NAN;
      }
    }
    a.device.data = reinterpret_cast<const __nv_fp8_e4m3*>(upload(qa.q));
    a.device.rows = stored_rows;
    a.device.layout = rl;
    a.device.gather = gathered ? upload(index) : nullptr;
    a.device.scales = upload(qa.scales);
    a.device.scale_ld = ld;
    return a;
  }

  Fp8B make_fp8_b(int64_t E, int64_t n, int64_t k, bool transposed_scales, std::mt19937_64& rng) {
    const int64_t nb = n / 128, kb = k / 128;
    const auto block_of = [&](int64_t i) {
      const int64_t e = i / (n * k), row = (i / k) % n, col = i % k;
      return transposed_scales ? (e * kb + col / 128) * nb + row / 128
                               : (e * nb + row / 128) * kb + col / 128;
    };
    const Quantized qb = random_quantized(E * n * k, E * nb * kb, block_of, rng, 1.0 / std::sqrt(k));
    Fp8B b;
    b.values = qb.values;
    b.device.data = reinterpret_cast<const __nv_fp8_e4m3*>(upload(qb.q));
    b.device.scales = upload(qb.scales);
    b.device.s_expert = nb * kb;
    b.device.s_n = transposed_scales ? 1 : kb;
    b.device.s_k = transposed_scales ? nb : 1;
    return b;
  }

  megamoe::sm90::MGroupedFp8GemmArgs fp8_args(const HostGroups& g, const Fp8A& a, const Fp8B& b,
                                              int64_t k, int64_t n, int64_t c_cols, RowLayout c) {
    megamoe::sm90::MGroupedFp8GemmArgs args;
    args.groups = upload_groups(g);
    args.a = a.device;
    args.b = b.device;
    args.k = k;
    args.n = n;
    const int64_t c_rows = g.rows_in(c);
    args.c = {poisoned_bf16(c_rows * c_cols), c_cols, c_rows, c};
    return args;
  }
};

struct Fp8Case {
  ALayout a;
  RowLayout c;
  bool transposed_scales;
};
std::string fp8_case_name(const ::testing::TestParamInfo<Fp8Case>& info) {
  const Fp8Case& p = info.param;
  return megamoe_test::name_of(p.a) + "_C" + megamoe_test::name_of(p.c) +
         (p.transposed_scales ? "_WTscales" : "_Wscales");
}
void PrintTo(const Fp8Case& p, std::ostream* os) {
  *os << fp8_case_name(::testing::TestParamInfo<Fp8Case>(p, 0));
}
std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cases;
  for (ALayout a : {ALayout::kSorted, ALayout::kPadded, ALayout::kGathered}) {
    for (RowLayout c : {RowLayout::kSorted, RowLayout::kPadded}) {
      cases.push_back({a, c, a == ALayout::kPadded});
    }
  }
  return cases;
}

class Fp8StoreGpu : public Fp8GemmGpu, public ::testing::WithParamInterface<Fp8Case> {
 protected:
  // The GEMM on the same operands once per SM limit (0: none), each into a fresh poisoned C.
  void check(const std::vector<int>& sm_limits) {
    const Fp8Case& p = GetParam();
    const uint64_t seed = megamoe_test::fresh_seed();
    SEEDED(seed);
    std::mt19937_64 rng(seed);
    const HostGroups g(megamoe_test::awkward_counts());
    // 5 k-blocks; N = 384: three 128-wide tiles; N = 768: three 256-wide ones (each over two
    // B scale blocks), except with a gathered A, which runs 128-wide.
    for (const int64_t N : {384, 768}) {
      SCOPED_TRACE("N = " + std::to_string(N));
      const int64_t K = 640, E = g.num_experts();
      const Fp8A a = make_fp8_a(g, p.a, K, 300, rng);
      const Fp8B b = make_fp8_b(E, N, K, p.transposed_scales, rng);
      const std::vector<double> ref =
          megamoe_test::grouped_product(g, a.rows, b.values, K, N, false);
      for (const int sms : sm_limits) {
        SCOPED_TRACE("SmLimit " + std::to_string(sms));
        std::optional<megamoe::SmLimit> limit;
        if (sms > 0) limit.emplace(sms);
        const auto args = fp8_args(g, a, b, K, N, N, p.c);
        megamoe::sm90::m_grouped_fp8_gemm_nt(args, stream_);
        CUDA_OK(cudaGetLastError());
        const std::vector<uint16_t> c = download_bf16(args.c.data, args.c.rows * N);
        EXPECT_LT(error_beyond_rounding(megamoe_test::sorted_rows_of(c, g, p.c, N), ref, "C"),
                  kFp8GemmBound);
        if (p.c == RowLayout::kPadded) {
          EXPECT_EQ(megamoe_test::bad_pad_elements(c, g, N, megamoe_test::is_poison), 0);
        }
      }
    }
  }
};

TEST_P(Fp8StoreGpu, MatchesDequantizedProduct) { check({0}); }

// On few SMs every block loops over many tiles, so the ring's stages and a passed tile's
// slot are reused across tiles (the persistent schedule's later rounds), which a grid as
// large as the problem never reaches; racecheck runs it (tools/gpu_check.sh).
TEST_P(Fp8StoreGpu, MatchesDequantizedProductOnFewSms) { check({1, 3, 16}); }
INSTANTIATE_TEST_SUITE_P(Variants, Fp8StoreGpu, ::testing::ValuesIn(fp8_cases()), fp8_case_name);

class Fp8SwiGLUGpu : public Fp8GemmGpu, public ::testing::WithParamInterface<Fp8Case> {};

TEST_P(Fp8SwiGLUGpu, MatchesDequantizedProduct) {
  const Fp8Case& p = GetParam();
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  // Gate blocks 0 and 1 per expert: two 256-wide tiles (128 gate, 128 up columns each), or
  // with a gathered A four 128-wide ones (gate blocks 0, 0, 1, 1).
  const int64_t H = 384, I = 256, E = g.num_experts();
  const Fp8A x = make_fp8_a(g, p.a, H, 300, rng);
  const Fp8B w = make_fp8_b(E, 2 * I, H, p.transposed_scales, rng);
  const auto args = fp8_args(g, x, w, H, I, I, p.c);
  __nv_bfloat16* h = poisoned_bf16(args.c.rows * 2 * I);
  megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu(args, h, stream_);
  CUDA_OK(cudaGetLastError());
  const std::vector<double> ref_h = megamoe_test::grouped_product(g, x.rows, w.values, H, 2 * I, false);
  const std::vector<double> ref_out = megamoe_test::swiglu_reference(ref_h, g.rows, I);
  const std::vector<uint16_t> out = download_bf16(args.c.data, args.c.rows * I);
  EXPECT_LT(error_beyond_rounding(megamoe_test::sorted_rows_of(out, g, p.c, I), ref_out, "silu(g) u"),
            kFp8GemmBound);
  const std::vector<uint16_t> hv = download_bf16(h, args.c.rows * 2 * I);
  EXPECT_LT(error_beyond_rounding(megamoe_test::sorted_rows_of(hv, g, p.c, 2 * I), ref_h, "h"),
            kFp8GemmBound);
  if (p.c == RowLayout::kPadded) {
    EXPECT_EQ(megamoe_test::bad_pad_elements(out, g, I, megamoe_test::is_poison), 0);
  }
}
INSTANTIATE_TEST_SUITE_P(Variants, Fp8SwiGLUGpu, ::testing::ValuesIn(fp8_cases()), fp8_case_name);

// The SwiGLU output as FP8 rows (Fp8RowsOut) is the bf16 C of the same GEMM quantized by
// quantize_fp8 (kRows1x128), bit for bit, values and scales, with h alongside as the bf16
// call writes it; rows without an expert row (pad rows) are left as they were. A comes by
// TMA (the FP8 rows need the wide tiles). Among the rows: one of A all zeros (an all-zero
// block: the scale of the amax floor) and two whose A scales are Inf (Inf and NaN
// accumulators: non-finite blocks), in full and partial slabs.
class Fp8SwiGLURowsGpu : public Fp8GemmGpu, public ::testing::WithParamInterface<Fp8Case> {
 protected:
  // Sorted row r of A (stored as `layout`) all zeros, or with Inf scales.
  void set_row(const HostGroups& g, ALayout layout, const Fp8A& a, int64_t k, int64_t r,
               bool zero) {
    const int64_t p = g.row_in(layout == ALayout::kPadded ? RowLayout::kPadded : RowLayout::kSorted, r);
    if (zero) {
      auto* data = const_cast<__nv_fp8_e4m3*>(a.device.data);
      ASSERT_EQ(cudaMemset(data + p * k, 0, k), cudaSuccess);
      return;
    }
    const float inf = INFINITY;
    for (int64_t b = 0; b < k / 128; ++b) {
      float* scale = const_cast<float*>(a.device.scales) + b * a.device.scale_ld + p;
      ASSERT_EQ(cudaMemcpy(scale, &inf, sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  template <class T>
  T* poisoned(int64_t count) {
    T* d = alloc<T>(count);
    EXPECT_EQ(cudaMemset(d, 0xFF, count * sizeof(T)), cudaSuccess);
    return d;
  }
};
std::vector<Fp8Case> fp8_tma_cases() {
  std::vector<Fp8Case> cases = fp8_cases();
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [](const Fp8Case& c) { return c.a == ALayout::kGathered; }),
              cases.end());
  return cases;
}

TEST_P(Fp8SwiGLURowsGpu, EqualsTheQuantizedBf16Output) {
  const Fp8Case& p = GetParam();
  if (!megamoe::sm90::fp8_swiglu_quantizes(128, false)) GTEST_SKIP() << "no 256-wide tiles";
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  // Three 256-wide tiles (gate blocks 0, 1, 2) per expert.
  const int64_t H = 384, I = 384, E = g.num_experts(), blocks = I / 128;
  const Fp8A x = make_fp8_a(g, p.a, H, 300, rng);
  // Expert 1 (200 rows): row 5, a full slab; expert 2 (77): row 70, the partial slab of the
  // second warpgroup; expert 5 (131): its row 129, in the 3-row tile.
  set_row(g, p.a, x, H, g.offsets[1] + 5, false);
  set_row(g, p.a, x, H, g.offsets[2] + 70, false);
  set_row(g, p.a, x, H, g.offsets[5] + 129, true);
  const Fp8B w = make_fp8_b(E, 2 * I, H, p.transposed_scales, rng);
  megamoe::sm90::MGroupedFp8GemmArgs args = fp8_args(g, x, w, H, I, I, p.c);
  const int64_t rows = args.c.rows, scale_ld = (rows + 3) / 4 * 4 + 4;

  __nv_bfloat16* h_bf16 = poisoned_bf16(rows * 2 * I);
  megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu(args, h_bf16, stream_);
  megamoe::Fp8QuantizeArgs q;
  q.x = args.c.data;
  q.x_row = I;
  q.rows = rows;
  q.cols = I;
  q.q = alloc<uint8_t>(rows * I);
  q.q_row = I;
  q.scales = alloc<float>(blocks * scale_ld);
  q.s_0 = 1;
  q.s_1 = scale_ld;
  megamoe::quantize_fp8(megamoe::Fp8Blocks::kRows1x128, q, stream_);

  __nv_bfloat16* h = poisoned_bf16(rows * 2 * I);
  const megamoe::sm90::Fp8RowsOut out{reinterpret_cast<__nv_fp8_e4m3*>(poisoned<uint8_t>(rows * I)),
                                      poisoned<float>(blocks * scale_ld), scale_ld};
  args.c.data = nullptr;
  megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu(args, h, out, stream_);
  CUDA_OK(cudaGetLastError());

  const std::vector<uint8_t> ref_q = download(q.q, rows * I);
  const std::vector<uint8_t> got_q = download(reinterpret_cast<const uint8_t*>(out.q), rows * I);
  const std::vector<uint32_t> ref_s = download(reinterpret_cast<const uint32_t*>(q.scales), blocks * scale_ld);
  const std::vector<uint32_t> got_s = download(reinterpret_cast<const uint32_t*>(out.scales), blocks * scale_ld);
  std::vector<bool> used(rows, p.c == RowLayout::kSorted);
  if (p.c == RowLayout::kPadded) used = g.padded_rows_used();
  int64_t bad_q = 0, bad_s = 0, nonfinite = 0, zero = 0;
  const float zero_scale = 0x1p-100f / 448.0f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint32_t want = used[r] ? ref_s[b * scale_ld + r] : 0xFFFFFFFFu;  // pad: untouched
      bad_s += got_s[b * scale_ld + r] != want;
      nonfinite += used[r] && want == 0x7FC00000u;
      zero += used[r] && want == std::bit_cast<uint32_t>(zero_scale);
    }
    for (int64_t c = 0; c < I; ++c) bad_q += got_q[r * I + c] != (used[r] ? ref_q[r * I + c] : 0xFF);
  }
  EXPECT_EQ(bad_q, 0) << "e4m3 values";
  EXPECT_EQ(bad_s, 0) << "scales";
  EXPECT_GE(nonfinite, 2 * blocks) << "the Inf-scaled rows' blocks are non-finite";
  EXPECT_GE(zero, blocks) << "the zero row's blocks take the amax floor";
  EXPECT_TRUE(download_bf16(h, rows * 2 * I) == download_bf16(h_bf16, rows * 2 * I)) << "h";
}
INSTANTIATE_TEST_SUITE_P(Variants, Fp8SwiGLURowsGpu, ::testing::ValuesIn(fp8_tma_cases()),
                         fp8_case_name);

class Fp8SwiGLUBackwardGpu : public Fp8GemmGpu, public ::testing::WithParamInterface<Fp8Case> {
 protected:
  // dy's rows scaled by powers of two up to 2^+-spread (make_fp8_a); dh and dp are compared
  // with each row divided by its power of two, so that every row counts alike.
  void check(int spread) {
    const Fp8Case& p = GetParam();
    const uint64_t seed = megamoe_test::fresh_seed();
    SEEDED(seed);
    std::mt19937_64 rng(seed);
    const HostGroups g(megamoe_test::awkward_counts());
    const int64_t H = 384, I = 512, E = g.num_experts();
    const Fp8A dy = make_fp8_a(g, p.a, H, 300, rng, spread);
    const Fp8B w_t = make_fp8_b(E, I, H, p.transposed_scales, rng);  // W_down^T [E, I, H]
    const std::vector<uint16_t> h = megamoe_test::random_bf16(g.rows * 2 * I, rng, 1.5);
    const std::vector<double> hv = megamoe_test::bf16_values(h);
    const megamoe_test::SwiGLUSlots slots = megamoe_test::random_swiglu_slots(g.rows, rng);

    const auto args = fp8_args(g, dy, w_t, H, I, 2 * I, p.c);
    // Two 256-wide N-tiles, or with a gathered A four 128-wide ones: a dp partial each.
    const bool gathered = p.a == ALayout::kGathered;
    const int64_t dp_cols = megamoe::sm90::fp8_swiglu_backward_dp_columns(I, gathered);
    const megamoe::sm90::SwiGLUGradArgs grads =
        swiglu_grads(h, slots, g.rows, dp_cols, poisoned_bf16(args.c.rows * I));
    float* dp = grads.dp_partial;
    megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu_backward(args, grads, stream_);
    CUDA_OK(cudaGetLastError());

    const std::vector<double> z = megamoe_test::grouped_product(g, dy.rows, w_t.values, H, I, false);
    megamoe_test::SwiGLUBackwardReference ref =
        megamoe_test::swiglu_backward_reference(z, hv, slots, g.rows, I, I / dp_cols);
    const std::vector<uint16_t> dh = download_bf16(args.c.data, args.c.rows * 2 * I);
    std::vector<double> dh_rows = megamoe_test::sorted_rows_of(dh, g, p.c, 2 * I);
    const std::vector<float> dp_got = download(dp, g.rows * dp_cols);
    std::vector<double> dp_rows(dp_got.begin(), dp_got.end());
    const auto per_row = [&](std::vector<double>& v, int64_t cols) {
      for (int64_t r = 0; r < g.rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) v[r * cols + c] /= dy.row_factor[r];
      }
    };
    per_row(dh_rows, 2 * I);
    per_row(ref.dh, 2 * I);
    per_row(dp_rows, dp_cols);
    per_row(ref.dp, dp_cols);
    EXPECT_LT(error_beyond_rounding(dh_rows, ref.dh, "dh"), kFp8GemmBound);
    const double dp_err = megamoe_test::relative_error(dp_rows, ref.dp);
    std::printf("dp partials (fp32): error %.3e\n", dp_err);
    EXPECT_LT(dp_err, kFp8GemmBound);
    const std::vector<uint16_t> a = download_bf16(grads.a_out, args.c.rows * I);
    EXPECT_LT(error_beyond_rounding(megamoe_test::sorted_rows_of(a, g, p.c, I), ref.a, "a"),
              kFp8GemmBound);
    if (p.c == RowLayout::kPadded) {
      EXPECT_EQ(megamoe_test::bad_pad_elements(dh, g, 2 * I, megamoe_test::is_zero), 0) << "dh";
      EXPECT_EQ(megamoe_test::bad_pad_elements(a, g, I, megamoe_test::is_zero), 0) << "a";
    }
  }
};

TEST_P(Fp8SwiGLUBackwardGpu, MatchesDequantizedProduct) { check(0); }
// The wide tiles hand z to their epilogue warps in fp16, each row scaled by a power of two:
// rows 2^+-100 apart must keep their precision (a scale per tile would flush the small ones).
TEST_P(Fp8SwiGLUBackwardGpu, RowsOfEveryMagnitude) { check(100); }
INSTANTIATE_TEST_SUITE_P(Variants, Fp8SwiGLUBackwardGpu, ::testing::ValuesIn(fp8_cases()),
                         fp8_case_name);

// (fp32 added into, b's scales in 128 x 128 tiles: b_tile_scales)
class Fp8WeightGradGpu : public megamoe_test::GpuTest,
                         public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

TEST_P(Fp8WeightGradGpu, MatchesDequantizedProduct) {
  const auto [accumulate, tile_scales] = GetParam();
  const uint64_t seed = megamoe_test::fresh_seed();
  SEEDED(seed);
  std::mt19937_64 rng(seed);
  const HostGroups g(megamoe_test::awkward_counts());
  const int64_t M = 256, E = g.num_experts(), P = g.padded_rows, PB = P / 128;
  // N = 384: three 128-wide tiles; N = 512: two 256-wide ones.
  for (const int64_t N : {384, 512}) {
    SCOPED_TRACE("N = " + std::to_string(N));
    // a_t [M, P] and b_t [N, P] token-contiguous; scales [P / 128, M] and [P / 128, N].
    Quantized a = random_quantized(M * P, PB * M, [&](int64_t i) { return (i % P) / 128 * M + i / P; },
                                   rng, 1.0);
    // With tile_scales, each 128 x 128 tile of b takes its first column's scale, which is
    // then repeated at each of its columns' places.
    const int64_t b_tile = tile_scales ? 128 : 1;
    Quantized b = random_quantized(
        N * P, PB * N, [&](int64_t i) { return (i % P) / 128 * N + i / P / b_tile * b_tile; },
        rng, 1.0 / 16);
    for (int64_t k = 0; k < PB * N; ++k) b.scales[k] = b.scales[k / N * N + k % N / b_tile * b_tile];
    // Pad rows (tokens) are zeros, as the quantizer writes them.
    const std::vector<bool> used = g.padded_rows_used();
    for (int64_t r = 0; r < P; ++r) {
      if (used[r]) continue;
      for (int64_t i = 0; i < M; ++i) a.q[i * P + r] = 0, a.values[i * P + r] = 0;
      for (int64_t j = 0; j < N; ++j) b.q[j * P + r] = 0, b.values[j * P + r] = 0;
    }
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<float> c0(E * M * N);
    for (auto& v : c0) v = static_cast<float>(normal(rng));

    megamoe::sm90::KGroupedFp8GemmArgs args;
    args.a_t = reinterpret_cast<const __nv_fp8_e4m3*>(upload(a.q));
    args.a_scales = upload(a.scales);
    args.b_t = reinterpret_cast<const __nv_fp8_e4m3*>(upload(b.q));
    args.b_scales = upload(b.scales);
    args.padded_rows = P;
    args.m = M;
    args.n = N;
    args.num_experts = E;
    args.tile_offsets = upload(g.tiles);
    args.b_tile_scales = tile_scales;
    if (accumulate) {
      args.c_accumulate = upload(c0);
    } else {
      auto* c = alloc<uint16_t>(E * M * N);
      CUDA_OK(cudaMemset(c, 0xFF, E * M * N * 2));
      args.c = reinterpret_cast<__nv_bfloat16*>(c);
    }
    megamoe::sm90::k_grouped_fp8_gemm_tn(args, stream_);
    CUDA_OK(cudaGetLastError());

    std::vector<double> ref(E * M * N, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double sum = 0;
          for (int64_t r = int64_t(g.tiles[e]) * 128; r < int64_t(g.tiles[e + 1]) * 128; ++r) {
            sum += a.values[i * P + r] * b.values[j * P + r];
          }
          ref[(e * M + i) * N + j] = sum;
        }
      }
    }
    if (accumulate) {
      const std::vector<float> got = download(args.c_accumulate, E * M * N);
      std::vector<double> delta(got.size());
      for (size_t i = 0; i < got.size(); ++i) delta[i] = double(got[i]) - double(c0[i]);
      const double err = megamoe_test::relative_error(delta, ref);
      std::printf("fp32 dW: error %.3e\n", err);
      EXPECT_LT(err, kFp8GemmBound);
    } else {
      const std::vector<double> got = megamoe_test::bf16_values(download(reinterpret_cast<const uint16_t*>(args.c), E * M * N));
      EXPECT_LT(error_beyond_rounding(got, ref, "bf16 dW"), kFp8GemmBound);
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Outputs, Fp8WeightGradGpu,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<bool, bool>>& info) {
                           return std::string(std::get<0>(info.param) ? "f32add" : "bf16") +
                                  (std::get<1>(info.param) ? "_tile_scales" : "");
                         });

TEST(Fp8GemmArgs, RejectsBadShapes) {
  megamoe::sm90::MGroupedFp8GemmArgs args;
  args.k = 64;  // not a scale block
  args.n = 128;
  EXPECT_THROW(megamoe::sm90::m_grouped_fp8_gemm_nt(args, nullptr), megamoe::Error);
  args.k = 128;
  args.n = 64;
  EXPECT_THROW(megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu(args, nullptr, nullptr), megamoe::Error);
  megamoe::sm90::KGroupedFp8GemmArgs w;
  w.m = 128;
  w.n = 128;
  w.padded_rows = 100;
  EXPECT_THROW(megamoe::sm90::k_grouped_fp8_gemm_tn(w, nullptr), megamoe::Error);
}

// The FP8-rows output's arguments, each bad one named (checked before anything runs; the
// pointers are never read).
TEST(Fp8GemmArgs, RejectsBadFp8RowsOutput) {
  const auto fake = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
  megamoe::sm90::MGroupedFp8GemmArgs args;
  args.k = 128;
  args.n = 128;
  args.a.rows = 1;
  args.a.scales = static_cast<const float*>(fake(256));
  args.a.scale_ld = 4;
  args.b.scales = static_cast<const float*>(fake(256));
  args.c = {nullptr, 128, 8, RowLayout::kSorted};
  const megamoe::sm90::Fp8RowsOut good{static_cast<__nv_fp8_e4m3*>(fake(512)),
                                       static_cast<float*>(fake(1024)), 8};
  const auto call = [&](const megamoe::sm90::MGroupedFp8GemmArgs& a,
                        const megamoe::sm90::Fp8RowsOut& out) {
    return [a, out] { megamoe::sm90::m_grouped_fp8_gemm_nt_swiglu(a, nullptr, out, nullptr); };
  };
  auto gathered = args;
  gathered.a.gather = static_cast<const int32_t*>(fake(256));
  megamoe_test::expect_invalid(call(gathered, good), "args.a.gather");
  if (!megamoe::sm90::fp8_swiglu_quantizes(args.n, false)) {
    megamoe_test::expect_invalid(call(args, good), "MEGAMOE_GEMM_MAX_BLOCK_N");
    return;
  }
  auto with_c = args;
  with_c.c.data = static_cast<__nv_bfloat16*>(fake(256));
  megamoe_test::expect_invalid(call(with_c, good), "args.c.data");
  auto out = good;
  out.q = nullptr;
  megamoe_test::expect_invalid(call(args, out), "out.q");
  out = good;
  out.scales = static_cast<float*>(fake(1028));
  megamoe_test::expect_invalid(call(args, out), "16-byte aligned");
  out = good;
  out.scale_ld = 6;
  megamoe_test::expect_invalid(call(args, out), "out.scale_ld");
  out.scale_ld = 4;  // below args.c.rows
  megamoe_test::expect_invalid(call(args, out), "out.scale_ld");
}

}  // namespace
