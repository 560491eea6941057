// Descriptor checks of the FP8 quantizers' C ABI: each bad argument is named, with what was
// expected. The checks run before any device work, so these tests need no GPU (the bits of
// the kernels are tested against the reference quantizer in tests/python/test_fp8_kernels.py).
// And, on a GPU, the 1x128 quantizer writing rows to a routing plan's sorted rows
// (internal, quantize_fp8_to_rows of kernels/common/quantize_fp8.h): the bits of
// quantizing the token matrix and then gathering its rows, values and scales. And the
// 128-row column quantizer reading a plan's padded rows straight from the token matrix
// (quantize_fp8_columns_gathered): the bits of gather_rows_padded and then quantizing the
// columns. And one matrix quantized into rows and columns in one pass
// (quantize_fp8_rows_and_columns): the bits of the two separate quantizers. And the token
// matrix's e4m3 rows and scales copied into the sorted rows (copy_fp8_to_rows): the bytes of
// quantize_fp8_to_rows.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/quantize_fp8.h"
#include "kernels/common/routing_plan.h"
#include "kernels/common/sm_count.h"
#include "megamoe/megamoe.h"
#include "test_util.h"

using namespace megamoe_test;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Expects INVALID_ARGUMENT and a message containing `fragment`.
void expect_rejected(megamoe_status st, const std::string& fragment) {
  EXPECT_EQ(st, MEGAMOE_ERROR_INVALID_ARGUMENT) << megamoe_status_name(st);
  EXPECT_TRUE(contains(megamoe_last_error(), fragment)) << megamoe_last_error();
}

struct Rows1x128 {
  Tensor x{MEGAMOE_DTYPE_BFLOAT16, {4, 256}};
  Tensor q{MEGAMOE_DTYPE_FLOAT8_E4M3, {4, 256}};
  Tensor s{MEGAMOE_DTYPE_FLOAT32, {4, 2}};
  megamoe_tensor xd = x.desc(), qd = q.desc(), sd = s.desc();
  megamoe_status call() { return megamoe_quantize_fp8_1x128(&xd, &qd, &sd, nullptr); }
};

}  // namespace

TEST(QuantizeFp8Errors, Rows1x128DescriptorsNamed) {
  {
    Rows1x128 c;
    expect_rejected(megamoe_quantize_fp8_1x128(nullptr, &c.qd, &c.sd, nullptr),
                    "x: tensor descriptor is NULL");
    expect_rejected(megamoe_quantize_fp8_1x128(&c.xd, &c.qd, nullptr, nullptr),
                    "scales: tensor descriptor is NULL");
  }
  struct Case {
    std::function<void(Rows1x128&)> spoil;
    const char* message;
  };
  const Case cases[] = {
      {[](Rows1x128& c) { c.xd.dtype = MEGAMOE_DTYPE_FLOAT32; }, "x: expected dtype bfloat16"},
      {[](Rows1x128& c) { c.xd.shape[1] = 100; },
       "x: K (the last dimension) must be a positive multiple of 128"},
      {[](Rows1x128& c) { c.xd.strides[1] = 2, c.xd.strides[0] = 512; },
       "x: expected unit stride in the last dimension"},
      {[](Rows1x128& c) { c.xd.strides[0] = 260; },  // 520 bytes: rows not 16-byte aligned
       "multiples of 16 bytes"},
      {[](Rows1x128& c) { c.qd.shape[0] = 5; },
       "q: expected shape [M=4, K=256] (from x [4, 256]), got [5, 256]"},
      {[](Rows1x128& c) { c.qd.dtype = MEGAMOE_DTYPE_BFLOAT16; }, "q: expected dtype float8_e4m3"},
      {[](Rows1x128& c) { c.sd.shape[1] = 1; }, "scales: expected shape [M=4, K/128=2]"},
      {[](Rows1x128& c) { c.qd.strides[0] = 0; },  // every row on the same bytes
       "q: strides [0, 1] for shape [4, 256] make elements overlap"},
      {[](Rows1x128& c) { c.sd.data = c.qd.data; }, "overlaps"},  // scales inside q
  };
  for (const Case& k : cases) {
    Rows1x128 c;
    k.spoil(c);
    expect_rejected(c.call(), k.message);
  }
}

TEST(QuantizeFp8Errors, Tiles128x128DescriptorsNamed) {
  Tensor w(MEGAMOE_DTYPE_BFLOAT16, {2, 128, 256});
  Tensor q(MEGAMOE_DTYPE_FLOAT8_E4M3, {2, 128, 256});
  Tensor q_t(MEGAMOE_DTYPE_FLOAT8_E4M3, {2, 256, 128});
  Tensor s(MEGAMOE_DTYPE_FLOAT32, {2, 1, 2});
  megamoe_tensor wd = w.desc(), qd = q.desc(), td = q_t.desc(), sd = s.desc();
  expect_rejected(megamoe_quantize_fp8_128x128(&wd, nullptr, nullptr, &sd, nullptr),
                  "q, q_t: both are NULL");
  expect_rejected(megamoe_quantize_fp8_128x128(&wd, &td, nullptr, &sd, nullptr),
                  "q: expected shape [E=2, N=128, K=256]");
  expect_rejected(megamoe_quantize_fp8_128x128(&wd, nullptr, &qd, &sd, nullptr),
                  "q_t: expected shape [E=2, K=256, N=128]");
  megamoe_tensor bad = sd;
  bad.shape[2] = 1;
  expect_rejected(megamoe_quantize_fp8_128x128(&wd, &qd, &td, &bad, nullptr),
                  "scales: expected shape [E=2, N/128=1, K/128=2]");
  bad = wd;
  bad.shape[1] = 64;
  expect_rejected(megamoe_quantize_fp8_128x128(&bad, &qd, &td, &sd, nullptr),
                  "w: N (dimension 1) must be a positive multiple of 128");
  bad = wd;
  bad.ndim = 2;
  expect_rejected(megamoe_quantize_fp8_128x128(&bad, &qd, &td, &sd, nullptr),
                  "w: expected 3 dimensions [E, N, K]");
  megamoe_tensor alias = td;
  alias.data = qd.data;
  expect_rejected(megamoe_quantize_fp8_128x128(&wd, &qd, &alias, &sd, nullptr), "overlaps");
}

