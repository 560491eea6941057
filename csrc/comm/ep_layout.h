// Where the expert-parallel layer keeps everything, in one place: each rank's symmetric
// buffer (the same offsets on every rank, so a rank finds a peer's area at the peer's base
// plus the offset) and the device workspace of one call. Host code carves both
// (ep_layout.cpp, the size queries with the same code); the kernels of every phase
// (ep_plan.cu, ep_dispatch.cu, ep_combine.cu) take the buffer layout by value.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "chain/expert_chain.h"
#include "comm/peer_exchange.h"
#include "core/workspace.h"
#include "kernels/common/routing_plan.h"

namespace megamoe::ep {

struct Group {
  comm::PeerTable peers;
  int64_t num_experts;       // E, global; a multiple of world_size
  int64_t max_tokens;        // per rank and call
  int64_t topk;
  int64_t hidden;
  int64_t max_recv_rows;     // (token, expert) rows a rank can receive per call
  int64_t timeout_ns;
  int32_t comm_sms;          // SMs of the kernels that move rows between ranks; 0: all
  // The forward's L2 epilogue stores each result row into its source's slot area and the
  // source reduces there (docs/expert-parallel.md, "Forward overlap"), instead of the
  // owner's combine send. Every rank of a group must agree (it changes the buffer layout).
  bool epilogue_combine = false;
  // The forward (without saved h) lays each owner's rows out with its own rows first, runs
  // L1 and L2 on them straight from x while the peers' rows are dispatched on a side stream,
  // then on the peers' rows (docs/expert-parallel.md, "Forward overlap" (b)). Every rank of a
  // group must agree, and call with saved h all alike (the layout follows it).
  bool overlap_dispatch = false;
  // The backward moves rows on a side stream beside its GEMMs, whose grids are capped to
  // leave the copy blocks their SMs (docs/expert-parallel.md, "Backward overlap"): with
  // saved h, x's rows are dispatched after dy's, in a phase of their own, beside the L2
  // dgrad; and the dx rows go back beside the weight gradients. For the latter the bf16
  // backward keeps the dx rows in a buffer of their own (the bf16 weight gradients gather
  // into token_rows), which the workspace size counts; the FP8 one reads the token matrices
  // in place (unless the diagnostic MEGAMOE_FP8_UNFUSED_COLS: then the default order).
  // Every rank of a group must agree (x's rows arrive in another phase).
  bool overlap_backward = false;
  // The FP8 forward dispatches bf16 x rows and each owner quantizes the tokens it received,
  // instead of each rank quantizing its x once and dispatching e4m3 rows with their scales
  // (half the bytes). The same bits; kept for an A/B on the GPUs. Every rank of a group must
  // agree (the owner reads what the sources send).
  bool fp8_bf16_dispatch = false;
};

// Throws INVALID_ARGUMENT for a group the layer cannot run (rank, buffers, sizes).
void check_group(const Group& g);

constexpr int kPlanThreads = 256;  // tokens per block of the token plan
constexpr int kCopyThreads = 256;  // threads per block of the kernels that move rows
constexpr int kCopyBatch = 4;      // 16-byte loads a lane has in flight before it stores

// Each rank's symmetric buffer: byte offsets of its areas, and the sizes the kernels index
// them by. W ranks, T = max_tokens, R = max_recv_rows.
struct BufferLayout {
  size_t recv_x;             // bf16 [W * T, H] received tokens, a section per source
  // The FP8 forward's quantized dispatch keeps the received tokens in recv_x's bytes as
  // e4m3 [W * T, H] (from recv_x on) with their 1x128 scales, fp32 [H / 128, recv_x_scale_ld]
  // (the scale of token i's block j at [j * recv_x_scale_ld + i]) from recv_x_scales on:
  // W T H (1 + 4 / 128) bytes at most, within recv_x's 2 W T H.
  size_t recv_x_scales;
  int64_t recv_x_scale_ld;   // chain::fp8_scale_ld(W * T)
  size_t recv_dy;            // bf16 [W * T, H] their dy rows (backward)
  size_t recv_token_count;   // int32 [8] tokens received from each source in this call
  size_t recv_token_source;  // int32 [W * T] each received token's index on its source
  size_t recv_slot_row;      // int32 [W * T, k] row here of each slot, -1 elsewhere
  size_t recv_row_token;     // int32 [R] received token of each row here
  size_t recv_weight;        // fp32 [R] router weight of each row here
  size_t combine_rows;       // bf16 [W, T, H] each owner's partial sum per token
  size_t combine_dp;         // fp32 [T * k] d topk_weights of each slot (backward)
  // epilogue_combine only (0 bytes otherwise):
  size_t recv_row_dest;      // int32 [R] (source * T + token) * k + slot of each row here
  size_t combine_slot_rows;  // bf16 [T * k, H] each slot's L2 (backward: dx) row, from its owner
  size_t combine_slot_done;  // uint32 [T * k] columns of the slot's row stored so far
  int32_t epilogue_combine;
  int32_t hidden, topk, max_tokens;
  size_t control;            // comm::ControlLayout, at offset 0 where peer_exchange has it
  size_t error;              // int32 [2]: [0] 0, or a comm::describe_error code of this rank's
                             // last call; [1] the first such code since it was last zeroed
  size_t total;
};
BufferLayout buffer_layout(const Group& g);  // checks the group

// An area of a rank's buffer (`base`: that rank's buffer as this process sees it).
template <class T>
__host__ __device__ __forceinline__ T* at(char* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

enum class Pass { kForward, kBackward, kBackwardSavedH };

// One call's device workspace (caller-allocated, no initialisation). R = max_recv_rows.
struct CallWorkspace {
  RoutingPlanWorkspace local;        // this rank's slots over all E experts
  int32_t* recv_expert_offsets;      // [E/W + 1] the received rows' plan (with recv_row_token)
  int32_t* recv_tile_offsets;        // [E/W + 1]
  int32_t* send_base;                // [E] first row of this rank's rows of e on e's owner
  int32_t* skip;                     // [1] nonzero: over capacity, nothing is sent
  int32_t* token_pos;                // [T, W] each token's place among those sent to a rank
  int32_t* token_count;              // [8] tokens sent to each rank
  int32_t* block_counts;             // [token-plan blocks, W]
  chain::ForwardBuffers forward;     // forward: the chain over the R received rows
  // The overlapped forward: the plans of the own rows (rows 0.., their tokens in this
  // rank's x: own_row_token [R]) and of the peers' rows (after the own ones), [E/W + 1] each.
  int32_t* own_expert_offsets;
  int32_t* own_tile_offsets;
  int32_t* peer_expert_offsets;
  int32_t* peer_tile_offsets;
  int32_t* own_row_token;
  // [E/W] each: where L1 on either plan writes its rows of a saved h, in the default layout
  // the backward reads h in (sm90::HRowShift; comm/ep_plan.cu computes them).
  int32_t* own_h_shift;
  int32_t* peer_h_shift_lo;
  int32_t* peer_h_shift_hi;
  int32_t* peer_h_split;
  // Backward: [R] 0, 1, ...: each received row is its own slot (its router weight is
  // recv_weight[row]); [R] d topk_weights of each received row; the chain's buffers.
  int32_t* identity;
  float* dp_rows;
  chain::BackwardBuffers backward;
  // FP8 (a pass whose GEMMs quantize x or dy into the sorted rows): [W * max_tokens, k] the
  // received tokens' slot rows of this call (recv_slot_row, -1 past each source's count),
  // by which the chain writes each received token's e4m3 row to its rows.
  int32_t* fp8_slot_row;
  // The kFp8 forward's quantized dispatch (unless Group::fp8_bf16_dispatch): this rank's x
  // quantized once, e4m3 [T, H] with 1x128 scales, whose rows the dispatch sends instead of
  // x's (into recv_x / recv_x_scales); the owner's chain copies them into its sorted rows.
  bool fp8_dispatch = false;
  chain::Fp8Rows x_fp8_tokens;
};
// For T tokens on this rank, intermediate size I and the call's precision (kFp8Backward's
// forward is the bf16 one); the size query carves with a counting carver.
CallWorkspace carve_call(WorkspaceCarver& c, const Group& g, int64_t T, int64_t I, Pass pass,
                         chain::Precision precision = chain::Precision::kBf16);

// What the phases of one call share.
struct Call {
  Group g;
  BufferLayout buffer;
  CallWorkspace w;
  int64_t T;            // this rank's tokens
  int64_t e_local;      // experts per rank
  int32_t* error;       // this rank's error word
  int sms;
  int copy_blocks;      // of the kernels that move rows between ranks
  char* own() const { return g.peers.buffers[g.peers.rank]; }
};
Call begin_call(const Group& g, const CallWorkspace& w, int64_t T);

}  // namespace megamoe::ep
