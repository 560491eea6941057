#include "kernels/common/sm_count.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "core/cuda_check.h"
#include "core/error.h"

namespace megamoe {

namespace {
constexpr int kMaxDevices = 64;
// 0: not read yet. Two threads reading it at once both store the same value.
std::atomic<int> cached[kMaxDevices];
thread_local int limit = 0;  // 0: none

int device_sm_count() {
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) {
    int sms = 0;
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }
  int sms = cached[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

}  // namespace

int sm_count() {
  const int sms = device_sm_count();
  return limit > 0 && limit < sms ? limit : sms;
}

SmLimit::SmLimit(int sms) : previous_(limit) {
  if (sms < 1) throw_invalid("SmLimit: sms: expected >= 1, got " + std::to_string(sms));
  limit = sms;
}

SmLimit::~SmLimit() { limit = previous_; }

}  // namespace megamoe
