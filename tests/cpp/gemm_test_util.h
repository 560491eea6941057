// Shared pieces of the grouped GEMM tests (test_m_grouped_gemm*.cpp, test_k_grouped_gemm.cpp):
// expert groups with every awkward case, bf16 operands in the layouts the GEMMs read, and
// the error measure. The references are CPU products in double of the same bf16 inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/sm90/gemm.h"

namespace megamoe_test {

// Empty experts first, in the middle and last; ragged tails (200, 77, 131 rows); an
// expert with one row; one whose rows fill two M-tiles exactly.
inline std::vector<int32_t> awkward_counts() { return {0, 200, 77, 1, 0, 131, 256, 0}; }

// The host side of an expert grouping: sorted row r of expert e is padded row
// tiles[e] * 128 + (r - offsets[e]). shorts: the prefix count of experts whose last M-tile
// holds at most 64 rows (RoutingPlan::short_tile_offsets: the FP8 GEMMs pair its N-tiles).
struct HostGroups {
  std::vector<int32_t> counts, offsets, tiles, shorts, expert_of_row;
  int64_t rows = 0, padded_rows = 0;

  explicit HostGroups(std::vector<int32_t> c) : counts(std::move(c)) {
    const size_t E = counts.size();
    offsets.assign(E + 1, 0);
    tiles.assign(E + 1, 0);
    shorts.assign(E + 1, 0);
    for (size_t e = 0; e < E; ++e) {
      offsets[e + 1] = offsets[e] + counts[e];
      tiles[e + 1] = tiles[e] + (counts[e] + megamoe::sm90::kGemmBlockM - 1) /
                                    megamoe::sm90::kGemmBlockM;
      const int32_t tail = counts[e] % megamoe::sm90::kGemmBlockM;
      shorts[e + 1] = shorts[e] + (tail != 0 && tail <= megamoe::sm90::kGemmBlockM / 2);
      for (int32_t i = 0; i < counts[e]; ++i) expert_of_row.push_back(static_cast<int32_t>(e));
    }
    rows = offsets[E];
    padded_rows = int64_t(tiles[E]) * megamoe::sm90::kGemmBlockM;
  }
  int64_t num_experts() const { return static_cast<int64_t>(counts.size()); }
  int64_t padded_row(int64_t r) const {
    const int e = expert_of_row[r];
    return int64_t(tiles[e]) * megamoe::sm90::kGemmBlockM + (r - offsets[e]);
  }
  int64_t row_in(megamoe::sm90::RowLayout layout, int64_t r) const {
    return layout == megamoe::sm90::RowLayout::kPadded ? padded_row(r) : r;
  }
  int64_t rows_in(megamoe::sm90::RowLayout layout) const {
    return layout == megamoe::sm90::RowLayout::kPadded ? padded_rows : rows;
  }
  // Whether padded row p holds a row of an expert (not a pad row).
  std::vector<bool> padded_rows_used() const {
    std::vector<bool> used(padded_rows, false);
    for (int64_t r = 0; r < rows; ++r) used[padded_row(r)] = true;
    return used;
  }
};

constexpr uint16_t kBf16NaN = 0xFFFF;  // what cudaMemset(0xFF) leaves in a bf16 buffer

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = bf16_bits(normal(rng));
  return v;
}

// bf16 bits as doubles.
inline std::vector<double> bf16_values(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_value(bits[i]);
  return v;
}

// ||got - ref|| / ||ref|| (Frobenius); infinite if got has a non-finite value (an output
// left unwritten keeps the NaN it was poisoned with).
inline double relative_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// Bounds. bf16 outputs carry one rounding of a float result: relative error up to 2^-8 per
// element, about 1.3e-3 in the Frobenius norm over thousands of elements; fp32 outputs only
// float accumulation error.
constexpr double kBf16Bound = 5e-3;
constexpr double kFloatBound = 1e-4;

// The operand A of an M-grouped GEMM as the three producers read it.
enum class ALayout { kSorted, kPadded, kGathered };
inline std::string name_of(ALayout a) {
  return a == ALayout::kSorted ? "Asorted" : a == ALayout::kPadded ? "Apadded" : "Agathered";
}
inline std::string name_of(megamoe::sm90::RowLayout c) {
  return c == megamoe::sm90::RowLayout::kPadded ? "padded" : "sorted";
}

