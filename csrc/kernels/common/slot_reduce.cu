#include "kernels/common/slot_reduce.h"

#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    reduce_slot_partials_kernel(const float* __restrict__ partial, int parts,
                                const int32_t* __restrict__ slot_row, int64_t num_slots,
                                float* __restrict__ out) {
  const int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= num_slots) return;
  const int32_t row = __ldg(&slot_row[s]);
  float sum = 0.f;
  if (row >= 0) {
    for (int j = 0; j < parts; ++j) sum += __ldg(&partial[int64_t(row) * parts + j]);
  }
  out[s] = sum;
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&reduce_slot_partials_kernel);

}  // namespace

void reduce_slot_partials(const float* partial, int64_t parts, const int32_t* slot_row,
                          int64_t num_slots, float* out, cudaStream_t stream) {
  if (num_slots < 0 || parts < 1 || parts > (1 << 20)) {
    throw_invalid("reduce_slot_partials: expected num_slots >= 0 and 1 <= parts, got " +
                  std::to_string(num_slots) + ", " + std::to_string(parts));
  }
  if (num_slots == 0) return;
  if (!partial || !slot_row || !out) throw_invalid("reduce_slot_partials: null pointer");
  const int64_t blocks = (num_slots + kThreads - 1) / kThreads;
  reduce_slot_partials_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      partial, static_cast<int>(parts), slot_row, num_slots, out);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe
