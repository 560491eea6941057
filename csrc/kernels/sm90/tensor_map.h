// TMA tensor maps of the grouped GEMM's operands and outputs (host side).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace megamoe::sm90 {

// A row-major [rows, cols] bf16 matrix moved in boxes of box_rows x 64 columns (128 bytes)
// with 128-byte swizzle, the layout the wgmma descriptors and the epilogues' staging expect.
// Throws megamoe::Error (MEGAMOE_ERROR_CUDA) if the driver rejects it.
CUtensorMap make_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows);

}  // namespace megamoe::sm90