// The SwiGLU backward's per-row inputs besides the GEMM's: router weights of 2 * rows slots
// and a distinct slot for each row.
struct SwiGLUSlots {
  std::vector<float> weights;
  std::vector<int32_t> row_slot;
};
inline SwiGLUSlots random_swiglu_slots(int64_t rows, std::mt19937_64& rng) {
  SwiGLUSlots s;
  s.weights.resize(2 * rows);
  std::uniform_real_distribution<float> uniform(0.05f, 1.f);
  for (auto& x : s.weights) x = uniform(rng);
  s.row_slot.resize(2 * rows);
  for (int64_t i = 0; i < 2 * rows; ++i) s.row_slot[i] = static_cast<int32_t>(i);
  std::shuffle(s.row_slot.begin(), s.row_slot.end(), rng);
  s.row_slot.resize(rows);
  return s;
}

// A's logical rows (one per sorted row) and the device buffer the GEMM reads them from.
struct GroupedA {
  std::vector<double> rows;  // [sorted rows, k]
  megamoe::sm90::MGroupedA device;
};

// The fixture of the M-grouped tests: a grouping on the device and A in any layout.
class MGroupedGemmTest : public GpuTest {
 protected:
  // paired: with short_tile_offsets (which only the FP8 GEMMs read).
  megamoe::sm90::ExpertGroups upload_groups(const HostGroups& g, bool paired = true) {
    return {g.num_experts(), upload(g.offsets), upload(g.tiles), g.rows,
            paired ? upload(g.shorts) : nullptr};
  }

  // A [rows, k] ~ N(0, 1): materialised sorted or padded (pad rows NaN: no valid output may
  // read them), or gathered from `tokens` token rows.
  GroupedA make_a(const HostGroups& g, ALayout layout, int64_t k, int64_t tokens,
                  std::mt19937_64& rng) {
    GroupedA a;
    a.rows.resize(g.rows * k);
    if (layout == ALayout::kGathered) {
      const std::vector<uint16_t> source = random_bf16(tokens * k, rng, 1.0);
      std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(tokens) - 1);
      std::vector<int32_t> index(g.rows);
      for (int64_t r = 0; r < g.rows; ++r) {
        index[r] = pick(rng);
        for (int64_t j = 0; j < k; ++j) a.rows[r * k + j] = bf16_value(source[index[r] * k + j]);
      }
      a.device.data = reinterpret_cast<const __nv_bfloat16*>(upload(source));
      a.device.rows = tokens;
      a.device.gather = upload(index);
      return a;
    }
    const auto rl = layout == ALayout::kPadded ? megamoe::sm90::RowLayout::kPadded
                                               : megamoe::sm90::RowLayout::kSorted;
    std::vector<uint16_t> stored(g.rows_in(rl) * k, kBf16NaN);
    const std::vector<uint16_t> values = random_bf16(g.rows * k, rng, 1.0);
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        stored[g.row_in(rl, r) * k + j] = values[r * k + j];
        a.rows[r * k + j] = bf16_value(values[r * k + j]);
      }
    }
    a.device.data = reinterpret_cast<const __nv_bfloat16*>(upload(stored));
    a.device.rows = g.rows_in(rl);
    a.device.layout = rl;
    return a;
  }

  // The arguments of an M-grouped GEMM over g, A and B (uploaded), with a NaN-poisoned C of
  // c_cols columns in `c_layout`.
  megamoe::sm90::MGroupedGemmArgs gemm_args(const HostGroups& g, const GroupedA& a,
                                            const std::vector<uint16_t>& b, int64_t k, int64_t n,
                                            int64_t c_cols, megamoe::sm90::RowLayout c_layout) {
    megamoe::sm90::MGroupedGemmArgs args;
    args.groups = upload_groups(g);
    args.a = a.device;
    args.b = reinterpret_cast<const __nv_bfloat16*>(upload(b));
    args.k = k;
    args.n = n;
    const int64_t c_rows = g.rows_in(c_layout);
    args.c = {poisoned_bf16(c_rows * c_cols), c_cols, c_rows, c_layout};
    return args;
  }

  // The SwiGLU backward's operands besides the GEMM's: h and the slots uploaded, dp
  // partials [rows, dp_cols] poisoned with NaN, a_out as given.
  megamoe::sm90::SwiGLUGradArgs swiglu_grads(const std::vector<uint16_t>& h,
                                             const SwiGLUSlots& slots, int64_t rows,
                                             int64_t dp_cols, __nv_bfloat16* a_out);

  // A bf16 output of `count` elements poisoned with NaN.
  __nv_bfloat16* poisoned_bf16(int64_t count) {
    auto* d = alloc<uint16_t>(count);
    EXPECT_EQ(cudaMemset(d, 0xFF, count * 2), cudaSuccess);
    return reinterpret_cast<__nv_bfloat16*>(d);
  }
  std::vector<uint16_t> download_bf16(const __nv_bfloat16* d, int64_t count) {
    return download(reinterpret_cast<const uint16_t*>(d), count);
  }
};

