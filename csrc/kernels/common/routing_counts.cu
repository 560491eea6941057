// Per-expert slot counts of a routing table, on the device, without a host sync.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor_check.h"
#include "kernels/common/device.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/sm_count.h"

namespace megamoe {
namespace {

constexpr int kThreads = 256;
// Up to this many experts the block keeps a shared-memory histogram (48 KiB, the
// default dynamic limit); beyond it every slot goes straight to global atomics.
constexpr int64_t kMaxSharedExperts = 48 * 1024 / sizeof(int32_t);

// Grid-stride over the n = T*k slots. Counts are summed per block in shared memory and
// flushed with one global atomic per (block, non-empty expert); invalid slots are summed
// per warp first. Integer atomics, so the result does not depend on ordering.
template <class Id>
__global__ void __launch_bounds__(kThreads)
    routing_counts_kernel(const Id* __restrict__ ids, int64_t n, int32_t num_experts,
                          bool shared_hist, int32_t* __restrict__ counts,
                          int32_t* __restrict__ invalid) {
  extern __shared__ int32_t hist[];
  if (shared_hist) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
    __syncthreads();
  }
  int32_t* target = shared_hist ? hist : counts;
  int32_t bad = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const Id e = ids[i];
    if (e >= 0 && e < static_cast<Id>(num_experts)) {
      atomicAdd(&target[e], 1);
    } else if (e != Id(-1)) {
      ++bad;
    }
  }
  bad = __reduce_add_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd(invalid, bad);
  if (shared_hist) {
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      if (hist[e] != 0) atomicAdd(&counts[e], hist[e]);
    }
  }
}

template <class Id>
void launch(const megamoe_tensor& ids, int64_t n, int32_t num_experts, int32_t* counts,
            int32_t* invalid, cudaStream_t stream) {
  const int sms = sm_count();
  // A few blocks per SM hide load latency; more would only add histogram flushes.
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 4LL * sms ? wanted : 4LL * sms);
  const bool shared_hist = num_experts <= kMaxSharedExperts;
  const size_t smem = shared_hist ? num_experts * sizeof(int32_t) : 0;
  routing_counts_kernel<Id><<<blocks, kThreads, smem, stream>>>(
      static_cast<const Id*>(ids.data), n, num_experts, shared_hist, counts, invalid);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void check_int32_vector(const megamoe_tensor* t_, const char* name, int64_t size,
                        const std::string& origin) {
  const megamoe_tensor& t = require_tensor(t_, name);
  require_rank(t, name, 1, "[n]");
  require_shape(t, name, {{"n", size}}, origin);
  require_dtype(t, name, {MEGAMOE_DTYPE_INT32});
  require_contiguous(t, name);
  require_data(t, name);
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&routing_counts_kernel<int32_t>);

}  // namespace
}  // namespace megamoe

using namespace megamoe;

extern "C" {

MEGAMOE_API megamoe_status megamoe_routing_counts(const megamoe_tensor* topk_ids,
                                                  int64_t num_experts,
                                                  megamoe_tensor* expert_counts,
                                                  megamoe_tensor* invalid_count,
                                                  void* cuda_stream) {
  return abi_call("megamoe_routing_counts", [&] {
    const megamoe_tensor& ids = require_tensor(topk_ids, "topk_ids");
    require_rank(ids, "topk_ids", 2, "[T, k]");
    require_dtype(ids, "topk_ids", {MEGAMOE_DTYPE_INT32, MEGAMOE_DTYPE_INT64});
    require_contiguous(ids, "topk_ids");
    require_data(ids, "topk_ids");
    if (num_experts < 1 || num_experts > INT32_MAX) {
      throw_invalid("num_experts: expected a value in [1, 2147483647], got " +
                    std::to_string(num_experts));
    }
    const int64_t n = numel(ids);
    if (n > INT32_MAX) {
      throw_invalid("topk_ids: shape " + shape_str(ids) + " has " + std::to_string(n) +
                    " slots, more than the int32 counts can hold");
    }
    check_int32_vector(expert_counts, "expert_counts", num_experts, "from num_experts");
    check_int32_vector(invalid_count, "invalid_count", 1, "");
    require_disjoint(*expert_counts, "expert_counts", *invalid_count, "invalid_count");
    require_disjoint(*expert_counts, "expert_counts", ids, "topk_ids");
    require_disjoint(*invalid_count, "invalid_count", ids, "topk_ids");
    require_device_memory(ids, "topk_ids");
    require_device_memory(*expert_counts, "expert_counts");
    require_device_memory(*invalid_count, "invalid_count");

    auto stream = static_cast<cudaStream_t>(cuda_stream);
    auto* counts = static_cast<int32_t*>(expert_counts->data);
    auto* invalid = static_cast<int32_t*>(invalid_count->data);
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(counts, 0, num_experts * sizeof(int32_t), stream));
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(invalid, 0, sizeof(int32_t), stream));
    if (n == 0) return MEGAMOE_SUCCESS;
    const auto experts = static_cast<int32_t>(num_experts);
    if (ids.dtype == MEGAMOE_DTYPE_INT32) {
      launch<int32_t>(ids, n, experts, counts, invalid, stream);
    } else {
      launch<int64_t>(ids, n, experts, counts, invalid, stream);
    }
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
