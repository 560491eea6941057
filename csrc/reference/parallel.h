// Splits independent items over host threads. Each item is computed by exactly one
// thread, in the same way whatever the split, so results do not depend on the thread
// count (no order-dependent float sums across threads).
#pragma once

#include <algorithm>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

namespace megamoe::reference {

// Calls body(begin, end) on disjoint ranges covering [0, n). `work_per_item` is a rough
// cost (multiply-adds) used to keep small problems on the calling thread, where thread
// start-up would cost more than it saves.
template <class Body>
void parallel_for(int64_t n, double work_per_item, Body&& body) {
  constexpr double kMinWorkPerThread = 2e6;
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const auto by_work =
      static_cast<int64_t>(static_cast<double>(n) * work_per_item / kMinWorkPerThread);
  const int64_t threads = std::clamp<int64_t>(std::min(hw, by_work), 1, std::max<int64_t>(n, 1));
  if (threads == 1) {
    body(int64_t{0}, n);
    return;
  }
  // Failures are carried out as a code, not a std::exception_ptr: that would tie the
  // library to a newer libstdc++ ABI (CXXABI_1.3.13) than it otherwise needs.
  enum Failure : char { kNone, kOutOfMemory, kOther };
  std::vector<Failure> failures(threads, kNone);
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  auto run = [&](int64_t w) {
    try {
      body(n * w / threads, n * (w + 1) / threads);
    } catch (const std::bad_alloc&) {
      failures[w] = kOutOfMemory;
    } catch (...) {
      failures[w] = kOther;
    }
  };
  try {
    for (int64_t w = 1; w < threads; ++w) pool.emplace_back(run, w);
  } catch (...) {
    // Could not start a thread: the ranges of the missing workers run here instead.
    for (int64_t w = static_cast<int64_t>(pool.size()) + 1; w < threads; ++w) run(w);
  }
  run(0);
  for (std::thread& t : pool) t.join();
  for (Failure f : failures) {
    if (f == kOutOfMemory) throw std::bad_alloc();
    if (f == kOther) throw std::runtime_error("a reference worker thread failed");
  }
}

}  // namespace megamoe::reference
