// Host side of the grouped GEMM: tensor maps, launch configuration, argument checks.
#include "kernels/sm90/grouped_gemm.h"

#include <cudaTypedefs.h>

#include <string>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/driver_entry.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/grouped_gemm.cuh"

namespace megamoe::sm90 {
namespace {

static_assert(kGroupedGemmBlockM == kBlockM);

// The driver's tensor-map encoder (found once; a failed lookup is retried by the next call).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn =
      driver_function<std::remove_pointer_t<PFN_cuTensorMapEncodeTiled_v12000>>(
          "cuTensorMapEncodeTiled", 12000);
  return fn;
}

// Row-major [rows, cols] bf16 matrix read in boxes of box_rows x 64 with 128-byte swizzle.
CUtensorMap make_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    throw Error(MEGAMOE_ERROR_CUDA, "cuTensorMapEncodeTiled failed with CUresult " +
                                        std::to_string(static_cast<int>(res)) + " for a [" +
                                        std::to_string(rows) + ", " + std::to_string(cols) +
                                        "] bf16 matrix");
  }
  return map;
}

void check_args(const GroupedGemmArgs& a) {
  if (a.k % kBlockK != 0) throw_invalid("grouped GEMM: K must be a multiple of 64");
  if (a.ldc % 8 != 0 || reinterpret_cast<uintptr_t>(a.c) % 16) {
    throw_invalid("grouped GEMM: C rows must be 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(a.a) % 16 || reinterpret_cast<uintptr_t>(a.b) % 16) {
    throw_invalid("grouped GEMM: A and B must be 16-byte aligned");
  }
}

template <Epilogue kEpilogue, int kBlockN, bool kGatherA, bool kBMajorN = false>
void launch(const GroupedGemmArgs& a, int64_t half_n, cudaStream_t stream,
            MnMajorStrides strides = {}, const SwiGLUBackwardArgs* backward = nullptr) {
  constexpr int kOutCols = kEpilogue == Epilogue::kSwiGLU ? kBlockN / 2 : kBlockN;
  constexpr int box_rows_b = kBMajorN ? kBlockK : kOutCols;
  // N-major B: B_e is [k, n]; otherwise [n, k] (b_rows_per_expert rows each).
  const int64_t out_width = kEpilogue == Epilogue::kSwiGLU ? half_n
                            : kBMajorN                     ? a.n
                                                           : a.b_rows_per_expert;
  // kSwiGLUBackward: half_n is I (the up half's offset in h and dh).
  const int n_tiles = static_cast<int>(out_width / kOutCols);
  check_args(a);
  if (a.a_rows == 0) return;
  // A gathered by cp.async needs no tensor map; pass a valid one over the source anyway.
  const CUtensorMap map_a =
      make_tensor_map(a.a, kGatherA ? a.a_source_rows : a.a_rows, a.k, kBlockM);
  const CUtensorMap map_b =
      kBMajorN ? make_tensor_map(a.b, a.num_experts * a.k, a.n, box_rows_b)
               : make_tensor_map(a.b, a.num_experts * a.b_rows_per_expert, a.k, box_rows_b);
  // Output stores: boxes of 64 rows x 64 columns (one consumer warpgroup's slab).
  const CUtensorMap map_c = make_tensor_map(a.c, a.c_rows > 0 ? a.c_rows : a.a_rows, a.ldc, 64);
  // kSwiGLU's saved h [rows, 2I], or kSwiGLUBackward's a_out [c_rows, I], stored in the
  // same 64 x 64 boxes.
  CUtensorMap map_h{};
  if (kEpilogue == Epilogue::kSwiGLU && a.h_out != nullptr) {
    map_h = make_tensor_map(a.h_out, a.a_rows, 2 * half_n, 64);
  } else if (kEpilogue == Epilogue::kSwiGLUBackward && backward != nullptr &&
             backward->a_out != nullptr) {
    map_h = make_tensor_map(backward->a_out, a.c_rows > 0 ? a.c_rows : a.a_rows, half_n, 64);
  }
  // kSwiGLUBackward: h [rows, 2I] read by the epilogue in 64 x 64 boxes.
  const CUtensorMap map_h_in =
      kEpilogue == Epilogue::kSwiGLUBackward && backward != nullptr
          ? make_tensor_map(backward->h, a.a_rows, 2 * half_n, 64)
          : CUtensorMap{};
  GroupedGemmParams p{};
  p.expert_offsets = a.expert_offsets;
  p.tile_offsets = a.tile_offsets;
  p.num_experts = static_cast<int32_t>(a.num_experts);
  p.k = static_cast<int32_t>(a.k);
  p.b_rows_per_expert = static_cast<int32_t>(a.b_rows_per_expert);
  p.n_tiles = n_tiles;
  p.half_n = static_cast<int32_t>(half_n);
  p.c = a.c;
  p.ldc = a.ldc;
  p.a_source = a.a;
  p.a_row_index = a.a_row_index;
  p.b_lbo = strides.lbo;
  p.b_sbo = strides.sbo;
  if (kBMajorN) p.b_rows_per_expert = static_cast<int32_t>(a.k);
  p.a_padded = a.a_padded;
  p.c_padded = a.c_padded;
  p.h_out = kEpilogue == Epilogue::kSwiGLU ? a.h_out : nullptr;
  if (backward != nullptr) {
    p.h = backward->h;
    p.dh = backward->dh;
    p.slot_weights = backward->slot_weights;
    p.row_slot = backward->row_slot;
    p.dp_partial = backward->dp_partial;
    p.a_out = backward->a_out;
  }

  int device = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The host does not know the counts: bound the M-tiles by one partial tile per expert.
  const int64_t max_tiles = ((a.a_rows + kBlockM - 1) / kBlockM + a.num_experts) * n_tiles;
  const int grid = static_cast<int>(max_tiles < sms ? max_tiles : sms);
  const size_t smem = sizeof(GemmSharedStorage<kEpilogue, kBlockN>) + 1024;  // + alignment
  static_assert(sizeof(GemmSharedStorage<kEpilogue, kBlockN>) + 1024 <= 227 * 1024);
  auto* kernel = &grouped_gemm_kernel<kEpilogue, kBlockN, kGatherA, kBMajorN>;
  MEGAMOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(map_a, map_b, map_c, map_h, map_h_in, p);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<Epilogue::kStore, 128, false, false>);

}  // namespace

