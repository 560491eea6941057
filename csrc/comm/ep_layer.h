// The fused layer with expert parallelism over the GPUs of one node: token rows move to
// their experts' ranks and results come back by peer stores, in kernels of their own around
// the expert chain (chain/expert_chain.h, the one-GPU layer's), with the counts exchanged
// and every hand-off signalled on the device (no host sync).
//
// Rank r of W owns global experts [r * E_local, (r + 1) * E_local). A call:
//   1. local routing plan over all E experts (rows sorted by global expert, stable), and
//      the token plan: which ranks each token goes to, its place among the tokens sent there;
//   2. counts exchanged (peer_exchange.h): every rank has the [W, E] matrix;
//   3. layout (one block): this rank's receive offsets per local expert (rows from rank 0,
//      then 1, ...: the global token order, the one-GPU layer's row order), where its rows
//      go in every owner's expert-sorted rows, and the capacity check;
//   4. dispatch: each token once per owner rank (not once per slot: with k = 8 over 2
//      ranks that moves 4x fewer bytes): the x row (backward: and the dy row; the FP8
//      forward: x quantized once on its rank, the e4m3 row and its 1x128 scales, half the
//      bytes) into the source's section of the owner's received tokens, with, per slot
//      there, its owner row, router weight and token; signal;
//   5. the expert chain on the received rows (A gathered from the received tokens; in FP8
//      each received token's e4m3 row copied into its rows, or in the FP8 backward each
//      received token quantized once into its rows, by this call's slot rows);
//   6. combine send: per received token, its rows' results summed in fp32 over its slots
//      (forward: weighted), rounded to bf16 once, into the source's combine area at [this
//      rank, token]; the backward also sends each slot's d topk_weights; signal;
//   7. the source sums the owners' partial rows in rank order -> y (backward: dx).
// With Group::epilogue_combine the forward's steps 6-7 are instead: L2's epilogue stores
// each result row into its slot in the source's buffer and counts it there; the source
// waits per slot and reduces each token as the one-GPU layer does (y bitwise the one-GPU
// layer's), with no combine send and no combine phase (docs/expert-parallel.md, "Forward
// overlap", "Bits"). The backward likewise: each slot's d topk_weights, then its dx row from
// the L1 dgrad's epilogue (dx bitwise the one-GPU layer's). At every precision.
// With Group::overlap_dispatch the forward lays every owner's own rows out first: L1 runs
// on them straight from x (never copied) while the peers' rows are dispatched on a second
// stream; then L1 and L2 on the peers' rows; then L2 on the own rows while the peers'
// partial sums go back on the second stream (the same bits: a row's results do not depend
// on where it sits). A saved h is written in the default layout.
// Steps 1-3 are ep_plan.cu, 4 ep_dispatch.cu, 6-7 ep_combine.cu, around the layout of
// ep_layout.h; ep_layer.cpp runs them. Weight gradients stay on the owner and d
// topk_weights is per slot: both are bitwise equal to the one-GPU layer's (an expert's rows
// arrive in the global token order, so the chain sees them as the one-GPU layer does); y
// and dx add one bf16 rounding per owner (the partial sum), except with the epilogue
// combine.
// A rank that would receive more rows than max_recv_rows makes every rank skip the sends
// (they all see the same counts) and write NaN into every output, with a capacity error
// code.
//
// Reuse without a reset: a rank cannot start a call's sends into a peer before that peer
// has passed the previous call's combine phase, which it signals only after its kernels
// have read its receive area for that call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "chain/expert_chain.h"
#include "comm/ep_layout.h"

namespace megamoe::ep {

// Device workspace of one call (caller-allocated, no initialisation) at `precision` (the
// experts' of the call).
size_t forward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                               chain::Precision precision = chain::Precision::kBf16);
// h_saved: the backward takes the forward's saved h instead of recomputing L1.
size_t backward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                                bool h_saved,
                                chain::Precision precision = chain::Precision::kBf16);

// x [T, H] bf16, topk_ids [T, k] int32/int64 global ids in [-1, E), topk_weights [T, k]
// fp32, w_gate_up [E_local, 2I, H], w_down [E_local, H, I] bf16; y [T, H] bf16. saved_h:
// null, or bf16 [max_recv_rows, 2I] that receives h = [gate | up] of the rows this rank
// computes, for a backward in saved mode. Collective: every rank of the group calls it
// with the same E, H, I, k.
void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t I, __nv_bfloat16* y,
             __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream);
// The same with the experts' weights at their precision (experts.hidden must be the
// group's): blockwise FP8 (kFp8: the forward's GEMMs in FP8, with the weights' FP8 copies)
// runs the chain's FP8 GEMMs on the received rows. Each rank quantizes its x once and the
// dispatch moves the e4m3 rows and scales, which the owner copies into its sorted rows
// (with Group::fp8_bf16_dispatch: the bf16 rows, each received token quantized once into
// its rows on the owner; the same bits). The epilogue combine applies as in bf16; the
// overlapped dispatch does not (bf16 only).
void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const chain::Experts& experts, int64_t T,
             __nv_bfloat16* y, __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream);

// The second stream of the overlapped forward (Group::overlap_dispatch) of g's rank on the
// current device: by default the library makes one at the rank's first overlapped call and
// keeps it for the process. set_side_stream(g, side) makes it `side` from the next call on
// (a stream the library made for the rank is destroyed; the caller keeps `side` alive and
// on the current device while it is set); set_side_stream(g, nullptr) forgets it (the next
// call makes one again). Not while a call of the rank is being issued. For callers that must
// know which streams share a device's hardware queues: the ranks emulated on one GPU
// (tests/cpp/multi_gpu_test_util.h).
void set_side_stream(const Group& g, cudaStream_t side);

// Writes dx [T, H] bf16 and d_topk_weights [T, k] fp32 (0 for an id of -1), and this
// rank's experts' d_w_gate_up [E_local, 2I, H] and d_w_down [E_local, H, I] (zeros, or
// nothing added, for experts without rows). saved_h: null to recompute L1 on the owner
// from the dispatched x rows, or the h that forward() wrote for the same routing.
void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t T, int64_t I,
              const __nv_bfloat16* saved_h, __nv_bfloat16* dx, float* d_topk_weights,
              chain::WeightGrad d_w_gate_up, chain::WeightGrad d_w_down, void* workspace,
              size_t workspace_size, cudaStream_t stream);
// The same with the experts' weights at their precision: kFp8 and kFp8Backward run the
// backward's GEMMs in FP8 (kFp8 recomputes L1 in FP8 without saved h), on the owner,
// with the weight gradients' operands quantized per 128 tokens from the dispatched bf16
// rows, as on one GPU.
void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const chain::Experts& experts, int64_t T, const __nv_bfloat16* saved_h,
              __nv_bfloat16* dx, float* d_topk_weights, chain::WeightGrad d_w_gate_up,
              chain::WeightGrad d_w_down, void* workspace, size_t workspace_size,
              cudaStream_t stream);

}  // namespace megamoe::ep
