// Scaffolding shared by the C++ tests: GpuTest, the base fixture of the tests that need a
// CUDA device, and expect_invalid, the check that a call rejects its arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "megamoe/megamoe.h"
#include "test_util.h"

// Fails the test, and returns from the calling function, unless a CUDA call succeeds.
#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Puts the seed of a randomized check into every failure message below it.
#define SEEDED(seed) SCOPED_TRACE("seed=" + std::to_string(seed))

namespace megamoe_test {

// The bits of v rounded to bf16 (round to nearest even), and the value of bf16 bits.
inline uint16_t bf16_bits(double v) {
  const __nv_bfloat16 b = __float2bfloat16(static_cast<float>(v));
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  return bits;
}
inline double bf16_value(uint16_t bits) {
  const uint32_t w = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// Rounds a tensor's values to bf16 in place and returns the bf16 bits.
inline std::vector<uint16_t> round_to_bf16(Tensor& t) {
  std::vector<double> v = t.values();
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    bits[i] = bf16_bits(v[i]);
    v[i] = bf16_value(bits[i]);
  }
  t.assign(v);
  return bits;
}

// Fresh inputs every run; callers print the seed with SEEDED so a failure can be replayed.
inline uint64_t fresh_seed() { return std::random_device{}(); }

// Skips the test when no CUDA device is visible, as the library itself sees it
// (megamoe_cuda_device_count: no GPU or no driver is 0 devices, not a failure); otherwise
// gives it stream_ and device memory, all released in TearDown.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int32_t devices = 0;
    ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS) << megamoe_last_error();
    if (devices == 0) GTEST_SKIP() << "no CUDA device visible (megamoe_cuda_device_count = 0)";
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // At least 16 bytes, so that an empty buffer is still a valid, aligned pointer.
  void* device_alloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess) << bytes << " bytes";
    allocations_.push_back(p);
    return p;
  }
  template <class T>
  T* alloc(int64_t count) {
    return static_cast<T*>(device_alloc(count * sizeof(T)));
  }
  template <class T>
  T* upload(const std::vector<T>& h) {
    T* d = alloc<T>(static_cast<int64_t>(h.size()));
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }
  // Waits for stream_ first.
  template <class T>
  std::vector<T> download(const T* d, int64_t count) {
    std::vector<T> h(count);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), d, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

  cudaStream_t stream_ = nullptr;

 private:
  std::vector<void*> allocations_;
};

// A row-major contiguous descriptor of `data` (device or host memory).
inline megamoe_tensor dense_tensor(void* data, megamoe_dtype dtype, std::vector<int64_t> shape) {
  megamoe_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  return t;
}

// `call` must throw megamoe::Error with INVALID_ARGUMENT and a message containing `fragment`.
inline void expect_invalid(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
  } catch (const megamoe::Error& e) {
    EXPECT_EQ(e.status(), MEGAMOE_ERROR_INVALID_ARGUMENT) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace megamoe_test
