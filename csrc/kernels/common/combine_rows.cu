// Combine of the k expert outputs per token (contract in combine_rows.h). Memory bound:
// 16-byte loads and stores, each token row handled by a group of `lanes` consecutive threads
// (a power of two) so that a warp covers one row or several whole rows with contiguous
// accesses, grid-stride over rows.
#include "kernels/common/combine_rows.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/bf16_row.cuh"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/sm_count.h"

namespace megamoe {
namespace {

constexpr int kThreads = 256;
constexpr int kCombineGroup = 8;  // slots whose rows are loaded together

// log2 of the threads per row: the smallest power of two >= `per_row`, at most kThreads.
int lanes_log2_for(int64_t per_row) {
  int l = 0;
  while ((int64_t{1} << l) < per_row && (1 << l) < kThreads) ++l;
  return l;
}

// Enough blocks for the rows, at most one full wave of resident blocks (the kernel
// grid-strides, so a partial second wave would only add a tail).
template <class Kernel>
int grid_for(Kernel kernel, int64_t rows, int lanes_log2) {
  const int sms = sm_count();
  int per_sm = 0;
  MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  const int64_t rows_per_block = kThreads >> lanes_log2;
  const int64_t wanted = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(std::min<int64_t>(wanted, int64_t{sms} * std::max(per_sm, 1)));
}

void check_rows(const char* function, const void* p, const char* name) {
  if (p == nullptr) throw_invalid(std::string(function) + ": " + name + " is null");
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    throw_invalid(std::string(function) + ": " + name + " is not 16-byte aligned");
  }
}

void check_hidden(const char* function, int64_t H) {
  if (H < 8 || H % 8 != 0) {
    throw_invalid(std::string(function) + ": H: expected a positive multiple of 8, got " +
                  std::to_string(H));
  }
}

template <bool kBf16Weights>
__device__ __forceinline__ float load_weight(const void* weights, int64_t i) {
  if constexpr (kBf16Weights) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[i]);
  } else {
    return __ldg(static_cast<const float*>(weights) + i);
  }
}

template <bool kBf16Weights>
__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(const uint4* __restrict__ o, int64_t vecs,
                        const int32_t* __restrict__ slot_row, const void* __restrict__ weights,
                        int64_t T, int32_t k, int lanes_log2, uint4* __restrict__ y) {
  const int lanes = 1 << lanes_log2;
  const int sub = threadIdx.x & (lanes - 1);
  const int64_t rows_per_block = kThreads >> lanes_log2;
  for (int64_t t = blockIdx.x * rows_per_block + (threadIdx.x >> lanes_log2); t < T;
       t += gridDim.x * rows_per_block) {
    const int32_t* rows = slot_row + t * k;
    for (int64_t v = sub; v < vecs; v += lanes) {
      y[t * vecs + v] = fold_slot_pieces<kCombineGroup>(k, [&](int j, float& w, uint4& val) {
        const int32_t row = j < k ? __ldg(rows + j) : -1;
        // One predicate for the weight's load (no weights: a plain sum, the backward's dx).
        w = row >= 0 && weights != nullptr ? load_weight<kBf16Weights>(weights, t * k + j) : 1.0f;
        if (row >= 0) val = __ldg(o + row * vecs + v);
        return row >= 0;
      });
    }
  }
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&combine_rows_kernel<true>);

}  // namespace

void combine_rows(const __nv_bfloat16* o, int64_t H, const int32_t* slot_row,
                  const void* topk_weights, bool weights_are_bf16, int64_t T, int64_t k,
                  __nv_bfloat16* y, cudaStream_t stream) {
  constexpr const char* kFn = "combine_rows";
  check_hidden(kFn, H);
  if (T < 0) throw_invalid(std::string(kFn) + ": T: expected >= 0, got " + std::to_string(T));
  if (k < 1) throw_invalid(std::string(kFn) + ": k: expected >= 1, got " + std::to_string(k));
  if (T > INT32_MAX / k) {
    throw_invalid(std::string(kFn) + ": T*k = " + std::to_string(T) + "*" + std::to_string(k) +
                  " slots, expected fewer than 2^31");
  }
  if (T == 0) return;
  check_rows(kFn, y, "y");
  if (!slot_row) throw_invalid(std::string(kFn) + ": slot_row is null");
  // o may be null only if no slot is valid; that is not known on the host, so require it.
  check_rows(kFn, o, "o");
  if (topk_weights && reinterpret_cast<uintptr_t>(topk_weights) % (weights_are_bf16 ? 2 : 4) != 0) {
    throw_invalid(std::string(kFn) + ": topk_weights is not aligned to its element size");
  }
  const int64_t vecs = H / 8;
  const int lanes_log2 = lanes_log2_for(vecs);
  const auto* src = reinterpret_cast<const uint4*>(o);
  auto* dst = reinterpret_cast<uint4*>(y);
  if (weights_are_bf16) {
    const int grid = grid_for(combine_rows_kernel<true>, T, lanes_log2);
    combine_rows_kernel<true><<<grid, kThreads, 0, stream>>>(
        src, vecs, slot_row, topk_weights, T, static_cast<int32_t>(k), lanes_log2, dst);
  } else {
    const int grid = grid_for(combine_rows_kernel<false>, T, lanes_log2);
    combine_rows_kernel<false><<<grid, kThreads, 0, stream>>>(
        src, vecs, slot_row, topk_weights, T, static_cast<int32_t>(k), lanes_log2, dst);
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe
