// megamoe_routing_counts on a GPU against a CPU count. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/megamoe.h"

namespace {

using megamoe_test::dense_tensor;

class RoutingCounts : public megamoe_test::GpuTest {
 protected:
  // Random ids in [-3, E + 2): valid ids, -1, and invalid ones on both sides.
  template <class Id>
  void check(int64_t T, int64_t k, int64_t E, uint64_t seed, int repeats = 1) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> dist(-3, E + 1);
    std::vector<Id> ids(T * k);
    std::vector<int32_t> expected(E, 0);
    int32_t expected_invalid = 0;
    for (Id& id : ids) {
      // Mostly valid, as in real routing, with every kind of outlier present.
      const int64_t v = (rng() % 4 == 0) ? dist(rng) : static_cast<int64_t>(rng() % E);
      id = static_cast<Id>(v);
      if (v >= 0 && v < E) {
        ++expected[v];
      } else if (v != -1) {
        ++expected_invalid;
      }
    }
    const megamoe_dtype dt = sizeof(Id) == 4 ? MEGAMOE_DTYPE_INT32 : MEGAMOE_DTYPE_INT64;
    void* d_ids = device_alloc(ids.size() * sizeof(Id) + 1);
    auto* d_counts = static_cast<int32_t*>(device_alloc(E * sizeof(int32_t)));
    auto* d_invalid = static_cast<int32_t*>(device_alloc(sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(Id), cudaMemcpyHostToDevice));
    // Garbage in the outputs: the call must overwrite, not add.
    CUDA_OK(cudaMemset(d_counts, 0x7b, E * sizeof(int32_t)));
    CUDA_OK(cudaMemset(d_invalid, 0x7b, sizeof(int32_t)));

    megamoe_tensor t_ids = dense_tensor(d_ids, dt, {T, k});
    megamoe_tensor t_counts = dense_tensor(d_counts, MEGAMOE_DTYPE_INT32, {E});
    megamoe_tensor t_invalid = dense_tensor(d_invalid, MEGAMOE_DTYPE_INT32, {1});
    for (int r = 0; r < repeats; ++r) {
      ASSERT_EQ(megamoe_routing_counts(&t_ids, E, &t_counts, &t_invalid, stream_),
                MEGAMOE_SUCCESS)
          << megamoe_last_error();
    }
    std::vector<int32_t> counts(E);
    int32_t invalid = -1;
    CUDA_OK(cudaMemcpyAsync(counts.data(), d_counts, E * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream_));
    CUDA_OK(cudaMemcpyAsync(&invalid, d_invalid, sizeof(int32_t), cudaMemcpyDeviceToHost,
                            stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(counts, expected);
    EXPECT_EQ(invalid, expected_invalid);
  }
};

}  // namespace

TEST_F(RoutingCounts, Int32MatchesCpu) { check<int32_t>(4097, 8, 128, 1); }
TEST_F(RoutingCounts, Int64MatchesCpu) { check<int64_t>(4097, 8, 128, 2); }
TEST_F(RoutingCounts, SmallShapes) {
  check<int32_t>(1, 1, 1, 3);
  check<int64_t>(7, 1, 5, 4);
  check<int32_t>(7, 3, 2, 5);
}
TEST_F(RoutingCounts, ManyExpertsUseGlobalCounters) { check<int32_t>(3000, 4, 20000, 6); }
TEST_F(RoutingCounts, LargeGridStride) { check<int64_t>(16384 * 8, 8, 256, 7); }
TEST_F(RoutingCounts, RepeatedCallsOverwrite) { check<int32_t>(513, 8, 64, 8, 3); }

TEST_F(RoutingCounts, ZeroTokensZeroCounts) {
  auto* d_counts = static_cast<int32_t*>(device_alloc(16 * sizeof(int32_t)));
  auto* d_invalid = static_cast<int32_t*>(device_alloc(sizeof(int32_t)));
  CUDA_OK(cudaMemset(d_counts, 0x7b, 16 * sizeof(int32_t)));
  CUDA_OK(cudaMemset(d_invalid, 0x7b, sizeof(int32_t)));
  megamoe_tensor ids = dense_tensor(nullptr, MEGAMOE_DTYPE_INT64, {0, 4});
  megamoe_tensor counts = dense_tensor(d_counts, MEGAMOE_DTYPE_INT32, {16});
  megamoe_tensor invalid = dense_tensor(d_invalid, MEGAMOE_DTYPE_INT32, {1});
  ASSERT_EQ(megamoe_routing_counts(&ids, 16, &counts, &invalid, stream_), MEGAMOE_SUCCESS)
      << megamoe_last_error();
  std::vector<int32_t> host(17, -1);
  CUDA_OK(cudaStreamSynchronize(stream_));
  CUDA_OK(cudaMemcpy(host.data(), d_counts, 16 * sizeof(int32_t), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&host[16], d_invalid, sizeof(int32_t), cudaMemcpyDeviceToHost));
  for (int32_t v : host) EXPECT_EQ(v, 0);
}

TEST_F(RoutingCounts, CapturableInCudaGraph) {
  // No host sync inside the call: it records into a graph and replays correctly.
  const int64_t T = 1000, k = 4, E = 32;
  std::vector<int32_t> ids(T * k);
  std::vector<int32_t> expected(E, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7919) % E);
    ++expected[ids[i]];
  }
  void* d_ids = device_alloc(ids.size() * sizeof(int32_t));
  auto* d_counts = static_cast<int32_t*>(device_alloc(E * sizeof(int32_t)));
  auto* d_invalid = static_cast<int32_t*>(device_alloc(sizeof(int32_t)));
  CUDA_OK(cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  megamoe_tensor t_ids = dense_tensor(d_ids, MEGAMOE_DTYPE_INT32, {T, k});
  megamoe_tensor t_counts = dense_tensor(d_counts, MEGAMOE_DTYPE_INT32, {E});
  megamoe_tensor t_invalid = dense_tensor(d_invalid, MEGAMOE_DTYPE_INT32, {1});

  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  const megamoe_status st = megamoe_routing_counts(&t_ids, E, &t_counts, &t_invalid, stream_);
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_EQ(st, MEGAMOE_SUCCESS) << megamoe_last_error();
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 2; ++r) CUDA_OK(cudaGraphLaunch(exec, stream_));
  std::vector<int32_t> counts(E);
  int32_t invalid = -1;
  CUDA_OK(cudaStreamSynchronize(stream_));
  CUDA_OK(cudaMemcpy(counts.data(), d_counts, E * sizeof(int32_t), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&invalid, d_invalid, sizeof(int32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(counts, expected);
  EXPECT_EQ(invalid, 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(RoutingCounts, HostPointerRejectedClearly) {
  std::vector<int32_t> host_ids(8, 0);
  auto* d_counts = static_cast<int32_t*>(device_alloc(4 * sizeof(int32_t)));
  auto* d_invalid = static_cast<int32_t*>(device_alloc(sizeof(int32_t)));
  megamoe_tensor ids = dense_tensor(host_ids.data(), MEGAMOE_DTYPE_INT32, {4, 2});
  megamoe_tensor counts = dense_tensor(d_counts, MEGAMOE_DTYPE_INT32, {4});
  megamoe_tensor invalid = dense_tensor(d_invalid, MEGAMOE_DTYPE_INT32, {1});
  EXPECT_EQ(megamoe_routing_counts(&ids, 4, &counts, &invalid, stream_),
            MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(megamoe_last_error()).find("topk_ids: expected CUDA device memory"),
            std::string::npos)
      << megamoe_last_error();
  // The library's runtime keeps no stale error: a valid call right after succeeds.
  std::vector<int32_t> zeros(8, 0);
  void* d_ids = device_alloc(8 * sizeof(int32_t));
  CUDA_OK(cudaMemcpy(d_ids, zeros.data(), 8 * sizeof(int32_t), cudaMemcpyHostToDevice));
  ids.data = d_ids;
  EXPECT_EQ(megamoe_routing_counts(&ids, 4, &counts, &invalid, stream_), MEGAMOE_SUCCESS)
      << megamoe_last_error();
  CUDA_OK(cudaStreamSynchronize(stream_));
}
