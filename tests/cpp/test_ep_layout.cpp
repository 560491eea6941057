// The expert-parallel layout on the CPU: the symmetric buffer's areas (control area first,
// 256-byte aligned, disjoint, each as large as its contents, the sizes the kernels read),
// and one call's workspace in every pass (the same pieces whether counted or carved, and
// what the size functions report).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "comm/ep_layer.h"
#include "comm/ep_layout.h"
#include "kernels/common/gather_padded.h"
#include "megamoe/megamoe.h"
#include "workspace_test_util.h"

namespace {

using megamoe::WorkspaceCarver;
using megamoe::ep::Pass;
using megamoe_test::Pieces;
using megamoe_test::kFakeBase;

struct Sizes {
  int world, rank;
  int64_t E, max_tokens, k, H, R;
};

megamoe::ep::Group group_of(const Sizes& s) {
  megamoe::ep::Group g{};
  g.peers.rank = s.rank;
  g.peers.world_size = s.world;
  for (int r = 0; r < s.world; ++r) {
    g.peers.buffers[r] = reinterpret_cast<char*>(uintptr_t{1 + static_cast<unsigned>(r)} << 36);
  }
  g.num_experts = s.E;
  g.max_tokens = s.max_tokens;
  g.topk = s.k;
  g.hidden = s.H;
  g.max_recv_rows = s.R;
  g.timeout_ns = 1000;
  return g;
}

const Sizes kShapes[] = {{2, 1, 8, 300, 2, 256, 4800},
                         {2, 0, 16, 1000, 4, 512, 5000},
                         {4, 3, 64, 16384, 8, 2048, 262144},
                         {8, 5, 8, 0, 1, 128, 1}};

std::string name_of(const Sizes& s) {
  return "W=" + std::to_string(s.world) + " E=" + std::to_string(s.E) + " T=" +
         std::to_string(s.max_tokens) + " k=" + std::to_string(s.k) + " H=" +
         std::to_string(s.H) + " R=" + std::to_string(s.R);
}

// The pieces of a call's workspace that every pass and precision carves: the routing plans
// and the exchange's bookkeeping.
void add_plan_pieces(Pieces& pieces, const megamoe::ep::CallWorkspace& w, const Sizes& s,
                     int64_t T) {
  const int64_t W = s.world, e_local = s.E / W;
  const auto& plan = w.local.plan;
  pieces.add("expert_counts", plan.expert_counts, s.E * 4);
  pieces.add("expert_offsets", plan.expert_offsets, (s.E + 1) * 4);
  pieces.add("tile_offsets", plan.tile_offsets, (s.E + 1) * 4);
  pieces.add("row_token", plan.row_token, T * s.k * 4);
  pieces.add("row_slot", plan.row_slot, T * s.k * 4);
  pieces.add("slot_row", plan.slot_row, T * s.k * 4);
  pieces.add("invalid_count", plan.invalid_count, 4);
  pieces.add("plan scratch", w.local.scratch, megamoe::routing_plan_scratch_bytes(T * s.k, s.E));
  pieces.add("recv_expert_offsets", w.recv_expert_offsets, (e_local + 1) * 4);
  pieces.add("recv_tile_offsets", w.recv_tile_offsets, (e_local + 1) * 4);
  pieces.add("send_base", w.send_base, s.E * 4);
  pieces.add("skip", w.skip, 4);
  pieces.add("token_pos", w.token_pos, T * W * 4);
  pieces.add("token_count", w.token_count, megamoe::comm::kMaxRanks * 4);
  pieces.add("block_counts", w.block_counts,
             (T + megamoe::ep::kPlanThreads - 1) / megamoe::ep::kPlanThreads * W * 4);
}

TEST(EpLayout, BufferAreasAreDisjointAndSized) {
  for (const Sizes& s : kShapes) {
    SCOPED_TRACE(name_of(s));
    const megamoe::ep::Group g = group_of(s);
    const megamoe::ep::BufferLayout b = megamoe::ep::buffer_layout(g);
    const int64_t tokens = s.world * s.max_tokens;
    EXPECT_EQ(b.control, 0u) << "peer_exchange finds the control area at the buffer's start";
    // Offsets as addresses from a base of 1, so that the control area at offset 0 is not
    // taken for a null pointer.
    Pieces areas(reinterpret_cast<const void*>(1), b.total);
    const auto area = [&](const char* name, size_t offset, int64_t bytes) {
      areas.add(name, reinterpret_cast<const void*>(offset + 1), bytes);
    };
    area("control", b.control, megamoe::comm::ControlLayout::bytes(s.E));
    area("error", b.error, 8);  // int32 [2]: the last call's, the first failure's
    area("recv_x", b.recv_x, tokens * s.H * 2);
    area("recv_dy", b.recv_dy, tokens * s.H * 2);
    area("recv_token_count", b.recv_token_count, megamoe::comm::kMaxRanks * 4);
    area("recv_token_source", b.recv_token_source, tokens * 4);
    area("recv_slot_row", b.recv_slot_row, tokens * s.k * 4);
    area("recv_row_token", b.recv_row_token, s.R * 4);
    area("recv_weight", b.recv_weight, s.R * 4);
    area("combine_rows", b.combine_rows, tokens * s.H * 2);
    area("combine_dp", b.combine_dp, s.max_tokens * s.k * 4);
    areas.check();
    EXPECT_EQ(b.hidden, s.H);
    EXPECT_EQ(b.topk, s.k);
    EXPECT_EQ(b.max_tokens, s.max_tokens);

    // What the C ABI reports is this layout.
    const megamoe_ep_group abi{s.rank, s.world, {}, 0, s.E, s.max_tokens, s.k, s.H, s.R, 1000, 0};
    size_t bytes = 0, error = 0;
    ASSERT_EQ(megamoe_ep_buffer_size(&abi, &bytes), MEGAMOE_SUCCESS) << megamoe_last_error();
    ASSERT_EQ(megamoe_ep_error_offset(&abi, &error), MEGAMOE_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(bytes, b.total);
    EXPECT_EQ(error, b.error);
  }
}

TEST(EpLayout, CallWorkspaceOfEveryPass) {
  for (const Sizes& s : kShapes) {
    for (const int64_t T : {int64_t{0}, s.max_tokens / 2 + 1, s.max_tokens}) {
      if (T > s.max_tokens) continue;
      for (const int64_t I : {int64_t{128}, int64_t{1536}}) {
        // The backward overlap keeps the bf16 dx rows in a buffer of their own.
        for (const bool overlap_backward : {false, true}) {
          SCOPED_TRACE(name_of(s) + " tokens=" + std::to_string(T) + " I=" + std::to_string(I) +
                       (overlap_backward ? " overlap_backward" : ""));
          megamoe::ep::Group g = group_of(s);
          g.overlap_backward = overlap_backward;
          const int64_t W = s.world, e_local = s.E / W, R = s.R;
          for (const Pass pass : {Pass::kForward, Pass::kBackward, Pass::kBackwardSavedH}) {
            WorkspaceCarver counting;
            megamoe::ep::carve_call(counting, g, T, I, pass);
            WorkspaceCarver c(kFakeBase, counting.bytes());
            const megamoe::ep::CallWorkspace w = megamoe::ep::carve_call(c, g, T, I, pass);
            EXPECT_EQ(c.bytes(), counting.bytes());
            const size_t reported =
                pass == Pass::kForward
                    ? megamoe::ep::forward_workspace_bytes(g, T, I)
                    : megamoe::ep::backward_workspace_bytes(g, T, I, pass == Pass::kBackwardSavedH);
            EXPECT_EQ(reported, c.bytes());

            Pieces pieces(kFakeBase, c.bytes());
            add_plan_pieces(pieces, w, s, T);
            EXPECT_EQ(w.fp8_slot_row, nullptr);
            EXPECT_FALSE(w.fp8_dispatch);
            if (pass == Pass::kForward) {
              pieces.add("activation", w.forward.activation, R * I * 2);
              pieces.add("out", w.forward.out, R * s.H * 2);
              EXPECT_EQ(w.identity, nullptr);
              EXPECT_EQ(w.backward.dh, nullptr);
            } else {
              const int64_t P = megamoe::padded_rows_bound(R, e_local);
              EXPECT_EQ(w.backward.padded_rows, P);
              pieces.add("identity", w.identity, R * 4);
              pieces.add("dp_rows", w.dp_rows, R * 4);
              if (pass == Pass::kBackward) {
                pieces.add("h", w.backward.h, R * 2 * I * 2);
              } else {
                EXPECT_EQ(w.backward.h, nullptr);
              }
              pieces.add("dh", w.backward.dh, P * 2 * I * 2);
              pieces.add("a", w.backward.a, P * I * 2);
              pieces.add("dp_partial", w.backward.dp_partial, R * w.backward.dp_parts * 4);
              pieces.add("token_rows", w.backward.token_rows, P * s.H * 2);
              if (overlap_backward) {
                pieces.add("dx_rows", w.backward.dx_rows, R * s.H * 2);
              } else {
                EXPECT_EQ(w.backward.dx_rows, w.backward.token_rows);
              }
              EXPECT_EQ(w.forward.out, nullptr);
            }
            pieces.check();
          }
        }
      }
    }
  }
}

// The FP8 forward's quantized dispatch keeps the received tokens' e4m3 rows and their scales
// in recv_x's bytes (ep_layout.h).
TEST(EpLayout, QuantizedTokensFitInRecvX) {
  for (const Sizes& s : kShapes) {
    SCOPED_TRACE(name_of(s));
    const megamoe::ep::BufferLayout b = megamoe::ep::buffer_layout(group_of(s));
    const int64_t tokens = s.world * s.max_tokens;
    EXPECT_EQ(b.recv_x_scales, b.recv_x + tokens * s.H) << "the scales follow the e4m3 rows";
    EXPECT_EQ(b.recv_x_scales % 16, 0u);
    EXPECT_EQ(b.recv_x_scale_ld, megamoe::chain::fp8_scale_ld(tokens));
    EXPECT_GE(b.recv_x_scale_ld, tokens);
    EXPECT_EQ(b.recv_x_scale_ld % 4, 0);
    EXPECT_LE(b.recv_x_scales + s.H / 128 * b.recv_x_scale_ld * 4,
              b.recv_x + static_cast<size_t>(tokens * s.H * 2))
        << "the scales end past recv_x";
  }
}

// A call's workspace at the FP8 precisions: counted and carved alike, what the size functions
// report, and the FP8 pieces of the EP layer (the received tokens' slot rows; the forward's x
// quantized for the dispatch, unless Group::fp8_bf16_dispatch) disjoint from the others.
TEST(EpLayout, Fp8CallWorkspace) {
  using megamoe::chain::Precision;
  for (const Sizes& s : kShapes) {
    for (const int64_t T : {int64_t{0}, s.max_tokens}) {
      for (const Precision precision : {Precision::kFp8, Precision::kFp8Backward}) {
        for (const bool bf16_dispatch : {false, true}) {
          SCOPED_TRACE(name_of(s) + " tokens=" + std::to_string(T) +
                       (precision == Precision::kFp8 ? " fp8" : " fp8_bwd") +
                       (bf16_dispatch ? " bf16 dispatch" : ""));
          megamoe::ep::Group g = group_of(s);
          g.fp8_bf16_dispatch = bf16_dispatch;
          const int64_t I = 256, W = s.world, R = s.R;
          for (const Pass pass : {Pass::kForward, Pass::kBackward, Pass::kBackwardSavedH}) {
            WorkspaceCarver counting;
            megamoe::ep::carve_call(counting, g, T, I, pass, precision);
            WorkspaceCarver c(kFakeBase, counting.bytes());
            const megamoe::ep::CallWorkspace w = megamoe::ep::carve_call(c, g, T, I, pass, precision);
            EXPECT_EQ(c.bytes(), counting.bytes());
            const size_t reported =
                pass == Pass::kForward
                    ? megamoe::ep::forward_workspace_bytes(g, T, I, precision)
                    : megamoe::ep::backward_workspace_bytes(g, T, I, pass == Pass::kBackwardSavedH,
                                                            precision);
            EXPECT_EQ(reported, c.bytes());

            Pieces pieces(kFakeBase, c.bytes());
            add_plan_pieces(pieces, w, s, T);
            const bool fp8_rows = pass != Pass::kForward || precision == Precision::kFp8;
            if (fp8_rows) {
              pieces.add("fp8_slot_row", w.fp8_slot_row, W * s.max_tokens * s.k * 4);
            } else {
              EXPECT_EQ(w.fp8_slot_row, nullptr);
            }
            const bool quantized =
                pass == Pass::kForward && precision == Precision::kFp8 && !bf16_dispatch;
            EXPECT_EQ(w.fp8_dispatch, quantized);
            if (quantized) {
              EXPECT_EQ(w.x_fp8_tokens.scale_ld, megamoe::chain::fp8_scale_ld(T));
              pieces.add("x_fp8_tokens.q", w.x_fp8_tokens.q, T * s.H);
              pieces.add("x_fp8_tokens.scales", w.x_fp8_tokens.scales,
                         s.H / 128 * w.x_fp8_tokens.scale_ld * 4);
            } else {
              EXPECT_EQ(w.x_fp8_tokens.q, nullptr);
            }
            if (pass == Pass::kForward) {
              pieces.add("activation", w.forward.activation, R * I * 2);
              pieces.add("out", w.forward.out, R * s.H * 2);
            } else {
              const int64_t P = megamoe::padded_rows_bound(R, s.E / W);
              pieces.add("identity", w.identity, R * 4);
              pieces.add("dp_rows", w.dp_rows, R * 4);
              pieces.add("dh", w.backward.dh, P * 2 * I * 2);
              pieces.add("token_rows", w.backward.token_rows, P * s.H * 2);
              // The FP8 weight gradients leave token_rows alone: the backward overlap keeps
              // the dx rows there, in no more workspace.
              EXPECT_EQ(w.backward.dx_rows, w.backward.token_rows);
              megamoe::ep::Group overlapped = g;
              overlapped.overlap_backward = true;
              EXPECT_EQ(megamoe::ep::backward_workspace_bytes(
                            overlapped, T, I, pass == Pass::kBackwardSavedH, precision),
                        reported);
            }
            pieces.check();
          }
        }
      }
    }
  }
}

TEST(EpLayout, AreasAreAddressedFromEachRanksBase) {
  megamoe::ep::Group g = group_of(kShapes[0]);
  const megamoe::ep::BufferLayout b = megamoe::ep::buffer_layout(g);
  for (int r = 0; r < g.peers.world_size; ++r) {
    EXPECT_EQ(reinterpret_cast<char*>(megamoe::ep::at<float>(g.peers.buffers[r], b.recv_weight)),
              g.peers.buffers[r] + b.recv_weight);
  }
}

}  // namespace