TEST(QuantizeFp8Errors, Columns128DescriptorsNamed) {
  Tensor x(MEGAMOE_DTYPE_BFLOAT16, {130, 128});
  Tensor q_t(MEGAMOE_DTYPE_FLOAT8_E4M3, {128, 256});
  Tensor s(MEGAMOE_DTYPE_FLOAT32, {128, 2});
  megamoe_tensor xd = x.desc(), td = q_t.desc(), sd = s.desc();
  megamoe_tensor bad = td;
  bad.shape[1] = 130;
  bad.strides[0] = 130;
  expect_rejected(megamoe_quantize_fp8_cols_128(&xd, &bad, &sd, nullptr),
                  "q_t: expected shape [C=128, Rp=256]");
  bad = sd;
  bad.shape[1] = 1;
  expect_rejected(megamoe_quantize_fp8_cols_128(&xd, &td, &bad, nullptr),
                  "scales: expected shape [C=128, Rp/128=2]");
  bad = xd;
  bad.shape[1] = 96;
  expect_rejected(megamoe_quantize_fp8_cols_128(&bad, &td, &sd, nullptr),
                  "x: C (the last dimension) must be a positive multiple of 128");
}

TEST(QuantizeFp8Errors, HostMemoryIsNotAccepted) {
  int32_t devices = 0;
  ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS);
  Rows1x128 c;
  const megamoe_status st = c.call();
  if (devices == 0) {
    // Without a GPU the pointer query itself fails: a CUDA error, not a crash.
    EXPECT_EQ(st, MEGAMOE_ERROR_CUDA) << megamoe_last_error();
    EXPECT_TRUE(contains(megamoe_last_error(), "cudaPointerGetAttributes(x) failed"))
        << megamoe_last_error();
  } else {
    EXPECT_EQ(st, MEGAMOE_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(megamoe_last_error(), "x: expected CUDA device memory"))
        << megamoe_last_error();
  }
}

// ---------------------------------------------------------------------------------------
// Rows quantized into the sorted rows of a routing plan (quantize_fp8_to_rows).

namespace {

constexpr uint8_t kPoisonByte = 0x5A;         // a finite e4m3 value, unlike what is written
constexpr uint32_t kPoisonScale = 0x7b7b7b7bu;

// A routing of T tokens to k experts each: the plan's slot_row (stable sort of the valid
// slots by expert) and row_token, as build_routing_plan gives them (tests/cpp/
// test_routing_plan.cpp checks that kernel against the same sort).
struct SortedRows {
  std::vector<int32_t> slot_row, row_token;
  int64_t used = 0;  // valid slots: rows [0, used) are written
};
SortedRows sort_slots(const std::vector<int32_t>& ids, int64_t k, int64_t E) {
  std::vector<int32_t> valid;
  for (size_t s = 0; s < ids.size(); ++s) {
    if (ids[s] >= 0 && ids[s] < E) valid.push_back(static_cast<int32_t>(s));
  }
  std::stable_sort(valid.begin(), valid.end(),
                   [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  SortedRows r;
  r.slot_row.assign(ids.size(), -1);
  r.row_token.assign(ids.size(), -1);
  r.used = static_cast<int64_t>(valid.size());
  for (size_t row = 0; row < valid.size(); ++row) {
    r.slot_row[valid[row]] = static_cast<int32_t>(row);
    r.row_token[row] = static_cast<int32_t>(valid[row] / k);
  }
  return r;
}

// bf16 bits of a token matrix whose 1x128 blocks span many magnitudes, with all-zero,
// NaN and Inf blocks among them.
std::vector<uint16_t> awkward_tokens(int64_t T, int64_t H, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-30, 30), kind(0, 15);
  std::vector<uint16_t> x(T * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < H / 128; ++b) {
      const int what = kind(rng);
      const double magnitude = std::ldexp(1.0, exponent(rng));
      for (int64_t c = 0; c < 128; ++c) {
        uint16_t& v = x[t * H + b * 128 + c];
        v = what == 0 ? 0 : bf16_bits(normal(rng) * magnitude);
      }
      if (what == 1) x[t * H + b * 128 + 7] = 0x7FC0;  // NaN
      if (what == 2) x[t * H + b * 128 + 100] = 0xFF80;  // -Inf
    }
  }
  return x;
}

class QuantizeFp8SortedRows : public GpuTest {
 protected:
  // Quantizes T tokens of H columns routed by `ids` ([T, k], -1 drops a slot) straight into
  // the sorted rows, and into a token matrix whose rows are then gathered on the host:
  // every byte of the sorted copy and its scales, poisoned beforehand, must be the
  // gathered one's, and the rows past the valid ones (and the scales' pad columns) poison.
  // The same for the token matrix copied into the sorted rows (copy_fp8_to_rows, k <= 32).
  void check(int64_t T, int64_t k, int64_t H, int64_t E, const std::vector<int32_t>& ids,
             uint64_t seed) {
    SEEDED(seed);
    SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) + " H=" +
                 std::to_string(H) + " E=" + std::to_string(E));
    std::mt19937_64 rng(seed);
    const SortedRows sorted = sort_slots(ids, k, E);
    const int64_t rows = T * k, blocks = H / 128;
    const int64_t ld_tokens = (T + 3) / 4 * 4, ld_rows = (rows + 3) / 4 * 4 + 4;
    const std::vector<uint16_t> x = awkward_tokens(T, H, rng);
    const auto* x_d = reinterpret_cast<const __nv_bfloat16*>(upload(x));
    const int32_t* slot_row_d = upload(sorted.slot_row);

    megamoe::Fp8QuantizeArgs a;
    a.x = x_d;
    a.x_row = H;
    a.rows = T;
    a.cols = H;
    a.q_row = H;
    a.s_0 = 1;

    uint8_t* token_q = alloc<uint8_t>(T * H);
    float* token_s = alloc<float>(blocks * ld_tokens);
    megamoe::Fp8QuantizeArgs plain = a;
    plain.q = token_q;
    plain.scales = token_s;
    plain.s_1 = ld_tokens;
    megamoe::quantize_fp8(megamoe::Fp8Blocks::kRows1x128, plain, stream_);

