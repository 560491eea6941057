// The phases of one expert-parallel call, in the order ep_layer.cpp runs them (the steps
// are numbered as in ep_layer.h). Each launches on `stream` only: no host sync.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/ep_layout.h"

namespace megamoe::ep {

// ep_plan.cu, steps 1-3: the local routing plan and the token plan, the counts exchange,
// the received rows' offsets, send_base and the capacity verdict (skip, and the error word).
// own_first (the overlapped forward, Group::overlap_dispatch): every owner's own rows first,
// then its peers' rows, with this rank's two plans in the workspace's own_* and peer_*
// (recv_expert_offsets then does not describe the rows).
void plan(const Call& c, const void* topk_ids, bool ids_are_int64, cudaStream_t stream,
          bool own_first = false);

// out[i] = i for i < n: the received rows' row -> slot map in the backward.
void fill_identity(const Call& c, int32_t* out, int64_t n, cudaStream_t stream);

// Which owners a dispatch serves: all; only this rank, metadata only (the overlapped
// forward's own rows, read from x in place: also writes w.own_row_token); or only the others.
enum class DispatchPart : int32_t { kAll, kSelf, kPeers };

// ep_dispatch.cu, step 4: each token's x row (and dy row, unless null) once to every rank
// that owns one of its experts, with its slots' rows, router weights and token there. With
// c.w.fp8_dispatch (the FP8 forward), the token's e4m3 row and scales from
// c.w.x_fp8_tokens (written on `stream` before) instead of its x row.
// Nothing is sent when the call is skipped. blocks: the grid (0: c.copy_blocks). x null:
// no x rows; metadata false: the rows alone, without the slots' rows, weights, tokens and
// counts (the overlapped backward sends dy with those first, x after them: the same bytes).
void dispatch(const Call& c, const __nv_bfloat16* x, const __nv_bfloat16* dy,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              cudaStream_t stream, DispatchPart part = DispatchPart::kAll, int blocks = 0,
              bool metadata = true);

// After the dispatch phase: out [W * max_tokens, k] = this call's recv_slot_row, -1 for the
// entries past each source's token count (whose recv_slot_row is a former call's) and for
// a skipped call. The FP8 chain writes each received token's e4m3 row by it.
void received_slot_rows(const Call& c, int32_t* out, cudaStream_t stream);

// ep_combine.cu, step 6: per received token, its rows of `rows` (this rank's results in
// received-row order) summed over its slots in slot order in fp32, weighted by
// row_weights (null: 1), rounded once to bf16, into its source's combine area; with
// dp_rows, also each slot's d topk_weights; the rows staged in shared memory by bulk copies,
// one block per SM (staged_row_sums.cuh). blocks: 0 for the call's SMs (c.copy_blocks / 2);
// else, beside a GEMM, the copy's 256-thread-block budget (two per copy SM), one block per
// copy SM. part: the tokens of every source, of this rank only, or of the others only (the
// overlapped forward sends the peers' partial sums while L2 runs on the own rows).
void combine_send(const Call& c, const __nv_bfloat16* rows, const float* row_weights,
                  const float* dp_rows, cudaStream_t stream, int blocks = 0,
                  DispatchPart part = DispatchPart::kAll);

// Step 7, after the combine phase: out [T, H] = the owners' partial rows summed in rank
// order; with d_topk_weights [T, k], each slot's value from its owner (0 for an id of -1).
void final_combine(const Call& c, __nv_bfloat16* out, float* d_topk_weights,
                   cudaStream_t stream);

// The epilogue combine's step 7 (Group::epilogue_combine), after this rank's L2 (backward:
// L1 dgrad) has been launched to its slots (slot_rows_to_peers in ep_layer.cpp): out [T, H]
// from the slots' rows that every owner's epilogue stored here, each token reduced once its
// slots are complete, as the one-GPU layer's combine does (every valid slot in slot order,
// in fp32, weighted by topk_weights or, null, by 1; rounded once): the one-GPU layer's y (dx),
// bit for bit, where the default path adds one bf16 rounding per owner. With
// d_topk_weights [T, k], also each valid slot's value that its owner's send_slot_dp stored
// here (0 for an id of -1). A slot still incomplete after the timeout sets the error word to
// its owner and phase 'combine rows'. Resets the slots' counters.
void final_combine_slots(const Call& c, const void* topk_ids, bool ids_are_int64,
                         const float* topk_weights, __nv_bfloat16* out, float* d_topk_weights,
                         cudaStream_t stream);

// The epilogue combine's backward, before the L1 dgrad sends the dx rows: each received
// row's d topk_weights (dp_rows [R], by received row) into its slot on its source. Nothing
// when the call is skipped.
void send_slot_dp(const Call& c, const float* dp_rows, cudaStream_t stream);

// A timeout of any rank of the group (its mark in this rank's group_failure word,
// comm::ControlLayout) into this rank's error words, when this rank's own call did not fail:
// the rows it received, or their sums, may come from a rank that went on after a timeout.
// After every kernel of the call that acquires a peer's signal or rows (a rank that times
// out marks every rank before its later sends and signals), before the call's poisons. The
// mark stays: every later call on these buffers fails too, on every rank.
void take_group_failure(const Call& c, cudaStream_t stream);

// NaN into out [n] (null: nothing) when the call failed, skipped over capacity or with this
// rank's error word set by a wait that timed out (its own, or another rank's taken by
// take_group_failure): such a call must not look like a result. Stream-ordered after every
// kernel of the call that can set the error word.
void poison_if_failed(const Call& c, __nv_bfloat16* out, int64_t n, cudaStream_t stream);
void poison_if_failed(const Call& c, float* out, int64_t n, cudaStream_t stream);

}  // namespace megamoe::ep
