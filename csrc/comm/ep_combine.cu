// Steps 6 and 7 of an expert-parallel call (ep_layer.h lists them all): each owner's
// partial sums sent back to the tokens' ranks, and their sum there; and the poison of a
// call that failed (skipped over capacity, or a wait timed out).
#include <algorithm>

#include "comm/ep_phases.h"
#include "comm/partial_row_sums.cuh"
#include "comm/peer_sync.cuh"
#include "comm/staged_row_sums.cuh"
#include "core/cuda_check.h"
#include "kernels/common/bf16_row.cuh"
#include "kernels/common/kernel_preload.h"

namespace megamoe::ep {
namespace {

// 6. For each received token, the sum of its rows' results here (rows = this rank's
// expert-sorted outputs; forward: weighted by the router weight, backward: the dx rows,
// unweighted), over its slots in slot order in fp32, rounded once to bf16 and stored in its
// source's combine area at [this rank, token]; the backward also sends each slot's d
// topk_weights. One warp per received token at a time, its rows staged in shared memory by
// bulk copies (staged_row_sums.cuh), one block per SM; nothing when the call is skipped.
// The bits depend on neither the grid nor kMaxRows.
template <int kMaxRows>
__global__ void __launch_bounds__(StagedRowSums<kMaxRows>::kThreads, 1)
    combine_send_kernel(const __grid_constant__ comm::PeerTable peers,
                        const __grid_constant__ BufferLayout layout,
                        const __nv_bfloat16* __restrict__ rows,
                        const float* __restrict__ row_weights,  // null: 1
                        const float* __restrict__ dp_rows,      // null: forward
                        const int32_t* __restrict__ skip, DispatchPart part) {
  using Sums = StagedRowSums<kMaxRows>;
  extern __shared__ __align__(1024) uint8_t smem[];
  if (*skip) return;
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  const int lane = threadIdx.x % 32;
  char* own = peers.buffers[peers.rank];
  const int32_t* count = at<int32_t>(own, layout.recv_token_count);
  const int64_t tokens = int64_t(world) * layout.max_tokens;
  const int64_t warps = int64_t(gridDim.x) * Sums::kWarps;
  int64_t i = blockIdx.x * int64_t(Sums::kWarps) + threadIdx.x / 32;
  Sums::run(rows, H, k, smem, [&]() -> StagedToken {
    for (; i < tokens; i += warps) {
      const int source = static_cast<int>(i / layout.max_tokens);
      if (i - int64_t(source) * layout.max_tokens >= count[source]) continue;
      if (part != DispatchPart::kAll &&
          (source == peers.rank) != (part == DispatchPart::kSelf)) {
        continue;
      }
      const int64_t t = at<int32_t>(own, layout.recv_token_source)[i];
      const int32_t row = lane < k ? at<int32_t>(own, layout.recv_slot_row)[i * k + lane] : -1;
      const float weight = row >= 0 && row_weights != nullptr ? row_weights[row] : 1.f;
      char* dst = peers.buffers[source];
      if (dp_rows != nullptr && row >= 0) {
        at<float>(dst, layout.combine_dp)[t * k + lane] = dp_rows[row];
      }
      auto* out = at<__nv_bfloat16>(dst, layout.combine_rows) +
                  (int64_t(peers.rank) * layout.max_tokens + t) * H;
      i += warps;
      return {false, row, weight, out};
    }
    return {true, -1, 0.f, nullptr};
  });
  __threadfence_system();
}

constexpr int kFinalCombineChunks = 8;  // 16-byte loads a lane: a row of H = 2048 at once

// 7. y (backward: dx) of each of this rank's tokens: the owners' partial rows in rank order,
// summed in fp32 (partial_row_sums.cuh); with d_topk_weights, also each valid slot's value
// from its owner (0 for an id of -1). One warp per token, two blocks per SM.
__global__ void __launch_bounds__(kCopyThreads, 2)
    final_combine_kernel(const __grid_constant__ comm::PeerTable peers,
                         const __grid_constant__ BufferLayout layout,
                         const int32_t* __restrict__ token_pos,
                         const int32_t* __restrict__ slot_row, int64_t T,
                         __nv_bfloat16* __restrict__ out, float* __restrict__ d_topk_weights) {
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  const int lane = threadIdx.x % 32;
  const char* own = peers.buffers[peers.rank];
  const auto* partial = reinterpret_cast<const __nv_bfloat16*>(own + layout.combine_rows);
  const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t t = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
    sum_partial_rows<kFinalCombineChunks>(partial + t * H, int64_t(layout.max_tokens) * H,
                                          token_pos + t * world, world, H, out + t * H);
    if (d_topk_weights != nullptr && lane < k) {
      const int64_t s = t * k + lane;
      d_topk_weights[s] =
          slot_row[s] >= 0 ? reinterpret_cast<const float*>(own + layout.combine_dp)[s] : 0.f;
    }
  }
}

// 7, epilogue combine: y (backward: dx) of each of this rank's tokens from its slots' rows,
// which the owners' L2 (backward: L1 dgrad) epilogues stored here (one warp per token). Lane
// j waits for slot j's counter to reach H (all its N-tiles); the warp goes on when every
// valid slot is complete, or gives up after the timeout, when an earlier wait of this rank
// has failed (the error word is set) or when the group has (its failure word, peer_sync.cuh),
// so that a dead peer costs one timeout. Then the
// one-GPU layer's combine (fold_slot_pieces, bf16_row.cuh): from +0, the fma of every valid
// slot's row in slot order, in fp32 (backward: weight 1), rounded once to bf16;
// the backward also takes each valid slot's d topk_weights from combine_dp (0 for an id of
// -1). A row's GEMM results do not depend on where it was computed, so y and dx are bitwise
// the one-GPU layer's, whatever owners hold the slots; the default path's per-owner
// partials cannot be (fp32 sums do not regroup), and sending every slot's row is what this
// costs (docs/expert-parallel.md, "Bits"). The grid is one block per SM at most: under
// emulation a spinning rank must leave whole SMs to its peers' GEMMs.
constexpr int kExactBatch = 8;  // slots whose rows a lane loads together (combine_rows' group)

template <class Id>
__global__ void __launch_bounds__(kCopyThreads)
    final_combine_slots_kernel(const __grid_constant__ comm::PeerTable peers,
                               const __grid_constant__ BufferLayout layout,
                               const Id* __restrict__ topk_ids,
                               const float* __restrict__ topk_weights,  // null: 1 (dx)
                               const int32_t* __restrict__ slot_row, int64_t T,
                               int32_t experts_per_rank, const int32_t* __restrict__ skip,
                               int64_t timeout_ns, int32_t* error,
                               __nv_bfloat16* __restrict__ out,
                               float* __restrict__ d_topk_weights) {
  if (*skip) return;
  const int k = layout.topk, H = layout.hidden;
  const int lane = threadIdx.x % 32;
  char* own = peers.buffers[peers.rank];
  // Written by other GPUs during this kernel: plain (coherent) loads after the acquire, not
  // the read-only path.
  const __nv_bfloat16* slot_rows = at<const __nv_bfloat16>(own, layout.combine_slot_rows);
  uint32_t* done = at<uint32_t>(own, layout.combine_slot_done);
  const volatile int32_t* error_word = error;
  const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t t = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
    int owner = -1;  // this lane's slot's owner rank; -1: no slot or no expert
    float weight = 0.f;
    if (lane < k && slot_row[t * k + lane] >= 0) {
      owner = static_cast<int>(static_cast<int64_t>(topk_ids[t * k + lane]) / experts_per_rank);
      weight = topk_weights != nullptr ? topk_weights[t * k + lane] : 1.f;
    }
    uint32_t* my_done = owner >= 0 ? done + t * k + lane : nullptr;
    bool complete = owner < 0;
    const uint64_t start = comm::global_time_ns();
    while (true) {
      if (!complete) complete = comm::load_acquire_sys(my_done) >= static_cast<uint32_t>(H);
      if (__all_sync(0xffffffffu, complete)) break;
      const int32_t mark = comm::group_failure(peers);
      const bool give_up = mark != 0 || *error_word != 0 ||
                           comm::global_time_ns() - start > static_cast<uint64_t>(timeout_ns);
      if (__any_sync(0xffffffffu, give_up)) {
        if (!complete && mark != 0) {
          comm::join_group_failure(peers, error, mark);
        } else if (!complete) {
          comm::record_timeout(peers, error, comm::error_code(comm::Phase::kCombineRows, owner));
        }
        break;
      }
      // Fewer polls while the rows are in flight: the owners' GEMMs share this memory (and,
      // emulated, this GPU's L2).
      __nanosleep(128);
    }
    __syncwarp();  // every lane's reads below after every lane's acquire

    // Every lane runs every pass (the shuffles need the whole warp).
    for (int c0 = 0; c0 < H; c0 += 32 * 8) {
      const int c = c0 + lane * 8;
      const bool in_row = c < H;
      const uint4 sum = fold_slot_pieces<kExactBatch>(k, [&](int j, float& w, uint4& v) {
        const int slot_owner = __shfl_sync(0xffffffffu, owner, j % 32);
        w = __shfl_sync(0xffffffffu, weight, j % 32);
        const bool used = j < k && slot_owner >= 0 && in_row;
        if (used) v = *reinterpret_cast<const uint4*>(slot_rows + (t * k + j) * H + c);
        return used;
      });
      if (in_row) *reinterpret_cast<uint4*>(out + t * H + c) = sum;
    }
    if (d_topk_weights != nullptr && lane < k) {
      // Stored by the slot's owner before the rows whose count was acquired above.
      d_topk_weights[t * k + lane] =
          owner >= 0 ? at<const float>(own, layout.combine_dp)[t * k + lane] : 0.f;
    }
    // Ready for the next call: no owner adds to it before this rank's next dispatch phase.
    if (my_done != nullptr) *my_done = 0;
  }
  __threadfence_system();  // the resets, before the next phase kernel's release signal
}

// The epilogue combine's backward: each received row's d topk_weights into its slot of its
// source's combine_dp (recv_row_dest, as the dx rows go), one thread per row. Ends with a
// system fence: the L1 dgrad's epilogue, launched after this kernel, then releases the
// slot's counter that the source acquires before it reads the value. Rows past the received
// ones have a former call's recv_row_dest and are not read.
__global__ void __launch_bounds__(kCopyThreads)
    send_slot_dp_kernel(const __grid_constant__ comm::PeerTable peers,
                        const __grid_constant__ BufferLayout layout,
                        const float* __restrict__ dp_rows,
                        const int32_t* __restrict__ received, int64_t e_local,
                        const int32_t* __restrict__ skip) {
  if (*skip) return;
  char* own = peers.buffers[peers.rank];
  const int32_t* dest = at<const int32_t>(own, layout.recv_row_dest);
  const int64_t slots = int64_t(layout.max_tokens) * layout.topk;
  const int64_t rows = received[e_local];
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t d = dest[r];
    if (d < 0) continue;
    const int source = static_cast<int>(d / slots);
    at<float>(peers.buffers[source], layout.combine_dp)[d - source * slots] = dp_rows[r];
  }
  __threadfence_system();
}

// A call that failed must not look like a result: skipped over capacity, or with a wait that
// timed out (its rows partly missing).
template <class T>
__global__ void poison_if_failed_kernel(T* out, int64_t n, const int32_t* skip,
                                        const int32_t* error) {
  if (*skip == 0 && *error == 0) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = T(__int_as_float(0x7fc00000));
  }
}

// The group's first timeout (peer_sync.cuh's record_timeout) into this rank's error words.
// One thread, before the call's poisons, so that all of them read one verdict: the mark may
// still arrive while they run (a peer failing later), and an output must not end half NaN.
__global__ void take_group_failure_kernel(const int32_t* group_failure, int32_t* error) {
  const int32_t mark = *reinterpret_cast<const volatile int32_t*>(group_failure);
  if (mark != 0) comm::record_failure(error, mark);
}

template <class T>
void poison(const Call& c, T* out, int64_t n, cudaStream_t stream) {
  if (out == nullptr || n == 0) return;
  poison_if_failed_kernel<T><<<c.sms, 256, 0, stream>>>(out, n, c.w.skip, c.error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&combine_send_kernel<8>) &&
    register_kernel_module(&combine_send_kernel<16>);

template <int kMaxRows>
void launch_combine_send(const Call& c, const __nv_bfloat16* rows, const float* row_weights,
                         const float* dp_rows, cudaStream_t stream, int sms, DispatchPart part) {
  constexpr int kBytes = StagedRowSums<kMaxRows>::kSharedBytes;
  auto* kernel = &combine_send_kernel<kMaxRows>;
  MEGAMOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<sms, StagedRowSums<kMaxRows>::kThreads, kBytes, stream>>>(
      c.g.peers, c.buffer, rows, row_weights, dp_rows, c.w.skip, part);
}

}  // namespace

