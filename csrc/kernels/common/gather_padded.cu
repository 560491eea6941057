#include "kernels/common/gather_padded.h"

#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/bf16_scale.cuh"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/sm_count.h"

namespace megamoe {
namespace {

constexpr int kWarps = 8;

// One warp per padded row; lanes stride over the row's 16-byte vectors.
__global__ void __launch_bounds__(kWarps * 32)
    gather_rows_padded_kernel(const uint4* __restrict__ src, int64_t vecs,
                              const int32_t* __restrict__ expert_offsets,
                              const int32_t* __restrict__ tile_offsets,
                              const int32_t* __restrict__ row_token,
                              const int32_t* __restrict__ row_slot, int32_t num_experts,
                              const float* __restrict__ slot_weights, int64_t padded_rows,
                              uint4* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t used = int64_t(__ldg(&tile_offsets[num_experts])) * 128;
  const int64_t limit = used < padded_rows ? used : padded_rows;
  for (int64_t prow = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; prow < limit;
       prow += int64_t(gridDim.x) * kWarps) {
    const int m_tile = static_cast<int>(prow / 128);
    int lo = 0, hi = num_experts - 1;  // last expert whose first tile is <= m_tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (__ldg(&tile_offsets[mid]) <= m_tile) lo = mid; else hi = mid - 1;
    }
    const int64_t local = prow - int64_t(__ldg(&tile_offsets[lo])) * 128;
    const int first = __ldg(&expert_offsets[lo]);
    uint4* dst = out + prow * vecs;
    if (local >= __ldg(&expert_offsets[lo + 1]) - first) {
      for (int64_t v = lane; v < vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const int row = first + static_cast<int>(local);
    const float scale = slot_weights ? __ldg(&slot_weights[__ldg(&row_slot[row])]) : 1.0f;
    const uint4* from = src + int64_t(__ldg(&row_token[row])) * vecs;
    for (int64_t v = lane; v < vecs; v += 32) {
      const uint4 q = __ldg(&from[v]);
      dst[v] = slot_weights ? scale_bf16x8(q, scale) : q;
    }
  }
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&gather_rows_padded_kernel);

}  // namespace

void gather_rows_padded(const __nv_bfloat16* src, int64_t H, const RoutingPlan& plan,
                        int64_t num_experts, const float* slot_weights, int64_t padded_rows,
                        __nv_bfloat16* out, cudaStream_t stream) {
  if (H < 8 || H % 8) throw_invalid("gather_rows_padded: H must be a positive multiple of 8");
  if (num_experts < 1) throw_invalid("gather_rows_padded: num_experts must be >= 1");
  if (padded_rows == 0) return;
  if (!src || !out || !plan.expert_offsets || !plan.tile_offsets || !plan.row_token ||
      (slot_weights && !plan.row_slot)) {
    throw_invalid("gather_rows_padded: null pointer");
  }
  if (reinterpret_cast<uintptr_t>(src) % 16 || reinterpret_cast<uintptr_t>(out) % 16) {
    throw_invalid("gather_rows_padded: rows must be 16-byte aligned");
  }
  const int sms = sm_count();
  const int64_t wanted = (padded_rows + kWarps - 1) / kWarps;
  const int blocks = static_cast<int>(wanted < 8LL * sms ? wanted : 8LL * sms);
  gather_rows_padded_kernel<<<blocks, kWarps * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), H / 8, plan.expert_offsets, plan.tile_offsets,
      plan.row_token, plan.row_slot, static_cast<int32_t>(num_experts), slot_weights,
      padded_rows, reinterpret_cast<uint4*>(out));
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe
