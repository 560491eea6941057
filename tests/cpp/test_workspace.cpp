// The workspace carver and the carvings built on it (routing plan, expert chain, one-GPU
// layer), on the CPU: a counting carver and a carving one agree on every size, pieces are
// 256-byte aligned, disjoint and as large as their contents, and a workspace that is too
// small or misaligned is an error naming the size query. The carver never dereferences its
// base, so the carvings are checked against fake device addresses.
#include <algorithm>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "chain/expert_chain.h"
#include "core/error.h"
#include "core/workspace.h"
#include "fused/layer.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/routing_plan.h"
#include "workspace_test_util.h"

namespace {

using megamoe::WorkspaceCarver;
using megamoe_test::Pieces;
using megamoe_test::kFakeBase;

std::string error_of(const auto& f) {
  try {
    f();
  } catch (const megamoe::Error& e) {
    EXPECT_EQ(e.status(), MEGAMOE_ERROR_INVALID_ARGUMENT);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(WorkspaceCarver, CountsAndCarvesTheSameAlignedPieces) {
  const std::vector<int64_t> counts = {1, 0, 300, 64, 65, 0, 1000, 7};
  WorkspaceCarver counting;
  for (int64_t n : counts) EXPECT_EQ(counting.take<float>(n), nullptr);
  char* base = static_cast<char*>(kFakeBase);
  WorkspaceCarver carving(base, counting.bytes());
  size_t expected_offset = 0;
  for (int64_t n : counts) {
    const float* p = carving.take<float>(n);
    EXPECT_EQ(reinterpret_cast<const char*>(p) - base, static_cast<ptrdiff_t>(expected_offset));
    expected_offset += (n * sizeof(float) + 255) / 256 * 256;
  }
  EXPECT_EQ(carving.bytes(), counting.bytes());
  EXPECT_EQ(carving.bytes(), expected_offset);
  EXPECT_EQ(carving.bytes() % WorkspaceCarver::kAlignment, 0u);
  carving.require_fits("the_size_query");  // exactly enough
  carving.require_aligned_base();
}

TEST(WorkspaceCarver, OffsetsForLayoutsOfSeveralAddressSpaces) {
  WorkspaceCarver c;
  EXPECT_EQ(c.take_bytes(1), 0u);
  EXPECT_EQ(c.take_bytes(256), 256u);
  EXPECT_EQ(c.take_bytes(0), 512u);
  EXPECT_EQ(c.take_bytes(257), 512u);
  EXPECT_EQ(c.bytes(), 1024u);
}

TEST(WorkspaceCarver, TooSmallNullOrMisalignedWorkspacesAreErrors) {
  const auto carve_into = [](void* base, size_t capacity) {
    WorkspaceCarver c(base, capacity);
    c.take<int32_t>(100);  // 512 bytes with the alignment
    return c;
  };
  const std::string small = error_of([&] { carve_into(kFakeBase, 511).require_fits("q_size"); });
  EXPECT_NE(small.find("expected 512 bytes (q_size), got 511"), std::string::npos) << small;
  const std::string null = error_of([&] { carve_into(nullptr, 4096).require_fits("q_size"); });
  EXPECT_NE(null.find("got 0"), std::string::npos) << null;
  void* misaligned = static_cast<char*>(kFakeBase) + 16;
  carve_into(misaligned, 512).require_fits("q_size");  // big enough: only the alignment fails
  const std::string unaligned =
      error_of([&] { carve_into(misaligned, 512).require_aligned_base(); });
  EXPECT_NE(unaligned.find("256-byte aligned"), std::string::npos) << unaligned;
  error_of([] { WorkspaceCarver().take<float>(-1); });
}

TEST(RoutingPlanWorkspace, EveryArrayAndTheScratchHaveTheirOwnPiece) {
  for (const auto& [slots, experts] : {std::pair<int64_t, int64_t>{0, 1}, {600, 8}, {131072, 128},
                                       {7, 1024}}) {
    WorkspaceCarver counting;
    carve_routing_plan(counting, slots, experts);
    WorkspaceCarver c(kFakeBase, counting.bytes());
    const megamoe::RoutingPlanWorkspace w = carve_routing_plan(c, slots, experts);
    EXPECT_EQ(c.bytes(), counting.bytes());
    Pieces pieces(kFakeBase, c.bytes());
    pieces.add("expert_counts", w.plan.expert_counts, experts * 4);
    pieces.add("expert_offsets", w.plan.expert_offsets, (experts + 1) * 4);
    pieces.add("tile_offsets", w.plan.tile_offsets, (experts + 1) * 4);
    pieces.add("row_token", w.plan.row_token, slots * 4);
    pieces.add("row_slot", w.plan.row_slot, slots * 4);
    pieces.add("slot_row", w.plan.slot_row, slots * 4);
    pieces.add("invalid_count", w.plan.invalid_count, 4);
    pieces.add("scratch", w.scratch, megamoe::routing_plan_scratch_bytes(slots, experts));
    pieces.check();
  }
}

TEST(ExpertChainWorkspace, ForwardAndBackwardBuffers) {
  struct Shape {
    int64_t rows, experts, H, I;
  };
  for (const Shape s : {Shape{600, 8, 256, 128}, Shape{4000, 16, 512, 384}, Shape{1, 1, 128, 128},
                        Shape{131072, 128, 2048, 1536}}) {
    SCOPED_TRACE(std::to_string(s.rows) + " rows, E=" + std::to_string(s.experts) +
                 ", H=" + std::to_string(s.H) + ", I=" + std::to_string(s.I));
    WorkspaceCarver counting;
    megamoe::chain::carve_forward(counting, s.rows, s.rows, s.H, s.I);
    WorkspaceCarver c(kFakeBase, counting.bytes());
    const megamoe::chain::ForwardBuffers f =
        megamoe::chain::carve_forward(c, s.rows, s.rows, s.H, s.I);
    EXPECT_EQ(c.bytes(), counting.bytes());
    Pieces forward(kFakeBase, c.bytes());
    forward.add("activation", f.activation, s.rows * s.I * 2);
    forward.add("out", f.out, s.rows * s.H * 2);
    forward.check();

    const int64_t P = megamoe::padded_rows_bound(s.rows, s.experts);
    size_t recompute_bytes = 0;
    for (const bool saved : {false, true}) {
      WorkspaceCarver count_b;
      megamoe::chain::carve_backward(count_b, s.rows, s.rows, s.experts, s.H, s.I, saved);
      WorkspaceCarver cb(kFakeBase, count_b.bytes());
      const megamoe::chain::BackwardBuffers b =
          megamoe::chain::carve_backward(cb, s.rows, s.rows, s.experts, s.H, s.I, saved);
      EXPECT_EQ(cb.bytes(), count_b.bytes());
      EXPECT_EQ(b.padded_rows, P);
      EXPECT_EQ(b.dp_parts, s.I % 256 == 0 ? s.I / 256 : s.I / 128);  // one per N-tile of I
      Pieces backward(kFakeBase, cb.bytes());
      if (saved) {
        EXPECT_EQ(b.h, nullptr) << "saved mode reads the forward's h";
        // Saved mode needs exactly the recomputed h's piece less.
        EXPECT_EQ(recompute_bytes - cb.bytes(), (s.rows * 2 * s.I * 2 + 255) / 256 * 256);
      } else {
        backward.add("h", b.h, s.rows * 2 * s.I * 2);
        recompute_bytes = cb.bytes();
      }
      backward.add("dh", b.dh, P * 2 * s.I * 2);
      backward.add("a", b.a, P * s.I * 2);
      backward.add("dp_partial", b.dp_partial, s.rows * b.dp_parts * 4);
      backward.add("token_rows", b.token_rows, P * s.H * 2);
      backward.check();
    }
  }
}

TEST(FusedWorkspace, IsThePlanThenTheChainsBuffers) {
  for (const auto& [T, k, H, I, E] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{300, 2, 256, 128, 8},
        {0, 4, 128, 128, 4}, {16384, 8, 2048, 1536, 128}}) {
    WorkspaceCarver forward, backward, backward_saved;
    megamoe::carve_routing_plan(forward, T * k, E);
    megamoe::chain::carve_forward(forward, T * k, T, H, I);
    megamoe::carve_routing_plan(backward, T * k, E);
    megamoe::chain::carve_backward(backward, T * k, T, E, H, I, false);
    megamoe::carve_routing_plan(backward_saved, T * k, E);
    megamoe::chain::carve_backward(backward_saved, T * k, T, E, H, I, true);
    EXPECT_EQ(megamoe::fused::forward_workspace_bytes(T, k, H, I, E), forward.bytes());
    EXPECT_EQ(megamoe::fused::backward_workspace_bytes(T, k, H, I, E, false), backward.bytes());
    EXPECT_EQ(megamoe::fused::backward_workspace_bytes(T, k, H, I, E, true),
              backward_saved.bytes());
    size_t abi_bytes = 0;
    ASSERT_EQ(megamoe_fused_backward_workspace_size(T, k, H, I, E, 1, &abi_bytes),
              MEGAMOE_SUCCESS);
    EXPECT_EQ(abi_bytes, backward_saved.bytes());
  }
  error_of([] { megamoe::fused::forward_workspace_bytes(1, 17, 128, 128, 4); });
}

// The FP8 buffers: every piece sized for its matrix and scales, none overlapping another,
// but for the sorted FP8 rows of x and dy, which live in the bytes of a bf16 buffer written
// after they are read (the forward's out, the backward's token_rows).
TEST(ChainWorkspace, Fp8PiecesAreDisjointAndSized) {
  using megamoe::chain::Precision;
  const int64_t E = 16, I = 384;
  const auto ld = [](int64_t n) { return (n + 3) / 4 * 4; };
  // Bytes of an FP8 copy of n rows of H and of the bf16 buffer that holds it.
  const auto fp8_bytes = [&](int64_t n, int64_t H) {
    return (n * H + 255) / 256 * 256 + H / 128 * ld(n) * 4;
  };
  // (rows, tokens, H); one row of 128: the FP8 copy (with its scales) is larger than out.
  for (const auto& [rows, tokens, H] :
       {std::tuple<int64_t, int64_t, int64_t>{4000, 500, 512}, {1, 1, 128}}) {
    SCOPED_TRACE("rows=" + std::to_string(rows) + " H=" + std::to_string(H));
    WorkspaceCarver counting;
    megamoe::chain::carve_forward(counting, rows, tokens, H, I, Precision::kFp8);
    WorkspaceCarver c(kFakeBase, counting.bytes());
    const auto f = megamoe::chain::carve_forward(c, rows, tokens, H, I, Precision::kFp8);
    const int64_t out_bytes = std::max(rows * H * 2, fp8_bytes(rows, H));
    Pieces forward(kFakeBase, c.bytes());
    forward.add("activation", f.activation, rows * I * 2);
    forward.add("out (and x's FP8 rows before it)", f.out, out_bytes);
    forward.add("activation q", f.activation_fp8.q, rows * I);
    forward.add("activation scales", f.activation_fp8.scales, I / 128 * ld(rows) * 4);
    forward.check();
    Pieces in_out(f.out, out_bytes);
    in_out.add("x q", f.x_fp8.q, rows * H);
    in_out.add("x scales", f.x_fp8.scales, H / 128 * ld(rows) * 4);
    in_out.check();
    EXPECT_EQ(f.x_fp8.scale_ld, ld(rows));
  }

  const int64_t rows = 4000, tokens = 500, H = 512;
  for (const Precision precision : {Precision::kFp8, Precision::kFp8Backward}) {
    WorkspaceCarver count_b;
    megamoe::chain::carve_backward(count_b, rows, tokens, E, H, I, false, precision);
    WorkspaceCarver cb(kFakeBase, count_b.bytes());
    const auto b = megamoe::chain::carve_backward(cb, rows, tokens, E, H, I, false, precision);
    const int64_t P = b.padded_rows;
    EXPECT_EQ(b.dp_parts, I / 128);  // the FP8 tiles are 128 wide
    Pieces backward(kFakeBase, cb.bytes());
    backward.add("h", b.h, rows * 2 * I * 2);
    backward.add("dh", b.dh, P * 2 * I * 2);
    backward.add("a", b.a, P * I * 2);
    backward.add("dp_partial", b.dp_partial, rows * b.dp_parts * 4);
    backward.add("token_rows (and the FP8 rows of x, then dy, before them)", b.token_rows,
                 P * H * 2);
    backward.add("dh q", b.dh_fp8.q, P * 2 * I);
    backward.add("dh scales", b.dh_fp8.scales, 2 * I / 128 * P * 4);
    backward.add("lhs q", b.lhs_fp8.q, std::max(H, 2 * I) * P);
    backward.add("lhs scales", b.lhs_fp8.scales, P / 128 * std::max(H, 2 * I) * 4);
    backward.add("rhs q", b.rhs_fp8.q, std::max(I, H) * P);
    backward.add("rhs scales", b.rhs_fp8.scales, P / 128 * std::max(I, H) * 4);
    backward.check();
    Pieces in_token_rows(b.token_rows, P * H * 2);
    in_token_rows.add("dy q", b.dy_fp8.q, rows * H);
    in_token_rows.add("dy scales", b.dy_fp8.scales, H / 128 * ld(rows) * 4);
    in_token_rows.check();
    EXPECT_EQ(b.dy_fp8.scale_ld, ld(rows));
    if (precision == Precision::kFp8) {
      EXPECT_EQ(b.x_fp8.q, b.dy_fp8.q) << "x's copy is dead once L1 is recomputed";
      EXPECT_EQ(b.x_fp8.scales, b.dy_fp8.scales);
    } else {
      EXPECT_EQ(b.x_fp8.q, nullptr) << "fp8_bwd recomputes L1 in bf16";
    }
  }
}

}  // namespace