    uint8_t* q = alloc<uint8_t>(rows * H);
    float* s = alloc<float>(blocks * ld_rows);
    CUDA_OK(cudaMemset(q, kPoisonByte, rows * H));
    CUDA_OK(cudaMemset(s, 0x7b, blocks * ld_rows * sizeof(float)));
    megamoe::Fp8QuantizeArgs to_rows = a;
    to_rows.q = q;
    to_rows.scales = s;
    to_rows.s_1 = ld_rows;
    megamoe::quantize_fp8_to_rows(to_rows, {slot_row_d, k}, stream_);

    const std::vector<uint8_t> tq = download(token_q, T * H);
    const std::vector<float> ts = download(token_s, blocks * ld_tokens);
    std::vector<uint8_t> want_q(rows * H, kPoisonByte);
    std::vector<uint32_t> want_s(blocks * ld_rows, kPoisonScale);
    for (int64_t r = 0; r < sorted.used; ++r) {
      const int64_t t = sorted.row_token[r];
      std::copy_n(tq.begin() + t * H, H, want_q.begin() + r * H);
      for (int64_t j = 0; j < blocks; ++j) {
        std::memcpy(&want_s[j * ld_rows + r], &ts[j * ld_tokens + t], 4);
      }
    }
    const auto compare = [&](const uint8_t* q_d, const float* s_d) {
      const std::vector<uint8_t> got_q = download(q_d, rows * H);
      const std::vector<float> got_s = download(s_d, blocks * ld_rows);
      int64_t bad_q = 0, bad_s = 0;
      for (int64_t i = 0; i < rows * H; ++i) {
        if (got_q[i] != want_q[i] && bad_q++ < 5) {
          ADD_FAILURE() << "q row " << i / H << " column " << i % H << ": "
                        << int(got_q[i]) << ", expected " << int(want_q[i]);
        }
      }
      for (int64_t i = 0; i < blocks * ld_rows; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &got_s[i], 4);
        if (bits != want_s[i] && bad_s++ < 5) {
          ADD_FAILURE() << "scale of row " << i % ld_rows << " block " << i / ld_rows << ": "
                        << std::hex << bits << ", expected " << want_s[i];
        }
      }
      EXPECT_EQ(bad_q, 0);
      EXPECT_EQ(bad_s, 0);
    };
    {
      SCOPED_TRACE("quantize_fp8_to_rows");
      compare(q, s);
    }
    {
      // The scales written once per token into a poisoned scratch and then moved to the rows
      // by the plan's inverse (row_token): the same bytes.
      SCOPED_TRACE("quantize_fp8_to_rows with dests.sources");
      CUDA_OK(cudaMemset(q, kPoisonByte, rows * H));
      CUDA_OK(cudaMemset(s, 0x7b, blocks * ld_rows * sizeof(float)));
      float* row_scales = alloc<float>(T * blocks);
      CUDA_OK(cudaMemset(row_scales, 0x7b, T * blocks * sizeof(float)));
      megamoe::Fp8RowDests by_source{slot_row_d, k};
      by_source.sources = upload(sorted.row_token);
      by_source.dest_rows = rows;
      by_source.row_scales = row_scales;
      megamoe::quantize_fp8_to_rows(to_rows, by_source, stream_);
      compare(q, s);
    }
    if (k > 32) return;
    SCOPED_TRACE("copy_fp8_to_rows");
    CUDA_OK(cudaMemset(q, kPoisonByte, rows * H));
    CUDA_OK(cudaMemset(s, 0x7b, blocks * ld_rows * sizeof(float)));
    megamoe::Fp8RowsCopyArgs copy;
    copy.q = token_q;
    copy.scales = token_s;
    copy.scale_ld = ld_tokens;
    copy.rows = T;
    copy.cols = H;
    copy.out_q = q;
    copy.out_scales = s;
    copy.out_scale_ld = ld_rows;
    megamoe::copy_fp8_to_rows(copy, {slot_row_d, k}, stream_);
    compare(q, s);
  }
};

// ids [T, k] uniformly over the experts but `empty` (which gets no slot), every
// `drop_every`-th slot -1 (0: none).
std::vector<int32_t> random_ids(int64_t T, int64_t k, int64_t E, int64_t empty,
                                int64_t drop_every, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> expert(0, static_cast<int32_t>(E - 1));
  std::vector<int32_t> ids(T * k);
  for (int64_t s = 0; s < T * k; ++s) {
    int32_t e;
    do e = expert(rng); while (e == empty);
    ids[s] = drop_every > 0 && s % drop_every == 3 ? -1 : e;
  }
  return ids;
}

// Routings for the quantizers that write or read rows through a routing plan: random ids
// over E experts but `empty`, every `drop_every`-th slot dropped (0: none).
struct RoutingCase {
  int64_t T, k, H, E, empty, drop_every;
};
std::vector<RoutingCase> routing_cases() {
  return {
      {300, 8, 256, 16, 5, 0},    // tokens not a multiple of 128, an expert without rows
      {300, 8, 256, 16, -1, 7},   // dropped slots: the last sorted rows stay unwritten
      {1, 1, 128, 4, -1, 0},      // one token, k = 1
      {130, 1, 384, 8, 0, 0},     // k = 1, expert 0 empty
      {257, 3, 128, 2, 1, 5},     // every row into one expert, some dropped
      {64, 4, 2048, 128, 7, 0},   // qwen3's H and E, few tokens
      {100, 2, 5120, 8, -1, 3},   // 40 blocks a row: more than one batch of 32 scales
  };
}

}  // namespace

TEST_F(QuantizeFp8SortedRows, EqualsQuantizeThenGather) {
  for (const RoutingCase& c : routing_cases()) {
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    check(c.T, c.k, c.H, c.E, random_ids(c.T, c.k, c.E, c.empty, c.drop_every, rng), seed);
  }
  // A token routed twice to the same expert (the plan allows it): both rows written.
  check(3, 2, 128, 2, {1, 1, 0, 1, -1, -1}, fresh_seed());
  // More destinations per row than a half-warp has lanes (entries 16 on read as used).
  for (const int64_t k : {16, 17, 40}) {
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    check(70, k, 256, 64, random_ids(70, k, 64, 3, 9, rng), seed);
  }
}

// The kernel's CTAs loop over the tiles (a grid of a few CTAs per SM, each loading the next
// tile before it stores the current one): on a grid capped to 1 and 3 SMs each CTA takes
// many tiles, the loop's last ones and a tile count that no CTA count divides among them.
TEST_F(QuantizeFp8SortedRows, EqualsQuantizeThenGatherOnFewCtas) {
  for (const int sms : {1, 3}) {
    SCOPED_TRACE("SmLimit " + std::to_string(sms));
    const megamoe::SmLimit limit(sms);
    for (const RoutingCase& c : routing_cases()) {
      const uint64_t seed = fresh_seed();
      std::mt19937_64 rng(seed);
      check(c.T, c.k, c.H, c.E, random_ids(c.T, c.k, c.E, c.empty, c.drop_every, rng), seed);
    }
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    check(300, 20, 384, 32, random_ids(300, 20, 32, 4, 11, rng), seed);  // k > 16
  }
}

TEST(QuantizeFp8SortedRowsErrors, NeedsDestinations) {
  megamoe::Fp8QuantizeArgs a;
  a.rows = 128;
  a.cols = 128;
  int32_t dest = 0;  // never read: the checks throw first
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, {&dest, 0}, nullptr); },
                 "dests.per_row must be at least 1");
  a.cols = 100;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, {&dest, 2}, nullptr); },
                 "cols must be a positive multiple of 128");
  a.cols = 128;
  alignas(16) uint16_t x[8] = {};
  a.x = reinterpret_cast<const __nv_bfloat16*>(x);
  a.scales = reinterpret_cast<float*>(x);
  a.q = reinterpret_cast<uint8_t*>(x);
  a.q_row = 136;  // q's rows are used even for one row of x: a stride of 16 bytes
  a.rows = 1;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, {&dest, 2}, nullptr); },
                 "multiples of 16 bytes");
  a.q_row = 128;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, {nullptr, 2}, nullptr); },
                 "null dests.rows");
  // The scales by source: both pointers, the [block][row] layout, one batch, aligned scratch.
  a.s_0 = 1;
  megamoe::Fp8RowDests by_source{&dest, 2};
  by_source.sources = &dest;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "dests.sources and dests.row_scales go together");
  alignas(16) float scratch[8] = {};
  by_source.row_scales = scratch;
  by_source.dest_rows = -1;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "negative dests.dest_rows");
  by_source.dest_rows = 2;
  a.cols = 256;  // two blocks a row, s_1 = 0: the blocks' scales of the 2 rows would overlap
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "dests.dest_rows must be at most s_1");
  a.cols = 128;
  by_source.row_scales = scratch + 1;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "dests.row_scales must be 16-byte aligned");
  by_source.row_scales = scratch;
  a.s_0 = 2;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "needs scales [block][row] (s_0 = 1) and one batch");
  a.s_0 = 1;
  a.batches = 2;
  expect_invalid([&] { megamoe::quantize_fp8_to_rows(a, by_source, nullptr); },
                 "needs scales [block][row] (s_0 = 1) and one batch");
}

TEST(CopyFp8ToRowsErrors, ArgumentsNamed) {
  megamoe::Fp8RowsCopyArgs a;
  a.rows = 4;
  a.cols = 128;
  int32_t dest = 0;  // never read: the checks throw first
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 0}, nullptr); },
                 "dests.per_row must be in [1, 32]");
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 33}, nullptr); },
                 "dests.per_row must be in [1, 32]");
  a.cols = 100;
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 2}, nullptr); },
                 "cols must be a positive multiple of 128");
  a.cols = 128;
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 2}, nullptr); }, "null pointer");
  alignas(16) uint8_t bytes[32] = {};
  float scales[4] = {};
  a.q = bytes + 1;
  a.out_q = bytes;
  a.scales = scales;
  a.out_scales = scales;
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 2}, nullptr); }, "16-byte aligned");
  a.q = bytes;
  a.scale_ld = 3;
  expect_invalid([&] { megamoe::copy_fp8_to_rows(a, {&dest, 2}, nullptr); },
                 "scale_ld must be at least rows");
}

// ---------------------------------------------------------------------------------------
// Columns of the padded rows quantized straight from the token matrix
// (quantize_fp8_columns_gathered).

namespace {

class QuantizeFp8GatheredColumns : public GpuTest {
 protected:
  // The blocks of both quantizations: kColumns128, or kColumnTiles128.
  megamoe::Fp8Blocks blocks_ = megamoe::Fp8Blocks::kColumns128;

  // T tokens of H columns routed by `ids` ([T, k], -1 drops a slot) through a routing plan
  // (build_routing_plan, block_m 128); with `weighted`, each row scaled by its slot's
  // weight. gather_rows_padded into a NaN-poisoned bf16 buffer and quantize_fp8
  // (kColumns128) of it, against quantize_fp8_columns_gathered into poisoned outputs: every
  // byte of q_t and every scale of the used row blocks (below tile_offsets[E]) equal, and
  // the rest of both still poison.
  void check(int64_t T, int64_t k, int64_t H, int64_t E, const std::vector<int32_t>& ids,
             bool weighted, uint64_t seed) {
    SEEDED(seed);
    SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) + " H=" +
                 std::to_string(H) + " E=" + std::to_string(E) +
                 (weighted ? " weighted" : " unweighted"));
    std::mt19937_64 rng(seed);
    const int64_t n = T * k, padded = megamoe::padded_rows_bound(n, E);
    const int64_t blocks = padded / 128;
    const std::vector<uint16_t> x = awkward_tokens(T, H, rng);
    std::vector<float> w(n);
    std::uniform_real_distribution<float> wdist(0.0f, 1.0f);
    std::uniform_int_distribution<int> kind(0, 15);
    for (float& v : w) {
      const int what = kind(rng);
      v = what == 0 ? 0.0f : what == 1 ? 1e30f : what == 2 ? 1e-30f : what == 3 ? -2.5f
                                                                              : wdist(rng);
    }
    const auto* x_d = reinterpret_cast<const __nv_bfloat16*>(upload(x));
    const float* w_d = weighted ? upload(w) : nullptr;
    const int32_t* ids_d = upload(ids);
    const megamoe::RoutingPlan plan{alloc<int32_t>(E), alloc<int32_t>(E + 1),
                                    alloc<int32_t>(E + 1), alloc<int32_t>(n),
                                    alloc<int32_t>(n), alloc<int32_t>(n), alloc<int32_t>(1)};
    void* scratch = alloc<char>(static_cast<int64_t>(megamoe::routing_plan_scratch_bytes(n, E)));
    ASSERT_FALSE(HasFailure());
    megamoe::build_routing_plan(ids_d, false, T, k, E, 128, plan, scratch, stream_);
    const int64_t used = download(plan.tile_offsets + E, 1)[0];
    ASSERT_LE(used, blocks);