// [rows, n] = A_r . B_e for the rows r of each expert e, in double: B (values) is [E * n, k]
// (K-major B_e, b_n_major false) or [E * k, n].
inline std::vector<double> grouped_product(const HostGroups& g, const std::vector<double>& a,
                                           const std::vector<double>& b, int64_t k, int64_t n,
                                           bool b_n_major) {
  std::vector<double> c(g.rows * n, 0.0);
  for (int64_t r = 0; r < g.rows; ++r) {
    const int64_t e = g.expert_of_row[r];
    for (int64_t j = 0; j < k; ++j) {
      const double x = a[r * k + j];
      for (int64_t i = 0; i < n; ++i) {
        c[r * n + i] += x * (b_n_major ? b[(e * k + j) * n + i] : b[(e * n + i) * k + j]);
      }
    }
  }
  return c;
}

// The values of the sorted rows of a [., cols] bf16 output laid out in `layout`.
inline std::vector<double> sorted_rows_of(const std::vector<uint16_t>& out, const HostGroups& g,
                                          megamoe::sm90::RowLayout layout, int64_t cols) {
  std::vector<double> v(g.rows * cols);
  for (int64_t r = 0; r < g.rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = bf16_value(out[g.row_in(layout, r) * cols + c]);
  }
  return v;
}
// How many elements of the pad rows of a padded [., cols] bf16 output fail `expected`.
template <class Expected>
int64_t bad_pad_elements(const std::vector<uint16_t>& out, const HostGroups& g, int64_t cols,
                         Expected&& expected) {
  const std::vector<bool> used = g.padded_rows_used();
  int64_t bad = 0;
  for (int64_t p = 0; p < g.padded_rows; ++p) {
    if (used[p]) continue;
    for (int64_t c = 0; c < cols; ++c) bad += !expected(out[p * cols + c]);
  }
  return bad;
}
inline bool is_poison(uint16_t bits) { return bits == kBf16NaN; }
inline bool is_zero(uint16_t bits) { return bf16_value(bits) == 0.0; }

// silu(g) u of each row of h = [g | u] ([rows, 2I] -> [rows, I]), in double.
inline std::vector<double> swiglu_reference(const std::vector<double>& h, int64_t rows, int64_t I) {
  std::vector<double> out(rows * I);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      const double gate = h[r * 2 * I + c], up = h[r * 2 * I + I + c];
      out[r * I + c] = gate / (1.0 + std::exp(-gate)) * up;
    }
  }
  return out;
}

inline megamoe::sm90::SwiGLUGradArgs MGroupedGemmTest::swiglu_grads(
    const std::vector<uint16_t>& h, const SwiGLUSlots& slots, int64_t rows, int64_t dp_cols,
    __nv_bfloat16* a_out) {
  float* dp = alloc<float>(rows * dp_cols);
  EXPECT_EQ(cudaMemset(dp, 0xFF, rows * dp_cols * sizeof(float)), cudaSuccess);
  megamoe::sm90::SwiGLUGradArgs grads;
  grads.h = reinterpret_cast<const __nv_bfloat16*>(upload(h));
  grads.slot_weights = upload(slots.weights);
  grads.row_slot = upload(slots.row_slot);
  grads.dp_partial = dp;
  grads.a_out = a_out;
  return grads;
}

// The SwiGLU backward in double from z = the dgrad's product and h = [g | u]: dh, a and
// the dp partials (one per block_n columns of I).
struct SwiGLUBackwardReference {
  std::vector<double> dh, a, dp;
};
inline SwiGLUBackwardReference swiglu_backward_reference(const std::vector<double>& z,
                                                         const std::vector<double>& h,
                                                         const SwiGLUSlots& slots, int64_t rows,
                                                         int64_t I, int64_t block_n) {
  const int64_t dp_cols = I / block_n;
  SwiGLUBackwardReference ref{std::vector<double>(rows * 2 * I), std::vector<double>(rows * I),
                              std::vector<double>(rows * dp_cols, 0.0)};
  for (int64_t r = 0; r < rows; ++r) {
    const double weight = slots.weights[slots.row_slot[r]];
    for (int64_t c = 0; c < I; ++c) {
      const double gate = h[r * 2 * I + c], up = h[r * 2 * I + I + c], zc = z[r * I + c];
      const double sig = 1.0 / (1.0 + std::exp(-gate)), a = gate * sig * up, da = weight * zc;
      ref.dh[r * 2 * I + c] = da * up * sig * (1.0 + gate * (1.0 - sig));
      ref.dh[r * 2 * I + I + c] = da * gate * sig;
      ref.a[r * I + c] = a;
      ref.dp[r * dp_cols + c / block_n] += zc * a;
    }
  }
  return ref;
}

}  // namespace megamoe_test
