// Per-slot sums of per-row partials (the backward's d topk_weights). Internal; asynchronous
// on `stream`, no host sync, deterministic (a fixed summation order).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe {

// out[s] = sum_{j = 0..parts-1} partial[slot_row[s] * parts + j], in that order; 0 when
// slot_row[s] < 0 (an id of -1).
void reduce_slot_partials(const float* partial, int64_t parts, const int32_t* slot_row,
                          int64_t num_slots, float* out, cudaStream_t stream);

}  // namespace megamoe
