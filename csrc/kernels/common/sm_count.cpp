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
thread_local int limit = 0;              // 0: none (SmLimit::Scope::kEveryGrid)
thread_local int round_robin_limit = 0;  // 0: none (SmLimit::Scope::kRoundRobinGrids)

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

int sm_count(bool tiles_handed_out) {
  int sms = device_sm_count();
  if (limit > 0 && limit < sms) sms = limit;
  if (!tiles_handed_out && round_robin_limit > 0 && round_robin_limit < sms) {
    sms = round_robin_limit;
  }
  return sms;
}

SmLimit::SmLimit(int sms, Scope scope)
    : scope_(scope), previous_(scope == Scope::kEveryGrid ? limit : round_robin_limit) {
  if (sms < 1) throw_invalid("SmLimit: sms: expected >= 1, got " + std::to_string(sms));
  (scope == Scope::kEveryGrid ? limit : round_robin_limit) = sms;
}

SmLimit::~SmLimit() { (scope_ == Scope::kEveryGrid ? limit : round_robin_limit) = previous_; }

}  // namespace megamoe
