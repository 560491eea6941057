// Programmatic dependent launch (PDL) for the kernels of one GPU's chain (plan, quantizers,
// grouped GEMMs, gathers, combines): a kernel launched with launch_pdl may start while the
// kernel before it in the stream finishes, runs what needs none of that kernel's results
// (its shared-memory barriers), then waits in pdl_wait() until that kernel has completed
// and its writes are visible. What it saves is the launch gap and the new kernel's start on
// each SM, at every kernel boundary of the chain.
//
// Contract of a kernel launched with launch_pdl: every thread calls pdl_wait() before it
// reads or writes global memory that another kernel may touch (pdl.cuh). A kernel calls
// pdl_launch_dependents() to let the next kernel launch early; without it the next one
// launches once this one's blocks have exited. Off unless MEGAMOE_PDL is set (read once).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/cuda_check.h"
#include "core/env_switch.h"

namespace megamoe {

inline bool pdl_enabled() {
  static const bool on = env_switch("MEGAMOE_PDL");
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when enabled.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace megamoe