// Wider tiles halve the shared-memory traffic per MMA; 128-wide ones cover the other sizes.
#ifndef MEGAMOE_GEMM_MAX_BLOCK_N
#define MEGAMOE_GEMM_MAX_BLOCK_N 256
#endif

void grouped_gemm_swiglu(const GroupedGemmArgs& args, int64_t intermediate, cudaStream_t stream) {
  if (intermediate % 64 != 0) throw_invalid("grouped GEMM (SwiGLU): I must be a multiple of 64");
  const bool wide = MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && intermediate % 128 == 0;
  if (args.a_row_index != nullptr) {
    if (args.a_source_rows < 1) throw_invalid("grouped GEMM: gathered A has no rows");
    wide ? launch<Epilogue::kSwiGLU, 256, true>(args, intermediate, stream)
         : launch<Epilogue::kSwiGLU, 128, true>(args, intermediate, stream);
  } else {
    wide ? launch<Epilogue::kSwiGLU, 256, false>(args, intermediate, stream)
         : launch<Epilogue::kSwiGLU, 128, false>(args, intermediate, stream);
  }
}

void grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  const int64_t n = args.b_rows_per_expert;
  if (n % 128 != 0) throw_invalid("grouped GEMM: N must be a multiple of 128");
  const bool wide = MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && n % 256 == 0;
  if (args.a_row_index != nullptr) {
    if (args.a_source_rows < 1) throw_invalid("grouped GEMM: gathered A has no rows");
    wide ? launch<Epilogue::kStore, 256, true>(args, 0, stream)
         : launch<Epilogue::kStore, 128, true>(args, 0, stream);
  } else {
    wide ? launch<Epilogue::kStore, 256, false>(args, 0, stream)
         : launch<Epilogue::kStore, 128, false>(args, 0, stream);
  }
}

