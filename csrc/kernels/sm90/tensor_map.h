// TMA tensor maps of the grouped GEMM's operands and outputs (host side).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe::sm90 {

// The tensor-map encoding of an element type; a mainloop of another type specializes it.
template <class T>
struct TmaElement;
template <>
struct TmaElement<__nv_bfloat16> {
  static constexpr CUtensorMapDataType kType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
};

// A row-major [rows, cols] matrix of T moved in boxes of box_rows rows x 128 bytes with
// 128-byte swizzle, the layout the wgmma descriptors and the epilogues' staging expect.
// Throws megamoe::Error (MEGAMOE_ERROR_CUDA) if the driver rejects it.
CUtensorMap make_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                            CUtensorMapDataType type, int element_bytes);
template <class T = __nv_bfloat16>
CUtensorMap make_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  return make_tensor_map(base, rows, cols, box_rows, TmaElement<T>::kType, sizeof(T));
}

}  // namespace megamoe::sm90
