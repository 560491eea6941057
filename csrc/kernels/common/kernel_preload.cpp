#include "kernels/common/kernel_preload.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/driver_entry.h"
#include "core/error.h"

namespace megamoe {
namespace {

std::vector<const void*>& registered() {  // built during static initialisation
  static std::vector<const void*> kernels;
  return kernels;
}

// The driver calls (found once; a failed lookup is retried by the next call).
struct Driver {
  CUresult (*kernel_get_library)(CUlibrary*, CUkernel);
  CUresult (*library_kernel_count)(unsigned*, CUlibrary);
  CUresult (*library_kernels)(CUkernel*, unsigned, CUlibrary);
  CUresult (*kernel_get_function)(CUfunction*, CUkernel);
};

const Driver& driver() {
  constexpr int kVersion = 12050;  // cuKernelGetLibrary came with CUDA 12.5
  static const Driver d{
      driver_function<CUresult(CUlibrary*, CUkernel)>("cuKernelGetLibrary", kVersion),
      driver_function<CUresult(unsigned*, CUlibrary)>("cuLibraryGetKernelCount", kVersion),
      driver_function<CUresult(CUkernel*, unsigned, CUlibrary)>("cuLibraryEnumerateKernels",
                                                                kVersion),
      driver_function<CUresult(CUfunction*, CUkernel)>("cuKernelGetFunction", kVersion)};
  return d;
}

void driver_check(CUresult res, const char* what) {
  if (res != CUDA_SUCCESS) {
    throw Error(MEGAMOE_ERROR_CUDA, std::string(what) + " failed with CUresult " +
                                        std::to_string(static_cast<int>(res)));
  }
}

}  // namespace

bool register_kernel_module(const void* kernel) {
  registered().push_back(kernel);
  return true;
}

void preload_kernels() {
  static std::mutex mutex;
  static std::set<int> done;
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count(device)) return;
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device));  // the device's primary context, current
  const Driver& d = driver();
  std::set<CUlibrary> libraries;
  for (const void* anchor : registered()) {
    cudaKernel_t kernel = nullptr;
    MEGAMOE_CUDA_CHECK(cudaGetKernel(&kernel, anchor));
    CUlibrary library = nullptr;
    driver_check(d.kernel_get_library(&library, reinterpret_cast<CUkernel>(kernel)),
                 "cuKernelGetLibrary");
    if (!libraries.insert(library).second) continue;
    unsigned count = 0;
    driver_check(d.library_kernel_count(&count, library), "cuLibraryGetKernelCount");
    std::vector<CUkernel> kernels(count);
    driver_check(d.library_kernels(kernels.data(), count, library), "cuLibraryEnumerateKernels");
    for (CUkernel k : kernels) {
      CUfunction f = nullptr;  // getting the function loads it into the current context
      driver_check(d.kernel_get_function(&f, k), "cuKernelGetFunction");
    }
  }
  done.insert(device);
}

}  // namespace megamoe
