// Step 4 of an expert-parallel call (ep_layer.h lists them all): every token's rows to the
// ranks that own its experts, by peer stores.
#include <algorithm>
#include <type_traits>

#include "comm/ep_phases.h"
#include "comm/staged_row_copy.cuh"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe::ep {
namespace {

// 4. Each token once to each rank that owns one of its experts: the x row (backward: and
// the dy row; with x_fp8.q, the FP8 forward's quantized dispatch: the token's e4m3 row and
// its 1x128 scales instead of x's) into this rank's section of the owner's received
// tokens, and for each of its slots there the owner row (send_base: the expert-sorted
// layout), the router weight and the token's index on the owner. One warp per token. part:
// every owner, or (the overlapped forward) this rank only, without copying the rows (L1
// reads them from x: own_row_token gets each own row's token), or the other ranks only.
// x null: no x rows (the overlapped backward's dy and metadata); metadata false: the rows
// alone (its x rows, sent later beside the L2 dgrad). A warp's tokens: their metadata as it
// reaches each, their rows staged in shared memory by bulk copies in pieces of up to
// kDispatchStageBytes and stored from there by the lanes (staged_row_copy.cuh); one block
// per SM.
constexpr int kDispatchWarps = 12, kDispatchStages = 4, kDispatchStageBytes = 4096;
using DispatchCopy = StagedRowCopy<kDispatchWarps, kDispatchStages, kDispatchStageBytes>;
enum RowKind : int32_t { kRowX = 0, kRowXFp8 = 1, kRowDy = 2 };

template <class Id>
__global__ void __launch_bounds__(DispatchCopy::kThreads, 1)
    dispatch_kernel(const __grid_constant__ comm::PeerTable peers,
                    const __grid_constant__ BufferLayout layout,
                    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy,
                    const Id* __restrict__ topk_ids, const float* __restrict__ topk_weights,
                    const int32_t* __restrict__ slot_row,
                    const int32_t* __restrict__ expert_offsets,
                    const int32_t* __restrict__ send_base, const int32_t* __restrict__ token_pos,
                    const int32_t* __restrict__ token_count, const int32_t* __restrict__ skip,
                    int64_t T, int32_t experts_per_rank, DispatchPart part, bool metadata,
                    int32_t* __restrict__ own_row_token, const chain::Fp8Rows x_fp8) {
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  // Whether this kernel serves rank d.
  const auto serves = [&](int d) {
    return part == DispatchPart::kAll || (part == DispatchPart::kSelf) == (d == peers.rank);
  };
  if (*skip == 0) {
    if (metadata && blockIdx.x == 0 && threadIdx.x < world && serves(threadIdx.x)) {
      at<int32_t>(peers.buffers[threadIdx.x], layout.recv_token_count)[peers.rank] =
          token_count[threadIdx.x];
    }
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(gridDim.x) * kDispatchWarps;
    // The token's index on rank d, -1 where it does not go.
    const auto there = [&](int64_t t, int d) -> int64_t {
      const int32_t pos = token_pos[t * world + d];
      if (pos < 0 || !serves(d)) return -1;
      return int64_t(peers.rank) * layout.max_tokens + pos;
    };
    // This token's metadata (and FP8 scales) at every rank it goes to.
    const auto token_metadata = [&](int64_t t) {
      int64_t id = -1, slot_owner = -1;
      int32_t r = -1;
      if (lane < k) {
        r = slot_row[t * k + lane];
        if (r >= 0) {
          id = static_cast<int64_t>(topk_ids[t * k + lane]);
          slot_owner = id / experts_per_rank;
        }
      }
      if (part != DispatchPart::kSelf && x_fp8.q != nullptr) {
        for (int j = lane; j < H / 128; j += 32) {
          const float s = x_fp8.scales[j * x_fp8.scale_ld + t];
          for (int d = 0; d < world; ++d) {
            const int64_t i = there(t, d);
            if (i >= 0) {
              at<float>(peers.buffers[d], layout.recv_x_scales)[j * layout.recv_x_scale_ld + i] = s;
            }
          }
        }
      }
      for (int d = 0; metadata && d < world; ++d) {
        const int32_t pos = token_pos[t * world + d];
        if (pos < 0 || !serves(d)) continue;
        char* dst = peers.buffers[d];
        const int64_t i = int64_t(peers.rank) * layout.max_tokens + pos;  // token index there
        if (lane < k) {
          int32_t row = -1;
          if (slot_owner == d) {
            row = send_base[id] + (r - expert_offsets[id]);
            at<int32_t>(dst, layout.recv_row_token)[row] = static_cast<int32_t>(i);
            at<float>(dst, layout.recv_weight)[row] = topk_weights[t * k + lane];
            if (part == DispatchPart::kSelf) own_row_token[row] = static_cast<int32_t>(t);
            // Where L2's epilogue stores this row's result: slot (t, lane) of this rank.
            if (layout.epilogue_combine) {
              at<int32_t>(dst, layout.recv_row_dest)[row] = static_cast<int32_t>(
                  (int64_t(peers.rank) * layout.max_tokens + t) * k + lane);
            }
          }
          at<int32_t>(dst, layout.recv_slot_row)[i * k + lane] = row;
        }
        if (lane == 0) at<int32_t>(dst, layout.recv_token_source)[i] = static_cast<int32_t>(t);
      }
    };
    // The rows a token sends, in order: x (bf16, or the FP8 dispatch's e4m3 row), then dy.
    // (Two named kinds, not an array: a dynamically indexed array would live in local memory.)
    int kind0 = kRowDy, kind1 = kRowDy, rows = 0;
    if (part != DispatchPart::kSelf) {
      if (x_fp8.q != nullptr || x != nullptr) {
        kind0 = x_fp8.q != nullptr ? kRowXFp8 : kRowX;
        ++rows;
      }
      if (dy != nullptr) ++rows;  // kind0 (no x) or kind1 is already kRowDy
    }
    const auto kind_of = [&](int r) { return r == 0 ? kind0 : kind1; };
    const auto row_bytes = [&](int kind) { return kind == kRowXFp8 ? H : 2 * H; };
    const auto row_src = [&](int kind, int64_t t) -> const char* {
      if (kind == kRowXFp8) return reinterpret_cast<const char*>(x_fp8.q + t * H);
      return reinterpret_cast<const char*>((kind == kRowX ? x : dy) + t * H);
    };
    // The cursor over this warp's pieces: token t, its row ri, the piece at offset.
    int64_t t = blockIdx.x * int64_t(kDispatchWarps) + threadIdx.x / 32;
    int ri = rows, offset = 0;  // ri == rows: t's metadata not yet written
    bool started = false;
    extern __shared__ __align__(1024) uint8_t smem[];
    DispatchCopy::run(
        smem,
        [&](StagedPiece& piece) -> bool {
          while (true) {
            if (started && ri < rows) {
              const int kind = kind_of(ri);
              const int bytes = row_bytes(kind);
              const int n = bytes - offset < kDispatchStageBytes ? bytes - offset
                                                                 : kDispatchStageBytes;
              piece = {row_src(kind, t) + offset, t, n, kind, offset, 0};
              offset += n;
              if (offset == bytes) {
                ++ri;
                offset = 0;
              }
              return true;
            }
            if (started) t += warps;
            started = true;
            if (t >= T) return false;
            token_metadata(t);
            // Rows only for a token that goes somewhere (every id -1: nowhere).
            bool anywhere = false;
            for (int d = 0; d < world; ++d) anywhere = anywhere || there(t, d) >= 0;
            ri = anywhere ? 0 : rows;
          }
        },
        [&](const StagedPiece& piece, const uint8_t* staged) {
          const size_t area = piece.kind == kRowDy ? layout.recv_dy : layout.recv_x;
          const int64_t stride = row_bytes(piece.kind);
          const auto* from = reinterpret_cast<const uint4*>(staged);
          for (int d = 0; d < world; ++d) {
            const int64_t i = there(piece.token, d);
            if (i < 0) continue;
            auto* to = reinterpret_cast<uint4*>(at<char>(peers.buffers[d], area) + i * stride +
                                                piece.offset);
            for (int o = lane; o < piece.bytes / 16; o += 32) to[o] = from[o];
          }
        });
  }
  __threadfence_system();  // before the phase kernel's release signal
}


// received_slot_rows (ep_phases.h): one thread per entry.
__global__ void __launch_bounds__(kCopyThreads)
    received_slot_rows_kernel(char* own, const __grid_constant__ BufferLayout layout, int world,
                              const int32_t* __restrict__ skip, int32_t* __restrict__ out) {
  const int64_t k = layout.topk, T = layout.max_tokens;
  const int32_t* count = at<const int32_t>(own, layout.recv_token_count);
  const int32_t* slot_row = at<const int32_t>(own, layout.recv_slot_row);
  const int64_t n = int64_t(world) * T * k;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t token = e / k, source = token / T;
    const bool received = *skip == 0 && token - source * T < count[source];
    out[e] = received ? slot_row[e] : -1;
  }
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&dispatch_kernel<int32_t>);

}  // namespace

