// RanksTest: the fixture of the tests that drive the ranks of an expert-parallel group
// from one thread of one process, over peer pointers. Two ways to get the ranks:
//   use_gpus(): one rank per local GPU with peer access (skips with fewer than two GPUs
//     or without peer access between every pair); MultiGpuTest is the fixture that does
//     only this.
//   emulate(world, side_streams): `world` ranks on GPU 0 (skips without a GPU): each rank's
//     buffers are allocations of their own, its calls go to a stream of its own (and with
//     side_streams, an overlapped path's second stream is one of its own too, made with
//     the others: see kQueuePerEmulatedRank), and everything it
//     launches is capped to sm_count() / world SMs (megamoe::SmLimit), so that every rank's
//     kernels can be resident at once and a kernel spinning for a peer never takes the SMs
//     the peer's kernels need (docs/expert-parallel.md, "Several ranks on one GPU").
// Rank r's launches go inside an on_rank(r) scope, in either mode.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/peer_exchange.h"
#include "gpu_test_util.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/sm_count.h"

namespace megamoe_test {

// Emulated ranks wait on each other across streams of one GPU: each stream needs a hardware
// queue of its own, or a rank's launches can queue behind another rank's spinning kernel.
// The driver reads the number of queues (8 by default) when it creates the context, i.e.
// before the first test runs; a value the environment already sets is kept.
// Enough queues is not enough: the driver gives a stream its queue when the stream is made
// (streams alias onto queues in turn), so two streams made far apart can share one. That is
// why emulate() makes every stream a rank uses, the overlapped paths' side streams too,
// in one run of at most 2 * kMaxRanks = 16 <= 32: left to the library, a side stream is made
// at a rank's first overlapped call and kept for the process under its buffer's address, and
// a later test whose buffer lands at that address gets the old stream, on whatever queue it
// had. Rank a's side stream on rank b's queue (a launched first) is a deadlock: the side
// stream waits (fork event) for a's counts phase, which waits for b's counts kernel, queued
// behind that wait ("rank b did not arrive in phase 'counts'").
inline const bool kQueuePerEmulatedRank = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  return true;
}();

class RanksTest : public ::testing::Test {
 protected:
  void use_gpus() {
    int32_t devices = 0;
    ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS);
    if (devices < 2) GTEST_SKIP() << "needs 2 GPUs, found " << devices;
    const int world = std::min<int>(devices, megamoe::comm::kMaxRanks);
    for (int a = 0; a < world; ++a) {
      for (int b = 0; b < world; ++b) {
        int can = 1;
        if (a != b) {
          CUDA_OK(cudaDeviceCanAccessPeer(&can, a, b));
        }
        if (!can) GTEST_SKIP() << "GPU " << a << " cannot access GPU " << b;
      }
    }
    for (int a = 0; a < world; ++a) {
      CUDA_OK(cudaSetDevice(a));
      for (int b = 0; b < world; ++b) {
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
    world_ = world;
  }

  void emulate(int world, bool side_streams = false) {
    ASSERT_GE(world, 1);
    ASSERT_LE(world, megamoe::comm::kMaxRanks);
    int32_t devices = 0;
    ASSERT_EQ(megamoe_cuda_device_count(&devices), MEGAMOE_SUCCESS) << megamoe_last_error();
    if (devices == 0) GTEST_SKIP() << "no CUDA device visible (megamoe_cuda_device_count = 0)";
    const int streams = side_streams ? 2 * world : world;
    if (const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
        queues != nullptr && std::atoi(queues) < streams) {
      GTEST_SKIP() << "CUDA_DEVICE_MAX_CONNECTIONS=" << queues << " gives fewer hardware "
                   << "queues than the " << streams << " streams of " << world
                   << " emulated ranks need";
    }
    CUDA_OK(cudaSetDevice(0));
    // Before any rank's first launch: a lazy load behind one rank's spinning kernel would
    // wait for it (kernel_preload.h).
    megamoe::preload_kernels();
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    share_ = std::max(1, sms / world);
    emulated_ = true;
    // One run of stream creations, nothing made between them (kQueuePerEmulatedRank).
    for (int i = 0; i < streams; ++i) {
      cudaStream_t s;
      // Non-blocking: nothing a test puts on the legacy stream can order one rank behind another.
      CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      (i < world ? streams_ : side_streams_).push_back(s);
    }
    world_ = world;
  }

  void TearDown() override {
    for (size_t r = 0; r < streams_.size(); ++r) {
      cudaSetDevice(device_of(static_cast<int>(r)));
      cudaStreamDestroy(streams_[r]);
    }
    for (cudaStream_t s : side_streams_) {  // emulated: GPU 0
      cudaSetDevice(0);
      cudaStreamDestroy(s);
    }
    for (auto& [device, p] : allocations_) {
      cudaSetDevice(device);
      cudaFree(p);
    }
    cudaSetDevice(0);
  }

  int device_of(int rank) const { return emulated_ ? 0 : rank; }

  // While alive: the rank's GPU is current, and when emulated, the launches of this thread
  // get the rank's share of the SMs.
  class OnRank {
   public:
    OnRank(int device, int sms) {
      EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
      if (sms > 0) limit_.emplace(sms);
    }

   private:
    std::optional<megamoe::SmLimit> limit_;
  };
  [[nodiscard]] OnRank on_rank(int rank) const {
    return OnRank(device_of(rank), emulated_ ? share_ : 0);
  }

  void* alloc_on(int device, size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess) << bytes << " bytes";
    EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);  // once, at creation
    allocations_.push_back({device, p});
    return p;
  }

  // Fresh zeroed buffers of `bytes`, one per rank, and each rank's view of them.
  std::vector<megamoe::comm::PeerTable> make_tables(size_t bytes) {
    std::vector<char*> buffers;
    for (int r = 0; r < world_; ++r) {
      buffers.push_back(static_cast<char*>(alloc_on(device_of(r), bytes)));
    }
    std::vector<megamoe::comm::PeerTable> tables(world_);
    for (int r = 0; r < world_; ++r) {
      tables[r].rank = r;
      tables[r].world_size = world_;
      for (int s = 0; s < world_; ++s) tables[r].buffers[s] = buffers[s];
    }
    return tables;
  }

  int world_ = 0;
  bool emulated_ = false;
  int share_ = 0;  // SMs of each emulated rank
  std::vector<cudaStream_t> streams_;
  // emulate(world, true): each rank's side stream of the overlapped forward or backward, for the
  // fixture to hand to the library (megamoe::ep::set_side_stream); empty otherwise.
  std::vector<cudaStream_t> side_streams_;
  std::vector<std::pair<int, void*>> allocations_;
};

class MultiGpuTest : public RanksTest {
 protected:
  void SetUp() override { use_gpus(); }
};

}  // namespace megamoe_test