    megamoe::Fp8QuantizeArgs a;
    a.rows = padded;
    a.cols = H;
    a.t_row = padded;
    a.s_0 = 1;
    a.s_1 = H;
    const auto poisoned = [&](uint8_t*& q, float*& s) {
      q = alloc<uint8_t>(H * padded);
      s = alloc<float>(blocks * H);
      CUDA_OK(cudaMemset(q, kPoisonByte, H * padded));
      CUDA_OK(cudaMemset(s, 0x7b, blocks * H * sizeof(float)));
    };

    auto* rows = alloc<__nv_bfloat16>(padded * H);
    CUDA_OK(cudaMemset(rows, 0xFF, padded * H * sizeof(uint16_t)));  // NaN past the used rows
    megamoe::gather_rows_padded(x_d, H, plan, E, w_d, padded, rows, stream_);
    megamoe::Fp8QuantizeArgs unfused = a;
    unfused.x = rows;
    unfused.x_row = H;
    poisoned(unfused.q_t, unfused.scales);
    megamoe::quantize_fp8(blocks_, unfused, stream_);

    megamoe::Fp8QuantizeArgs fused = a;
    fused.x = x_d;
    fused.x_row = H;
    poisoned(fused.q_t, fused.scales);
    megamoe::Fp8PaddedSource src;
    src.expert_offsets = plan.expert_offsets;
    src.tile_offsets = plan.tile_offsets;
    src.row_token = plan.row_token;
    src.row_slot = plan.row_slot;
    src.slot_weights = w_d;
    src.num_experts = E;
    megamoe::quantize_fp8_columns_gathered(fused, src, stream_, blocks_);

    const std::vector<uint8_t> want_q = download(unfused.q_t, H * padded),
                               got_q = download(fused.q_t, H * padded);
    const std::vector<float> want_s = download(unfused.scales, blocks * H),
                             got_s = download(fused.scales, blocks * H);
    int64_t bad_q = 0, bad_s = 0;
    for (int64_t c = 0; c < H; ++c) {
      for (int64_t p = 0; p < padded; ++p) {
        const int64_t i = c * padded + p;
        const uint8_t want = p < used * 128 ? want_q[i] : kPoisonByte;
        if (got_q[i] != want && bad_q++ < 5) {
          ADD_FAILURE() << "q_t column " << c << " padded row " << p << ": " << int(got_q[i])
                        << ", expected " << int(want);
        }
      }
    }
    for (int64_t j = 0; j < blocks; ++j) {
      for (int64_t c = 0; c < H; ++c) {
        uint32_t got, want = kPoisonScale;
        std::memcpy(&got, &got_s[j * H + c], 4);
        if (j < used) std::memcpy(&want, &want_s[j * H + c], 4);
        if (got != want && bad_s++ < 5) {
          ADD_FAILURE() << "scale of column " << c << " row block " << j << ": " << std::hex
                        << got << ", expected " << want;
        }
      }
    }
    EXPECT_EQ(bad_q, 0);
    EXPECT_EQ(bad_s, 0);
  }

  // check() on random routings of each case, without and with slot weights.
  void check_cases(const std::vector<RoutingCase>& cases) {
    for (const RoutingCase& c : cases) {
      for (const bool weighted : {false, true}) {
        const uint64_t seed = fresh_seed();
        std::mt19937_64 rng(seed);
        check(c.T, c.k, c.H, c.E, random_ids(c.T, c.k, c.E, c.empty, c.drop_every, rng),
              weighted, seed);
      }
    }
  }
};

}  // namespace

TEST_F(QuantizeFp8GatheredColumns, EqualsGatherThenQuantize) {
  std::vector<RoutingCase> cases = routing_cases();
  cases.push_back({1000, 2, 128, 1, -1, 0});  // one expert: 2000 rows, 16 tiles, the last partial
  check_cases(cases);
  // A token routed twice to the same expert; every slot dropped (no used tile at all).
  check(3, 2, 128, 2, {1, 1, 0, 1, -1, -1}, true, fresh_seed());
  check(4, 2, 256, 3, std::vector<int32_t>(8, -1), true, fresh_seed());
}

// As QuantizeFp8SortedRows.EqualsQuantizeThenGatherOnFewCtas: each CTA loops over many
// tiles (its index loads two tiles ahead, its values one), with tiles past tile_offsets[E].
TEST_F(QuantizeFp8GatheredColumns, EqualsGatherThenQuantizeOnFewCtas) {
  std::vector<RoutingCase> cases = routing_cases();
  cases.push_back({1000, 2, 384, 1, -1, 0});  // one expert, 16 row tiles x 3 column tiles
  cases.push_back({700, 8, 512, 128, 9, 5});  // many experts, most with a partial tile
  for (const int sms : {1, 3}) {
    SCOPED_TRACE("SmLimit " + std::to_string(sms));
    const megamoe::SmLimit limit(sms);
    check_cases(cases);
    check(4, 2, 256, 3, std::vector<int32_t>(8, -1), true, fresh_seed());
  }
}

// The same in 128 x 128 tiles (kColumnTiles128, the weight gradients' opt-in activation
// operand): one scale per tile, at each of its columns' places.
TEST_F(QuantizeFp8GatheredColumns, InTilesEqualsGatherThenQuantize) {
  blocks_ = megamoe::Fp8Blocks::kColumnTiles128;
  std::vector<RoutingCase> cases = routing_cases();
  cases.push_back({1000, 2, 384, 1, -1, 0});
  check_cases(cases);
  check(3, 2, 128, 2, {1, 1, 0, 1, -1, -1}, true, fresh_seed());
  for (const int sms : {1, 3}) {
    SCOPED_TRACE("SmLimit " + std::to_string(sms));
    const megamoe::SmLimit limit(sms);
    check_cases({{700, 8, 512, 128, 9, 5}});
  }
}

TEST(QuantizeFp8GatheredColumnsErrors, ArgumentsNamed) {
  alignas(16) static int32_t offsets[8] = {};
  alignas(16) static uint16_t x[8] = {};
  const auto good = [] {
    megamoe::Fp8QuantizeArgs a;
    a.x = reinterpret_cast<const __nv_bfloat16*>(x);
    a.x_row = 128;
    a.rows = 256;
    a.cols = 128;
    a.q_t = reinterpret_cast<uint8_t*>(x);
    a.t_row = 256;
    a.scales = reinterpret_cast<float*>(x);
    a.s_0 = 1;
    a.s_1 = 128;
    return a;
  };
  megamoe::Fp8PaddedSource src;
  src.expert_offsets = offsets;
  src.tile_offsets = offsets;
  src.row_token = offsets;
  src.num_experts = 2;
  // Every call below throws before any device work.
  const auto call = [&](const megamoe::Fp8QuantizeArgs& a, const megamoe::Fp8PaddedSource& s) {
    return [a, s] { megamoe::quantize_fp8_columns_gathered(a, s, nullptr); };
  };
  megamoe::Fp8QuantizeArgs a = good();
  a.batches = 2;
  expect_invalid(call(a, src), "one matrix (batches = 1)");
  megamoe::Fp8PaddedSource s = src;
  s.num_experts = 0;
  expect_invalid(call(good(), s), "src.num_experts must be in [1, 2^31)");
  a = good();
  a.cols = 100;
  expect_invalid(call(a, src), "cols must be a positive multiple of 128");
  a = good();
  a.q = reinterpret_cast<uint8_t*>(x);
  expect_invalid(call(a, src), "needs q_t and no q");
  a = good();
  a.x_row = 132;  // 264 bytes
  expect_invalid(call(a, src), "multiples of 16 bytes");
  a = good();
  a.rows = 1;  // one padded row: the token stride is still used
  a.x_row = 4;
  expect_invalid(call(a, src), "multiples of 16 bytes");
  s = src;
  s.row_token = nullptr;
  expect_invalid(call(good(), s), "null routing plan pointer");
  s = src;
  s.slot_weights = reinterpret_cast<const float*>(x);  // weights without row_slot
  expect_invalid(call(good(), s), "null routing plan pointer");
}

// ---------------------------------------------------------------------------------------
// One matrix quantized into 1x128 rows and 128-row columns in one pass
// (quantize_fp8_rows_and_columns), as the FP8 backward quantizes dh.

namespace {

// A bf16 matrix [batches][rows][x_row] laid out as the backward's dh: `groups` of rows
// (an expert's), each padded with zero rows to a multiple of 128 (none for an empty
// group), then `tail` rows past the groups (the padded rows the plan does not use, which
// the quantizers read as they are). Columns cols..x_row-1 are never read.
struct RowsColumnsCase {
  int64_t batches;
  std::vector<int64_t> groups;
  int64_t tail, cols, x_row;
};

int64_t case_rows(const RowsColumnsCase& c) {
  int64_t rows = c.tail;
  for (const int64_t n : c.groups) rows += (n + 127) / 128 * 128;
  return rows;
}

// Each 128 x 128 tile of one of a few kinds that the two block shapes see differently:
// all zeros; zeros and one value of bf16's largest magnitude; one NaN or one Inf in
// normal values; bf16 subnormals only; and normal values whose magnitude changes from
// row to row (so that a column block spans magnitudes a 1x128 block does not).
std::vector<uint16_t> awkward_matrix(const RowsColumnsCase& c, std::mt19937_64& rng) {
  const int64_t rows = case_rows(c);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-30, 30), kind(0, 7), row_of(0, 127),
      col_of(0, 127), subnormal(1, 0x7F), sign(0, 1);
  std::vector<uint16_t> x(c.batches * rows * c.x_row, 0);
  for (int64_t b = 0; b < c.batches; ++b) {
    for (int64_t r0 = 0; r0 < rows; r0 += 128) {
      for (int64_t c0 = 0; c0 < c.cols; c0 += 128) {
        const int what = kind(rng);
        const int64_t one_r = r0 + row_of(rng), one_c = c0 + col_of(rng);
        for (int64_t r = r0; r < std::min(rows, r0 + 128); ++r) {
          const double magnitude = std::ldexp(1.0, exponent(rng));
          for (int64_t col = c0; col < c0 + 128; ++col) {
            uint16_t v = 0;
            if (what == 2 || what == 3 || what >= 5) v = bf16_bits(normal(rng) * magnitude);
            if (what == 4) v = static_cast<uint16_t>(subnormal(rng) | sign(rng) << 15);
            if (r == one_r && col == one_c) {
              if (what == 1) v = sign(rng) ? 0xFF7F : 0x7F7F;  // -+3.39e38
              if (what == 2) v = 0x7FC0;                        // NaN
              if (what == 3) v = sign(rng) ? 0xFF80 : 0x7F80;  // -+Inf
            }
            x[(b * rows + r) * c.x_row + col] = v;
          }
        }
      }
    }
    // The groups' pad rows are zeros (as the dgrad writes dh).
    int64_t r0 = 0;
    for (const int64_t n : c.groups) {
      const int64_t padded = (n + 127) / 128 * 128;
      for (int64_t r = r0 + n; r < r0 + padded; ++r) {
        std::fill_n(x.begin() + (b * rows + r) * c.x_row, c.x_row, uint16_t{0});
      }
      r0 += padded;
    }
  }
  return x;
}

class QuantizeFp8RowsAndColumns : public GpuTest {
 protected:
  // quantize_fp8(kRows1x128) and quantize_fp8(kColumns128) of the case's matrix, each into
  // poisoned outputs, against quantize_fp8_rows_and_columns into outputs poisoned the same
  // way: every byte of both value copies and both scale arrays equal, pad bytes (strides
  // wider than the rows, the scales' pad columns, rows past `rows`) included.
  void check(const RowsColumnsCase& c, uint64_t seed) {
    SEEDED(seed);
    const int64_t rows = case_rows(c), B = c.batches, C = c.cols, blocks = C / 128;
    const int64_t padded = (rows + 127) / 128 * 128;
    SCOPED_TRACE("batches=" + std::to_string(B) + " rows=" + std::to_string(rows) +
                 " cols=" + std::to_string(C) + " x_row=" + std::to_string(c.x_row) +
                 " groups=" + std::to_string(c.groups.size()));
    std::mt19937_64 rng(seed);
    const std::vector<uint16_t> x = awkward_matrix(c, rng);
    const auto* x_d = reinterpret_cast<const __nv_bfloat16*>(upload(x));

    // Rows: [b][rows][q_row] with q_row past cols, scales [b][blocks][ld].
    const int64_t q_row = C + 16, ld = (rows + 3) / 4 * 4 + 4;
    const int64_t q_bytes = B * std::max<int64_t>(rows, 1) * q_row, s_rows = B * blocks * ld;
    // Columns: [b][cols][t_row] with t_row past the padded rows, scales [b][padded/128][C].
    const int64_t t_row = padded + 16;
    const int64_t t_bytes = B * C * t_row, s_cols = B * (padded / 128) * C + 4;

    struct Outputs {
      uint8_t *q, *q_t;
      float *s_rows, *s_cols;
    };
    const auto poisoned = [&](Outputs& o) {
      o = {alloc<uint8_t>(q_bytes), alloc<uint8_t>(t_bytes), alloc<float>(s_rows),
           alloc<float>(s_cols)};
      CUDA_OK(cudaMemset(o.q, kPoisonByte, q_bytes));
      CUDA_OK(cudaMemset(o.q_t, kPoisonByte, t_bytes));
      CUDA_OK(cudaMemset(o.s_rows, 0x7b, s_rows * sizeof(float)));
      CUDA_OK(cudaMemset(o.s_cols, 0x7b, s_cols * sizeof(float)));
    };
    const auto args = [&](const Outputs& o) {
      megamoe::Fp8QuantizeArgs a;
      a.x = x_d;
      a.x_row = c.x_row;
      a.x_batch = rows * c.x_row;
      a.batches = B;
      a.rows = rows;
      a.cols = C;
      megamoe::Fp8QuantizeArgs r = a, t = a;
      r.q = o.q;
      r.q_row = q_row;
      r.q_batch = rows * q_row;
      r.scales = o.s_rows;
      r.s_batch = blocks * ld;
      r.s_0 = 1;
      r.s_1 = ld;
      t.q_t = o.q_t;
      t.t_row = t_row;
      t.t_batch = C * t_row;
      t.scales = o.s_cols;
      t.s_batch = padded / 128 * C;
      t.s_0 = 1;
      t.s_1 = C;
      return std::pair{r, t};
    };
    Outputs separate, fused;
    poisoned(separate);
    poisoned(fused);
    ASSERT_FALSE(HasFailure());
    const auto [sep_rows, sep_cols] = args(separate);
    megamoe::quantize_fp8(megamoe::Fp8Blocks::kRows1x128, sep_rows, stream_);
    megamoe::quantize_fp8(megamoe::Fp8Blocks::kColumns128, sep_cols, stream_);
    const auto [fused_rows, fused_cols] = args(fused);
    megamoe::quantize_fp8_rows_and_columns(fused_rows, fused_cols, stream_);

    const auto compare = [&](const char* what, const auto* want_d, const auto* got_d,
                             int64_t n) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(want_d)>>;
      const std::vector<T> want = download(want_d, n), got = download(got_d, n);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0 && bad++ < 5) {
          uint32_t w = 0, g = 0;
          std::memcpy(&w, &want[i], sizeof(T));
          std::memcpy(&g, &got[i], sizeof(T));
          ADD_FAILURE() << what << " element " << i << ": " << std::hex << g << ", expected "
                        << w;
        }
      }
      EXPECT_EQ(bad, 0) << what;
    };
    compare("rows' q", separate.q, fused.q, q_bytes);
    compare("rows' scales", separate.s_rows, fused.s_rows, s_rows);
    compare("columns' q_t", separate.q_t, fused.q_t, t_bytes);
    compare("columns' scales", separate.s_cols, fused.s_cols, s_cols);
  }

  void check_cases(const std::vector<RowsColumnsCase>& cases) {
    for (const RowsColumnsCase& c : cases) check(c, fresh_seed());
  }
};

std::vector<RowsColumnsCase> rows_columns_cases() {
  return {
      {1, {}, 300, 128, 128},     // rows not a multiple of 128
      {1, {}, 1, 256, 264},       // one row; x's rows wider than its columns
      {1, {}, 127, 384, 384},
      {1, {}, 129, 128, 136},
      {1, {0, 1, 127, 128, 129, 0, 0, 300}, 0, 256, 256},  // empty groups, dh's padded layout
      {1, {5, 0, 200}, 77, 384, 384},  // groups, then rows past them
      {2, {}, 200, 256, 264},     // two matrices
      {3, {130, 0}, 0, 128, 128},
      {1, {}, 0, 256, 256},       // no rows: nothing written
      {1, {}, 1000, 1536, 1536},  // qwen3-30b-a3b's 2I: 8 x 12 tiles
  };
}

}  // namespace

TEST_F(QuantizeFp8RowsAndColumns, EqualsTheSeparateQuantizers) {
  check_cases(rows_columns_cases());
}

// The kernel's CTAs loop over the tiles (each loads the next tile before it quantizes the
// current one, and the columns reuse shared memory from tile to tile): on 1 and 3 SMs each
// CTA takes many tiles, and the last CTAs fewer than the others.
TEST_F(QuantizeFp8RowsAndColumns, EqualsTheSeparateQuantizersOnFewCtas) {
  std::vector<RowsColumnsCase> cases = rows_columns_cases();
  cases.push_back({1, {}, 2000, 2048, 2048});  // 16 x 16 tiles
  for (const int sms : {1, 3}) {
    SCOPED_TRACE("SmLimit " + std::to_string(sms));
    const megamoe::SmLimit limit(sms);
    check_cases(cases);
  }
}

// kColumnTiles128 against kTiles128's transposed copy of the same matrix (kTiles128's bits
// are checked against the reference quantizer in tests/python/test_fp8_kernels.py): every
// byte of q_t equal, and each column's scale of a row block the bits of its tile's scale;
// outputs poisoned beforehand. The awkward tiles of awkward_matrix: all zeros, one value
// of bf16's largest magnitude, a NaN or an Inf, subnormals only, magnitudes changing by row.
class QuantizeFp8ColumnTiles : public GpuTest {};

TEST_F(QuantizeFp8ColumnTiles, EqualsTilesTransposed) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {128, 128}, {256, 384}, {1024, 256}, {2048, 1536}}) {
    const uint64_t seed = fresh_seed();
    SEEDED(seed);
    SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
    std::mt19937_64 rng(seed);
    const RowsColumnsCase c{1, {}, rows, cols, cols};
    const std::vector<uint16_t> x = awkward_matrix(c, rng);
    const int64_t row_blocks = rows / 128, col_blocks = cols / 128;
    megamoe::Fp8QuantizeArgs a;
    a.x = reinterpret_cast<const __nv_bfloat16*>(upload(x));
    a.x_row = cols;
    a.rows = rows;
    a.cols = cols;
    a.t_row = rows;
    const auto poisoned = [&](megamoe::Fp8QuantizeArgs& q, int64_t scales) {
      q.q_t = alloc<uint8_t>(rows * cols);
      q.scales = alloc<float>(scales);
      CUDA_OK(cudaMemset(q.q_t, kPoisonByte, rows * cols));
      CUDA_OK(cudaMemset(q.scales, 0x7b, scales * sizeof(float)));
    };
    megamoe::Fp8QuantizeArgs tiles = a;  // scale of tile (i, j) at i * col_blocks + j
    tiles.s_0 = col_blocks;
    tiles.s_1 = 1;
    poisoned(tiles, row_blocks * col_blocks);
    megamoe::Fp8QuantizeArgs column_tiles = a;  // of (column c, row block i) at i * cols + c
    column_tiles.s_0 = 1;
    column_tiles.s_1 = cols;
    poisoned(column_tiles, row_blocks * cols);
    ASSERT_FALSE(HasFailure());
    megamoe::quantize_fp8(megamoe::Fp8Blocks::kTiles128, tiles, stream_);
    megamoe::quantize_fp8(megamoe::Fp8Blocks::kColumnTiles128, column_tiles, stream_);
    EXPECT_EQ(download(column_tiles.q_t, rows * cols), download(tiles.q_t, rows * cols));
    const std::vector<float> want = download(tiles.scales, row_blocks * col_blocks),
                             got = download(column_tiles.scales, row_blocks * cols);
    int64_t bad = 0;
    for (int64_t i = 0; i < row_blocks; ++i) {
      for (int64_t col = 0; col < cols; ++col) {
        uint32_t g, w;
        std::memcpy(&g, &got[i * cols + col], 4);
        std::memcpy(&w, &want[i * col_blocks + col / 128], 4);
        if (g != w && bad++ < 5) {
          ADD_FAILURE() << "scale of column " << col << " row block " << i << ": " << std::hex
                        << g << ", expected " << w;
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(QuantizeFp8RowsAndColumnsErrors, ArgumentsNamed) {
  alignas(16) static uint16_t x[8] = {};
  alignas(16) static uint16_t y[8] = {};
  const auto good = [] {
    megamoe::Fp8QuantizeArgs r;
    r.x = reinterpret_cast<const __nv_bfloat16*>(x);
    r.x_row = 128;
    r.rows = 256;
    r.cols = 128;
    r.scales = reinterpret_cast<float*>(x);
    r.s_0 = 1;
    r.s_1 = 256;
    megamoe::Fp8QuantizeArgs t = r;
    r.q = reinterpret_cast<uint8_t*>(x);
    r.q_row = 128;
    t.q_t = reinterpret_cast<uint8_t*>(x);
    t.t_row = 256;
    t.s_1 = 128;
    return std::pair{r, t};
  };
  // Every call below throws before any device work.
  const auto call = [](const megamoe::Fp8QuantizeArgs& r, const megamoe::Fp8QuantizeArgs& t) {
    return [r, t] { megamoe::quantize_fp8_rows_and_columns(r, t, nullptr); };
  };
  auto [r, t] = good();
  r.cols = t.cols = 100;
  expect_invalid(call(r, t), "rows: cols must be a positive multiple of 128");
  std::tie(r, t) = good();
  t.cols = 100;
  expect_invalid(call(r, t), "columns: cols must be a positive multiple of 128");
  std::tie(r, t) = good();
  r.rows = t.rows = -1;
  expect_invalid(call(r, t), "rows: negative rows or batches");
  std::tie(r, t) = good();
  t.x = reinterpret_cast<const __nv_bfloat16*>(y);
  expect_invalid(call(r, t), "rows and columns must quantize the same x");
  std::tie(r, t) = good();
  t.rows = 128;
  expect_invalid(call(r, t), "rows and columns must quantize the same x");
  std::tie(r, t) = good();
  t.x_row = 256;
  expect_invalid(call(r, t), "rows and columns must quantize the same x");
  std::tie(r, t) = good();
  r.q_t = t.q_t;
  expect_invalid(call(r, t), "rows: needs q and no q_t");
  std::tie(r, t) = good();
  t.q = r.q;
  expect_invalid(call(r, t), "columns: needs q_t and no q");
  std::tie(r, t) = good();
  t.scales = nullptr;
  expect_invalid(call(r, t), "columns: null pointer");
  std::tie(r, t) = good();
  r.q_row = 136;
  expect_invalid(call(r, t), "rows: row and batch strides must be multiples of 16 bytes");
  std::tie(r, t) = good();
  t.t_row = 264;
  expect_invalid(call(r, t), "columns: row and batch strides must be multiples of 16 bytes");
  std::tie(r, t) = good();
  r.x = t.x = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(x) + 2);
  expect_invalid(call(r, t), "rows: x, q and q_t must be 16-byte aligned");
}