void dispatch(const Call& c, const __nv_bfloat16* x, const __nv_bfloat16* dy,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              cudaStream_t stream, DispatchPart part, int blocks, bool metadata) {
  if (part == DispatchPart::kSelf && c.w.own_row_token == nullptr) {
    throw_invalid("EP dispatch: the own rows' pass needs the overlapped forward's workspace");
  }
  if (c.w.fp8_dispatch && (dy != nullptr || part != DispatchPart::kAll)) {
    throw_invalid("EP dispatch: the quantized dispatch is the FP8 forward's default path only");
  }
  if (c.w.fp8_dispatch && c.T > 0 && c.w.x_fp8_tokens.q == nullptr) {
    throw_invalid("EP dispatch: the quantized dispatch needs x's e4m3 rows");
  }
  const chain::Fp8Rows x_fp8 = c.w.fp8_dispatch ? c.w.x_fp8_tokens : chain::Fp8Rows{};
  const auto launch = [&](auto* ids) {
    auto* kernel = &dispatch_kernel<std::remove_cv_t<std::remove_pointer_t<decltype(ids)>>>;
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            DispatchCopy::kSharedBytes));
    // One block per SM: `blocks` (two 256-thread blocks per copy SM) or the call's.
    const int sms = std::max(1, (blocks > 0 ? blocks : c.copy_blocks) / 2);
    kernel<<<sms, DispatchCopy::kThreads, DispatchCopy::kSharedBytes, stream>>>(
        c.g.peers, c.buffer, x, dy, ids, topk_weights, c.w.local.plan.slot_row,
        c.w.local.plan.expert_offsets, c.w.send_base, c.w.token_pos, c.w.token_count, c.w.skip,
        c.T, static_cast<int32_t>(c.e_local), part, metadata, c.w.own_row_token, x_fp8);
  };
  if (ids_are_int64) {
    launch(static_cast<const int64_t*>(topk_ids));
  } else {
    launch(static_cast<const int32_t*>(topk_ids));
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void received_slot_rows(const Call& c, int32_t* out, cudaStream_t stream) {
  const int64_t n = int64_t(c.g.peers.world_size) * c.g.max_tokens * c.g.topk;
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + kCopyThreads - 1) / kCopyThreads, 4 * int64_t(c.sms));
  received_slot_rows_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
      c.own(), c.buffer, c.g.peers.world_size, c.w.skip, out);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::ep
