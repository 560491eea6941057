// The grouped GEMMs' first host API, kept while its callers move to gemm.h: each function
// forwards to the gemm.h one named beside it, with the same results and errors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/sm90/gemm.h"

namespace megamoe::sm90 {

struct GroupedGemmArgs {
  // A in sorted order: either a materialised [a_rows, k] matrix (a_row_index null), or
  // gathered on the fly: sorted row r is row a_row_index[r] of a ([tokens, k]).
  const __nv_bfloat16* a;
  const int32_t* a_row_index;      // device [a_rows] or null
  int64_t a_source_rows;           // rows of a when gathering (tokens)
  int64_t a_rows;                  // sorted rows allocated (the valid ones per expert_offsets)
  const __nv_bfloat16* b;          // [num_experts * b_rows_per_expert, k]
  int64_t b_rows_per_expert;
  int64_t k;                       // multiple of 64
  int64_t num_experts;
  const int32_t* expert_offsets;   // device [E+1]
  const int32_t* tile_offsets;     // device [E+1], M-tiles of 128 rows
  __nv_bfloat16* c;                // [c_rows, ldc]
  int64_t ldc;
  int64_t n;                       // output columns (N-major B only)
  // The padded row layout (gemm.h): a materialised A, and the outputs, at
  // tile_offsets[e] * 128 + i.
  bool a_padded = false, c_padded = false;
  int64_t c_rows = 0;              // rows of C allocated; 0: a_rows
  // grouped_gemm_swiglu only, optional: also write h = [gate | up] ([rows, 2I], unpadded
  // sorted order) for a backward that skips the L1 recompute.
  __nv_bfloat16* h_out = nullptr;
};

// m_grouped_gemm_nt_swiglu (n = intermediate, h = args.h_out); b = w_gate_up [E*2I, H].
void grouped_gemm_swiglu(const GroupedGemmArgs& args, int64_t intermediate, cudaStream_t stream);

// m_grouped_gemm_nt (n = b_rows_per_expert).
void grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

// m_grouped_gemm_nn (n = args.n): B = [num_experts, k, n].
void grouped_gemm_b_n_major(const GroupedGemmArgs& args, cudaStream_t stream,
                            MnMajorStrides strides = {});

// m_grouped_gemm_nn_swiglu_backward (n = args.n = I; C = dh, ld 2I, in args.c_padded's
// layout with args.c_rows rows).
struct SwiGLUBackwardArgs {
  const __nv_bfloat16* h;      // [rows, 2I]
  __nv_bfloat16* dh;           // [rows, 2I]
  const float* slot_weights;   // [T*k] fp32 router weights
  const int32_t* row_slot;     // [rows]
  float* dp_partial;           // [rows, swiglu_backward_n_tiles(I)]
  __nv_bfloat16* a_out;        // optional [rows, I]: a = silu(g) u (padded with args.c_padded)
};
void grouped_gemm_swiglu_backward(const GroupedGemmArgs& args, const SwiGLUBackwardArgs& bw,
                                  cudaStream_t stream);
// swiglu_backward_dp_columns.
int64_t swiglu_backward_n_tiles(int64_t intermediate);

// k_grouped_gemm_tn.
using WgradArgs = KGroupedGemmArgs;
void grouped_gemm_wgrad(const WgradArgs& args, cudaStream_t stream);

constexpr int kGroupedGemmBlockM = kGemmBlockM;

}  // namespace megamoe::sm90