void combine_send(const Call& c, const __nv_bfloat16* rows, const float* row_weights,
                  const float* dp_rows, cudaStream_t stream, int blocks, DispatchPart part) {
  // One block per SM: the copy SMs beside a GEMM (`blocks` counts two 256-thread blocks per
  // copy SM, as the other copy kernels' launches), or every SM of the call.
  const int sms = std::max(1, (blocks > 0 ? blocks : c.copy_blocks) / 2);
  if (c.buffer.topk <= 8) {
    launch_combine_send<8>(c, rows, row_weights, dp_rows, stream, sms, part);
  } else {
    launch_combine_send<16>(c, rows, row_weights, dp_rows, stream, sms, part);
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void final_combine(const Call& c, __nv_bfloat16* out, float* d_topk_weights,
                   cudaStream_t stream) {
  if (c.T == 0) return;
  final_combine_kernel<<<c.copy_blocks, kCopyThreads, 0, stream>>>(
      c.g.peers, c.buffer, c.w.token_pos, c.w.local.plan.slot_row, c.T, out, d_topk_weights);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void final_combine_slots(const Call& c, const void* topk_ids, bool ids_are_int64,
                         const float* topk_weights, __nv_bfloat16* out, float* d_topk_weights,
                         cudaStream_t stream) {
  if (c.T == 0) return;
  const auto launch = [&](auto* ids) {
    final_combine_slots_kernel<<<c.sms, kCopyThreads, 0, stream>>>(
        c.g.peers, c.buffer, ids, topk_weights, c.w.local.plan.slot_row, c.T,
        static_cast<int32_t>(c.e_local), c.w.skip, c.g.timeout_ns, c.error, out,
        d_topk_weights);
  };
  if (ids_are_int64) {
    launch(static_cast<const int64_t*>(topk_ids));
  } else {
    launch(static_cast<const int32_t*>(topk_ids));
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void take_group_failure(const Call& c, cudaStream_t stream) {
  if (c.g.peers.world_size == 1) return;  // no peer to wait for
  take_group_failure_kernel<<<1, 1, 0, stream>>>(
      at<const int32_t>(c.own(), comm::ControlLayout::kGroupFailure), c.error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void send_slot_dp(const Call& c, const float* dp_rows, cudaStream_t stream) {
  send_slot_dp_kernel<<<c.sms, kCopyThreads, 0, stream>>>(
      c.g.peers, c.buffer, dp_rows, c.w.recv_expert_offsets, c.e_local, c.w.skip);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void poison_if_failed(const Call& c, __nv_bfloat16* out, int64_t n, cudaStream_t stream) {
  poison(c, out, n, stream);
}
void poison_if_failed(const Call& c, float* out, int64_t n, cudaStream_t stream) {
  poison(c, out, n, stream);
}

}  // namespace megamoe::ep
