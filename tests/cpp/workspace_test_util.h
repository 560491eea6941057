// Checks of a carved workspace on the CPU: every piece 256-byte aligned, inside the
// workspace, and disjoint from every other (so each has room for its contents).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/workspace.h"

namespace megamoe_test {

// A device-like address the carver computes with and nobody dereferences.
inline void* const kFakeBase = reinterpret_cast<void*>(uintptr_t{1} << 40);

class Pieces {
 public:
  Pieces(const void* base, size_t bytes)
      : base_(reinterpret_cast<uintptr_t>(base)), bytes_(bytes) {}

  void add(const std::string& name, const void* p, int64_t bytes) {
    ASSERT_GE(bytes, 0) << name;
    if (bytes == 0) return;  // an empty piece may share its offset with the next one
    ASSERT_NE(p, nullptr) << name;
    pieces_.push_back({name, reinterpret_cast<uintptr_t>(p), static_cast<size_t>(bytes)});
  }

  void check() const {
    std::vector<Piece> sorted = pieces_;
    std::sort(sorted.begin(), sorted.end(),
              [](const Piece& a, const Piece& b) { return a.at < b.at; });
    for (size_t i = 0; i < sorted.size(); ++i) {
      const Piece& p = sorted[i];
      EXPECT_EQ((p.at - base_) % megamoe::WorkspaceCarver::kAlignment, 0u) << p.name;
      EXPECT_GE(p.at, base_) << p.name;
      EXPECT_LE(p.at + p.bytes, base_ + bytes_) << p.name << " ends outside the workspace";
      if (i + 1 < sorted.size()) {
        EXPECT_LE(p.at + p.bytes, sorted[i + 1].at)
            << p.name << " overlaps " << sorted[i + 1].name;
      }
    }
  }

 private:
  struct Piece {
    std::string name;
    uintptr_t at;
    size_t bytes;
  };
  uintptr_t base_;
  size_t bytes_;
  std::vector<Piece> pieces_;
};

}  // namespace megamoe_test
