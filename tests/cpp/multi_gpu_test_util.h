// MultiGpuTest: the fixture of the tests that drive several local GPUs from one process
// with peer access (the expert-parallel kernels). Skips with fewer than two GPUs or
// without peer access between every pair.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "comm/peer_exchange.h"
#include "gpu_test_util.h"

namespace megamoe_test {

class MultiGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int32_t devices = 0;
    ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS);
    if (devices < 2) GTEST_SKIP() << "needs 2 GPUs, found " << devices;
    world_ = std::min<int>(devices, megamoe::comm::kMaxRanks);
    for (int a = 0; a < world_; ++a) {
      for (int b = 0; b < world_; ++b) {
        int can = 1;
        if (a != b) {
          CUDA_OK(cudaDeviceCanAccessPeer(&can, a, b));
        }
        if (!can) GTEST_SKIP() << "GPU " << a << " cannot access GPU " << b;
      }
    }
    for (int a = 0; a < world_; ++a) {
      CUDA_OK(cudaSetDevice(a));
      for (int b = 0; b < world_; ++b) {
        if (a == b) continue;
        const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          CUDA_OK(err);
        }
      }
      cudaStream_t s;
      CUDA_OK(cudaStreamCreate(&s));
      streams_.push_back(s);
    }
  }
  void TearDown() override {
    for (size_t a = 0; a < streams_.size(); ++a) {
      cudaSetDevice(static_cast<int>(a));
      cudaStreamDestroy(streams_[a]);
    }
    for (auto& [device, p] : allocations_) {
      cudaSetDevice(device);
      cudaFree(p);
    }
    cudaSetDevice(0);
  }

  void* alloc_on(int device, size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);  // once, at creation
    allocations_.push_back({device, p});
    return p;
  }

  // Fresh zeroed buffers of `bytes`, one per GPU, and each rank's view of them.
  std::vector<megamoe::comm::PeerTable> make_tables(size_t bytes) {
    std::vector<char*> buffers;
    for (int r = 0; r < world_; ++r) buffers.push_back(static_cast<char*>(alloc_on(r, bytes)));
    std::vector<megamoe::comm::PeerTable> tables(world_);
    for (int r = 0; r < world_; ++r) {
      tables[r].rank = r;
      tables[r].world_size = world_;
      for (int s = 0; s < world_; ++s) tables[r].buffers[s] = buffers[s];
    }
    return tables;
  }

  int world_ = 0;
  std::vector<cudaStream_t> streams_;
  std::vector<std::pair<int, void*>> allocations_;
};

}  // namespace megamoe_test
