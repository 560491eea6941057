// Carving of a caller-owned workspace into aligned pieces: a bump allocator over
// [base, base + capacity). Built without a base it only counts, so a size query and the call
// it sizes run the same carving code and cannot disagree about the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace megamoe {

class WorkspaceCarver {
 public:
  // Every piece starts at a multiple of this from the base: cudaMalloc's alignment, so a
  // piece is as aligned as a buffer of its own would be (what the 16-byte vector accesses
  // and the tensor maps of the kernels are written against).
  static constexpr size_t kAlignment = 256;

  // Counts only: take() returns null.
  WorkspaceCarver() = default;
  // Carves [base, base + capacity); a null base counts only (require_fits then throws).
  WorkspaceCarver(void* base, size_t capacity)
      : base_(static_cast<char*>(base)), capacity_(capacity) {}

  // The next piece: `count` elements of T (null when counting only).
  template <class T>
  T* take(int64_t count) {
    if (count < 0) throw_invalid("workspace: a piece of " + std::to_string(count) + " elements");
    const size_t offset = take_bytes(static_cast<size_t>(count) * sizeof(T));
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset);
  }

  // The offset of the next piece of `bytes` bytes: for layouts whose base differs from one
  // address space to the next (every rank's symmetric buffer).
  size_t take_bytes(size_t bytes) {
    const size_t offset = used_;
    used_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return offset;
  }

  // Bytes the pieces so far need, a multiple of kAlignment.
  size_t bytes() const { return used_; }

  // Throws INVALID_ARGUMENT unless the pieces fit the workspace; `size_query` names the
  // ABI function that gives the size.
  void require_fits(const char* size_query) const {
    if (base_ == nullptr || capacity_ < used_) {
      throw_invalid("workspace: expected " + std::to_string(used_) + " bytes (" + size_query +
                    "), got " + std::to_string(base_ == nullptr ? 0 : capacity_));
    }
  }

  // Throws INVALID_ARGUMENT unless the base is kAlignment-aligned, which megamoe.h asks of
  // the one-GPU layer's callers.
  void require_aligned_base() const {
    if (reinterpret_cast<uintptr_t>(base_) % kAlignment != 0) {
      throw_invalid("workspace: expected a 256-byte aligned pointer");
    }
  }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
};

}  // namespace megamoe
