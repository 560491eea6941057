// Combine of the k expert outputs of each token, after the grouped GEMMs: a weighted sum of
// expert-sorted rows back into token order. Internal to the library (not part of the C ABI).
// Asynchronous on `stream`, no host sync, no allocation, capturable in a CUDA graph,
// bitwise deterministic. bf16 rows of H elements, H a multiple of 8, every row pointer
// 16-byte aligned. Throws megamoe::Error on bad arguments or a failed launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe {

// y[t, :] = sum_{j=0..k-1} p[t,j] * o[slot_row[t*k+j], :] with fp32 accumulation in the
// fixed order j = 0..k-1 (acc = fma(p, o, acc), starting from +0), rounded once to bf16
// (round to nearest even). A slot with slot_row < 0 adds nothing; a token with no valid
// slot gets zeros. Every row of y [T, H] is written. topk_weights [T, k] is fp32, or bf16
// when weights_are_bf16; null means every weight is 1 (a plain sum of the k rows).
void combine_rows(const __nv_bfloat16* o, int64_t H, const int32_t* slot_row,
                  const void* topk_weights, bool weights_are_bf16, int64_t T, int64_t k,
                  __nv_bfloat16* y, cudaStream_t stream);

}  // namespace megamoe
