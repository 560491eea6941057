// Descriptor checks of the FP8 quantizers' C ABI: each bad argument is named, with what was
// expected. The checks run before any device work, so these tests need no GPU (the bits of
// the kernels are tested against the reference quantizer in tests/python/test_fp8_kernels.py).
#include <gtest/gtest.h>

#include <functional>
#include <string>

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
