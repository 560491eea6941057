// CUDA driver functions found through the runtime, so the library does not link libcuda.
#pragma once

namespace megamoe {

// The driver's `name` of the ABI introduced with CUDA `cuda_version` (e.g. 12000). Throws
// megamoe::Error (MEGAMOE_ERROR_CUDA) naming the function when the driver lacks it.
void* driver_entry_point(const char* name, int cuda_version);

template <class Fn>
Fn* driver_function(const char* name, int cuda_version) {
  return reinterpret_cast<Fn*>(driver_entry_point(name, cuda_version));
}

}  // namespace megamoe
