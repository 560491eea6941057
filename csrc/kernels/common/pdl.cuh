// The device side of programmatic dependent launch (pdl.h). Both are no-ops in a kernel
// launched without the PDL attribute.
#pragma once

namespace megamoe {

// Waits until the kernels this one depends on have completed and their writes are visible.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next kernel of the stream launch (its blocks then wait in pdl_wait as they start).
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace megamoe
