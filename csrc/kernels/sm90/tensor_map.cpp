#include "kernels/sm90/tensor_map.h"

#include <cudaTypedefs.h>

#include <string>
#include <type_traits>

#include "core/driver_entry.h"
#include "core/error.h"

namespace megamoe::sm90 {
namespace {

// The driver's tensor-map encoder (found once; a failed lookup is retried by the next call).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn =
      driver_function<std::remove_pointer_t<PFN_cuTensorMapEncodeTiled_v12000>>(
          "cuTensorMapEncodeTiled", 12000);
  return fn;
}

void check(CUresult res, int64_t rows, int64_t cols, int element_bytes) {
  if (res != CUDA_SUCCESS) {
    throw Error(MEGAMOE_ERROR_CUDA, "cuTensorMapEncodeTiled failed with CUresult " +
                                        std::to_string(static_cast<int>(res)) + " for a [" +
                                        std::to_string(rows) + ", " + std::to_string(cols) +
                                        "] matrix of " + std::to_string(element_bytes) +
                                        "-byte elements");
  }
}

}  // namespace

CUtensorMap make_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                            CUtensorMapDataType type, int element_bytes) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  check(tensor_map_encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box,
                             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        rows, cols, element_bytes);
  return map;
}

CUtensorMap make_scale_tensor_map(const float* base, int64_t blocks, int64_t cols, int box_cols) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(blocks)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(float)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 1};
  const cuuint32_t element_strides[2] = {1, 1};
  check(tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base),
                             dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        blocks, cols, sizeof(float));
  return map;
}

}  // namespace megamoe::sm90
