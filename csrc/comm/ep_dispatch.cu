// Step 4 of an expert-parallel call (ep_layer.h lists them all): every token's rows to the
// ranks that own its experts, by peer stores.
#include <algorithm>

#include "comm/ep_phases.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe::ep {
namespace {

// One warp copies a row of `bytes` (a multiple of 16) to several places (16 bytes per lane,
// kCopyBatch loads in flight before the stores); dst(i) gives the i-th destination row or
// null.
template <class Destination>
__device__ __forceinline__ void copy_row_to(const void* src, int bytes, int lane, int count,
                                            Destination dst) {
  const auto* s = reinterpret_cast<const uint4*>(src);
  const int n = bytes / 16;
  for (int base = lane; base < n; base += 32 * kCopyBatch) {
    uint4 v[kCopyBatch];
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b) {
      if (base + 32 * b < n) v[b] = s[base + 32 * b];
    }
    for (int i = 0; i < count; ++i) {
      auto* d = reinterpret_cast<uint4*>(dst(i));
      if (d == nullptr) continue;
#pragma unroll
      for (int b = 0; b < kCopyBatch; ++b) {
        if (base + 32 * b < n) d[base + 32 * b] = v[b];
      }
    }
  }
}

// 4. Each token once to each rank that owns one of its experts: the x row (backward: and
// the dy row; with x_fp8.q, the FP8 forward's quantized dispatch: the token's e4m3 row and
// its 1x128 scales instead of x's) into this rank's section of the owner's received
// tokens, and for each of its slots there the owner row (send_base: the expert-sorted
// layout), the router weight and the token's index on the owner. One warp per token. part:
// every owner, or (the overlapped forward) this rank only, without copying the rows (L1
// reads them from x: own_row_token gets each own row's token), or the other ranks only.
// x null: no x rows (the overlapped backward's dy and metadata); metadata false: the rows
// alone (its x rows, sent later beside the L2 dgrad).
template <class Id>
__global__ void __launch_bounds__(kCopyThreads)
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
    const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
    for (int64_t t = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
      int64_t id = -1, slot_owner = -1;
      int32_t r = -1;
      if (lane < k) {
        r = slot_row[t * k + lane];
        if (r >= 0) {
          id = static_cast<int64_t>(topk_ids[t * k + lane]);
          slot_owner = id / experts_per_rank;
        }
      }
      // The token's index on rank d, -1 where it does not go.
      const auto there = [&](int d) -> int64_t {
        const int32_t pos = token_pos[t * world + d];
        if (pos < 0 || !serves(d)) return -1;
        return int64_t(peers.rank) * layout.max_tokens + pos;
      };
      // The rows, read once, to every destination rank: rows of row_bytes in `area`.
      const auto to = [&](size_t area, int64_t row_bytes) {
        return [&, area, row_bytes](int d) -> char* {
          const int64_t i = there(d);
          return i < 0 ? nullptr : at<char>(peers.buffers[d], area) + i * row_bytes;
        };
      };
      if (part != DispatchPart::kSelf) {
        if (x_fp8.q != nullptr) {
          copy_row_to(x_fp8.q + t * H, H, lane, world, to(layout.recv_x, H));
          for (int j = lane; j < H / 128; j += 32) {
            const float s = x_fp8.scales[j * x_fp8.scale_ld + t];
            for (int d = 0; d < world; ++d) {
              const int64_t i = there(d);
              if (i >= 0) {
                at<float>(peers.buffers[d], layout.recv_x_scales)[j * layout.recv_x_scale_ld + i] = s;
              }
            }
          }
        } else if (x != nullptr) {
          copy_row_to(x + t * H, 2 * H, lane, world, to(layout.recv_x, 2 * H));
        }
        if (dy != nullptr) copy_row_to(dy + t * H, 2 * H, lane, world, to(layout.recv_dy, 2 * H));
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
    }
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
    dispatch_kernel<<<blocks > 0 ? blocks : c.copy_blocks, kCopyThreads, 0, stream>>>(
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
