// TMA tensor maps of the grouped GEMM's operands and outputs (host side).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::sm90 {

// The tensor-map encoding of an element type; a mainloop of another type specializes it.
template <class T>
struct TmaElement;
template <>
struct TmaElement<__nv_bfloat16> {
  static constexpr CUtensorMapDataType kType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
};
template <>
struct TmaElement<__nv_fp8_e4m3> {  // TMA moves bytes; the wgmma says what they are
  static constexpr CUtensorMapDataType kType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
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

// The fp32 block scales of an FP8 operand, [blocks, cols] row-major (cols: the operand's rows,
// contiguous), moved in boxes of `box` consecutive scales of one k-block, unswizzled: the
// scales of a tile's rows. cols: a multiple of 4 (16-byte row strides). A box must start at
// a multiple of 4 scales (16 bytes).
CUtensorMap make_scale_tensor_map(const float* base, int64_t blocks, int64_t cols, int box);

}  // namespace megamoe::sm90
