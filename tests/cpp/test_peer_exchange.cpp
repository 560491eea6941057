// The device-side count exchange between GPUs of one process with peer access (issue 4's
// first building block). Skipped with fewer than two GPUs or without peer access.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "comm/peer_exchange.h"
#include "gpu_test_util.h"
#include "multi_gpu_test_util.h"

namespace {

using megamoe::comm::ControlLayout;
using megamoe::comm::PeerTable;

class PeerExchangeGpu : public megamoe_test::MultiGpuTest {
 protected:
  std::vector<PeerTable> make_group(int64_t E) { return make_tables(ControlLayout::bytes(E)); }
};

TEST_F(PeerExchangeGpu, EveryRankGetsEveryRanksCounts) {
  const int64_t E = 300;
  std::vector<PeerTable> tables = make_group(E);
  std::vector<int32_t*> counts(world_), errors(world_);
  for (int r = 0; r < world_; ++r) {
    counts[r] = static_cast<int32_t*>(alloc_on(r, E * sizeof(int32_t)));
    errors[r] = static_cast<int32_t*>(alloc_on(r, 2 * sizeof(int32_t)));  // peer_exchange.h
  }
  std::mt19937 rng(megamoe_test::fresh_seed());
  // Several calls on the same buffers: the generation counters stand in for any reset.
  for (int call = 0; call < 5; ++call) {
    std::vector<std::vector<int32_t>> host(world_, std::vector<int32_t>(E));
    for (int r = 0; r < world_; ++r) {
      for (auto& c : host[r]) c = static_cast<int32_t>(rng() % 1000);
      CUDA_OK(cudaSetDevice(r));
      CUDA_OK(cudaMemcpy(counts[r], host[r].data(), E * 4, cudaMemcpyHostToDevice));
    }
    // All launches first (each kernel waits for the others), then the syncs.
    for (int r = 0; r < world_; ++r) {
      CUDA_OK(cudaSetDevice(r));
      megamoe::comm::exchange_counts(tables[r], counts[r], E, 10'000'000'000, errors[r],
                                     streams_[r]);
    }
    for (int r = 0; r < world_; ++r) {
      CUDA_OK(cudaSetDevice(r));
      CUDA_OK(cudaStreamSynchronize(streams_[r]));
      int32_t error = -1;
      CUDA_OK(cudaMemcpy(&error, errors[r], 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(error, 0) << megamoe::comm::describe_error(error);
      uint32_t generation = 0;
      CUDA_OK(cudaMemcpy(&generation, tables[r].buffers[r] + ControlLayout::kGeneration, 4,
                         cudaMemcpyDeviceToHost));
      EXPECT_EQ(generation, uint32_t(call + 1));
      std::vector<int32_t> all(world_ * E);
      CUDA_OK(cudaMemcpy(all.data(), ControlLayout::counts(tables[r].buffers[r], E, generation),
                         all.size() * 4, cudaMemcpyDeviceToHost));
      for (int s = 0; s < world_; ++s) {
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_EQ(all[s * E + e], host[s][e]) << "call " << call << ", rank " << r
                                               << " row " << s << " expert " << e;
        }
      }
    }
  }
}

TEST_F(PeerExchangeGpu, AMissingPeerIsATimeoutErrorNotAHang) {
  const int64_t E = 16;
  std::vector<PeerTable> tables = make_group(E);
  int32_t* counts = static_cast<int32_t*>(alloc_on(0, E * sizeof(int32_t)));
  int32_t* error = static_cast<int32_t*>(alloc_on(0, 2 * sizeof(int32_t)));  // peer_exchange.h
  CUDA_OK(cudaSetDevice(0));
  // Only rank 0 calls; every other rank stays away.
  megamoe::comm::exchange_counts(tables[0], counts, E, 20'000'000, error, streams_[0]);
  CUDA_OK(cudaStreamSynchronize(streams_[0]));
  int32_t code = 0;
  CUDA_OK(cudaMemcpy(&code, error, 4, cudaMemcpyDeviceToHost));
  const std::string message = megamoe::comm::describe_error(code);
  EXPECT_NE(code, 0);
  EXPECT_NE(message.find("did not arrive in phase 'counts'"), std::string::npos) << message;
  EXPECT_EQ(message.find("rank 0 "), std::string::npos) << message;  // rank 0 did arrive
  // Rank 0 went on after its timeout: its code is in every rank's group failure word.
  for (size_t r = 0; r < tables.size(); ++r) {
    int32_t mark = 0;
    CUDA_OK(cudaMemcpy(&mark, tables[r].buffers[r] + ControlLayout::kGroupFailure, 4,
                       cudaMemcpyDeviceToHost));
    EXPECT_EQ(mark, megamoe::comm::group_failure_code(code, 0)) << "rank " << r;
  }
}

TEST(PeerExchange, RejectsABadTable) {
  PeerTable t;
  t.rank = 2;
  t.world_size = 2;
  int32_t dummy = 0;
  megamoe_test::expect_invalid(
      [&] { megamoe::comm::exchange_counts(t, &dummy, 4, 1000, &dummy, nullptr); }, "rank 2 of 2");
  t.rank = 0;
  megamoe_test::expect_invalid(
      [&] { megamoe::comm::exchange_counts(t, &dummy, 4, 1000, &dummy, nullptr); },
      "no buffer for rank 0");
  EXPECT_EQ(megamoe::comm::describe_error((1 << 8) | 1),
            "rank 1 did not arrive in phase 'counts' within the timeout");
  EXPECT_EQ(megamoe::comm::describe_error(megamoe::comm::group_failure_code((1 << 8) | 1, 0)),
            "rank 1 did not arrive in phase 'counts' within the timeout of rank 0, which went "
            "on: the group's later outputs are NaN (make new buffers)");
}

}  // namespace
