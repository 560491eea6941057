// Descriptor checks of the FP8 quantizers' C ABI: each bad argument is named, with what was
// expected. The checks run before any device work, so these tests need no GPU (the bits of
// the kernels are tested against the reference quantizer in tests/python/test_fp8_kernels.py).
// And, on a GPU, the 1x128 quantizer writing rows to a routing plan's sorted rows
// (internal, quantize_fp8_to_rows of kernels/common/quantize_fp8.h): the bits of
// quantizing the token matrix and then gathering its rows, values and scales.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/common/quantize_fp8.h"
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

    const std::vector<uint8_t> tq = download(token_q, T * H), got_q = download(q, rows * H);
    const std::vector<float> ts = download(token_s, blocks * ld_tokens),
                             got_s = download(s, blocks * ld_rows);
    std::vector<uint8_t> want_q(rows * H, kPoisonByte);
    std::vector<uint32_t> want_s(blocks * ld_rows, kPoisonScale);
    for (int64_t r = 0; r < sorted.used; ++r) {
      const int64_t t = sorted.row_token[r];
      std::copy_n(tq.begin() + t * H, H, want_q.begin() + r * H);
      for (int64_t j = 0; j < blocks; ++j) {
        std::memcpy(&want_s[j * ld_rows + r], &ts[j * ld_tokens + t], 4);
      }
    }
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

}  // namespace

TEST_F(QuantizeFp8SortedRows, EqualsQuantizeThenGather) {
  struct Case {
    int64_t T, k, H, E, empty, drop_every;
  };
  const Case cases[] = {
      {300, 8, 256, 16, 5, 0},    // tokens not a multiple of 128, an expert without rows
      {300, 8, 256, 16, -1, 7},   // dropped slots: the last sorted rows stay unwritten
      {1, 1, 128, 4, -1, 0},      // one token, k = 1
      {130, 1, 384, 8, 0, 0},     // k = 1, expert 0 empty
      {257, 3, 128, 2, 1, 5},     // every row into one expert, some dropped
      {64, 4, 2048, 128, 7, 0},   // qwen3's H and E, few tokens
  };
  for (const Case& c : cases) {
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    check(c.T, c.k, c.H, c.E, random_ids(c.T, c.k, c.E, c.empty, c.drop_every, rng), seed);
  }
  // A token routed twice to the same expert (the plan allows it): both rows written.
  check(3, 2, 128, 2, {1, 1, 0, 1, -1, -1}, fresh_seed());
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
}
