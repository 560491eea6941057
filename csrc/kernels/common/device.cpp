#include "kernels/common/device.h"

#include <cuda_runtime_api.h>

#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor_check.h"

namespace megamoe {

void require_device_memory(const megamoe_tensor& t, const char* name) {
  if (numel(t) == 0) return;
  cudaPointerAttributes attr{};
  cuda_check(cudaPointerGetAttributes(&attr, t.data),
             (std::string("cudaPointerGetAttributes(") + name + ")").c_str());
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    const char* kind = attr.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory";
    throw_invalid(std::string(name) + ": expected CUDA device memory, got a pointer to " +
                  kind);
  }
  int current = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&current));
  if (attr.type == cudaMemoryTypeDevice && attr.device != current) {
    throw_invalid(std::string(name) + ": memory is on CUDA device " +
                  std::to_string(attr.device) + " but the current device is " +
                  std::to_string(current));
  }
}

}  // namespace megamoe

extern "C" {

MEGAMOE_API megamoe_status megamoe_cuda_device_count(int32_t* count) {
  return megamoe::abi_call("megamoe_cuda_device_count", [&] {
    if (count == nullptr) megamoe::throw_invalid("count: output pointer is NULL");
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
      // No GPU or no driver is a normal state for this query, not a failure; clear the
      // runtime's error so it does not surface in a later, unrelated check.
      (void)cudaGetLastError();
      *count = 0;
      return MEGAMOE_SUCCESS;
    }
    megamoe::cuda_check(err, "cudaGetDeviceCount");
    *count = n;
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
