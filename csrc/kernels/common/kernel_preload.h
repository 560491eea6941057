// Loading every kernel of the library into a device's context before a call whose kernels
// wait on each other across GPUs.
//
// With lazy module loading (CUDA_MODULE_LOADING=LAZY, the default under torch) a kernel is
// loaded into a context at its first launch, and the load may wait for the context to go
// idle. An expert-parallel call launches a kernel that spins until its peers arrive, then
// more kernels behind it: if one of those is loaded lazily, the host thread blocks until the
// spinning kernel ends. One thread driving several GPUs then never reaches the peers' launches
// (the spin times out); with one process per GPU every call pays a stall. Loading everything
// up front, once per device, removes the load from the launch (the CUDA programming guide's
// advice for kernels that depend on concurrently running kernels).
#pragma once

namespace megamoe {

// Records one kernel of a translation unit; preload_kernels() loads every kernel of the
// module that holds it. Each .cu file with kernels registers one, at static initialisation:
//   [[maybe_unused]] const bool kPreloadable = register_kernel_module(&some_kernel);
bool register_kernel_module(const void* kernel);
template <class Kernel>
bool register_kernel_module(Kernel* kernel) {
  return register_kernel_module(reinterpret_cast<const void*>(kernel));
}

// Loads every kernel of every registered module into the current device's context; does the
// work once per device and process. Throws megamoe::Error if the driver cannot.
void preload_kernels();

}  // namespace megamoe