void grouped_gemm_swiglu_backward(const GroupedGemmArgs& args, const SwiGLUBackwardArgs& bw,
                                  cudaStream_t stream) {
  if (args.n % 128 != 0) throw_invalid("grouped GEMM (SwiGLU backward): I must be a multiple of 128");
  if (!bw.h || !bw.dh || !bw.slot_weights || !bw.row_slot || !bw.dp_partial) {
    throw_invalid("grouped GEMM (SwiGLU backward): null h, dh, weights, row_slot or dp_partial");
  }
  // The epilogue writes dh itself; C only needs a valid tensor map.
  GroupedGemmArgs a = args;
  a.c = bw.dh;
  a.ldc = 2 * args.n;
  const auto run = [&](auto block_n, auto gather) {
    constexpr int kBlockN = decltype(block_n)::value;
    constexpr bool kGather = decltype(gather)::value;
    launch<Epilogue::kSwiGLUBackward, kBlockN, kGather, true>(a, args.n, stream, {}, &bw);
  };
  using N128 = std::integral_constant<int, 128>;
  using N256 = std::integral_constant<int, 256>;
  const bool gather = args.a_row_index != nullptr;
  if (args.n % 256 == 0) {
    gather ? run(N256{}, std::true_type{}) : run(N256{}, std::false_type{});
  } else {
    gather ? run(N128{}, std::true_type{}) : run(N128{}, std::false_type{});
  }
}

void grouped_gemm_wgrad(const WgradArgs& w, cudaStream_t stream) {
  if (w.m % kBlockM || w.n % 128 || w.m < 1 || w.n < 1) {
    throw_invalid("grouped GEMM (weight gradient): M and N must be positive multiples of 128");
  }
  if (!w.a || !w.b || !(w.c || w.c_accumulate) || !w.tile_offsets) {
    throw_invalid("grouped GEMM (weight gradient): null pointer");
  }
  const auto run = [&](auto block_n) {
    constexpr int kBlockN = decltype(block_n)::value;
    using Storage = GemmSharedStorage<Epilogue::kStore, kBlockN>;
    const CUtensorMap map_a = make_tensor_map(w.a, w.padded_rows, w.m, kBlockK);
    const CUtensorMap map_b = make_tensor_map(w.b, w.padded_rows, w.n, kBlockK);
    // Accumulating into fp32 goes through registers: no store map then.
    const CUtensorMap map_c =
        w.c_accumulate ? CUtensorMap{} : make_tensor_map(w.c, w.num_experts * w.m, w.n, 64);
    GroupedGemmParams p{};
    p.tile_offsets = w.tile_offsets;
    p.num_experts = static_cast<int32_t>(w.num_experts);
    p.n_tiles = static_cast<int32_t>(w.n / kBlockN);
    p.wgrad_m = static_cast<int32_t>(w.m);
    p.b_rows_per_expert = 0;  // K rows come from tile_offsets
    p.c = w.c;
    p.c_f32 = w.c_accumulate;
    p.ldc = w.n;
    p.b_lbo = MnMajorStrides{}.lbo;
    p.b_sbo = MnMajorStrides{}.sbo;
    int device = 0, sms = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t tiles = w.num_experts * (w.m / kBlockM) * p.n_tiles;
    const int grid = static_cast<int>(tiles < sms ? tiles : sms);
    const size_t smem = sizeof(Storage) + 1024;
    auto* kernel = &grouped_gemm_kernel<Epilogue::kStore, kBlockN, false, true, true>;
    MEGAMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kThreads, smem, stream>>>(map_a, map_b, map_c, CUtensorMap{}, CUtensorMap{}, p);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  };
  w.n % 256 == 0 ? run(std::integral_constant<int, 256>{}) : run(std::integral_constant<int, 128>{});
}

int64_t swiglu_backward_n_tiles(int64_t intermediate) {
  return intermediate % 256 == 0 ? intermediate / 256 : intermediate / 128;
}

void grouped_gemm_b_n_major(const GroupedGemmArgs& args, cudaStream_t stream,
                            MnMajorStrides strides) {
  if (args.n % 128 != 0) throw_invalid("grouped GEMM (N-major B): N must be a multiple of 128");
  if (args.a_row_index != nullptr) {
    if (args.a_source_rows < 1) throw_invalid("grouped GEMM: gathered A has no rows");
    args.n % 256 == 0 ? launch<Epilogue::kStore, 256, true, true>(args, 0, stream, strides)
                      : launch<Epilogue::kStore, 128, true, true>(args, 0, stream, strides);
  } else {
    args.n % 256 == 0 ? launch<Epilogue::kStore, 256, false, true>(args, 0, stream, strides)
                      : launch<Epilogue::kStore, 128, false, true>(args, 0, stream, strides);
  }
}

}  // namespace megamoe::sm90
