#include "kernels/sm90/tile_counters.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "core/cuda_check.h"
#include "core/env_switch.h"

namespace megamoe::sm90 {
namespace {

constexpr int kPairs = 256;

struct Pool {
  int32_t* pairs = nullptr;  // [kPairs][2]
  std::map<cudaStream_t, int> slot;
};

bool enabled() {
  static const bool on = env_switch("MEGAMOE_DYNAMIC_TILES");
  return on;
}

}  // namespace

int32_t* dynamic_tile_counters(cudaStream_t stream) {
  if (!enabled()) return nullptr;
  static std::mutex mutex;
  static std::map<int, Pool> pools;
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  Pool& pool = pools[device];
  if (pool.pairs == nullptr) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&pool.pairs), sizeof(int32_t) * 2 * kPairs));
    MEGAMOE_CUDA_CHECK(cudaMemset(pool.pairs, 0, sizeof(int32_t) * 2 * kPairs));
  }
  auto it = pool.slot.find(stream);
  if (it == pool.slot.end()) {
    const int next = static_cast<int>(pool.slot.size());
    if (next >= kPairs) return nullptr;
    it = pool.slot.emplace(stream, next).first;
  }
  return pool.pairs + 2 * it->second;
}

int n_group_switch() {
  static const int group = [] {
    const char* v = std::getenv("MEGAMOE_N_GROUP");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return group;
}

}  // namespace megamoe::sm90
