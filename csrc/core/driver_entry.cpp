#include "core/driver_entry.h"

#include <cuda_runtime_api.h>

#include <string>

#include "core/cuda_check.h"
#include "core/error.h"

namespace megamoe {

void* driver_entry_point(const char* name, int cuda_version) {
  cudaDriverEntryPointQueryResult found{};
  void* ptr = nullptr;
  MEGAMOE_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion(name, &ptr, cuda_version, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || ptr == nullptr) {
    throw Error(MEGAMOE_ERROR_CUDA, std::string("the CUDA driver has no ") + name +
                                        " (needs a driver for CUDA " +
                                        std::to_string(cuda_version / 1000) + "." +
                                        std::to_string(cuda_version % 1000 / 10) +
                                        " or newer)");
  }
  return ptr;
}

}  // namespace megamoe
