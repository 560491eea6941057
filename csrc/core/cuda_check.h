// CUDA runtime calls that fail become megamoe::Error (MEGAMOE_ERROR_CUDA, or
// OUT_OF_MEMORY for allocation failures) naming the call and CUDA's error text.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/error.h"

namespace megamoe {

inline void cuda_check(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  // The runtime is linked statically, so its last-error slot holds only this library's
  // errors: reset it so a later launch check does not report this failure again.
  (void)cudaGetLastError();
  const megamoe_status status =
      err == cudaErrorMemoryAllocation ? MEGAMOE_ERROR_OUT_OF_MEMORY : MEGAMOE_ERROR_CUDA;
  throw Error(status, std::string(call) + " failed: " + cudaGetErrorName(err) + ": " +
                          cudaGetErrorString(err));
}

}  // namespace megamoe

// Stringizes the call itself so the message says exactly which call failed.
#define MEGAMOE_CUDA_CHECK(call) ::megamoe::cuda_check((call), #call)
