// Host launcher of the sm_90a grouped GEMM (grouped_gemm.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

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
  // The backward's padded row layout (see GroupedGemmParams): a materialised A, and the
  // outputs, at tile_offsets[e] * 128 + i.
  bool a_padded = false, c_padded = false;
  int64_t c_rows = 0;              // rows of C allocated; 0: a_rows
  // grouped_gemm_swiglu only, optional: also write h = [gate | up] ([rows, 2I], unpadded
  // sorted order) for a backward that skips the L1 recompute.
  __nv_bfloat16* h_out = nullptr;
};

// Shared-memory descriptor strides of an N-major B tile (bytes); the defaults describe the
// layout the kernel's TMA boxes produce.
struct MnMajorStrides {
  uint32_t lbo = 64 * 128;  // next 64 elements along N: the next box of 64 K-rows
  uint32_t sbo = 8 * 128;   // next 8 rows along K
};

// L1: c[r, :I] = silu(a_r . gate_e) * (a_r . up_e); b = w_gate_up viewed as [E*2I, H].
// Supports the gathered A.
void grouped_gemm_swiglu(const GroupedGemmArgs& args, int64_t intermediate, cudaStream_t stream);

// L2: c[r, :N] = a_r . b_e, N = b_rows_per_expert; b = w_down viewed as [E*H, I].
// Also the backward's L1 recompute (b = w_gate_up, N = 2I, gathered A).
void grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

// c[r, :n] = a_r . B_e with B = [num_experts, k, n] (n contiguous: N-major, e.g. w_down
// in [E, H, I] read as K = H, N = I for the backward's dgrad). `strides` exists for tests.
void grouped_gemm_b_n_major(const GroupedGemmArgs& args, cudaStream_t stream,
                            MnMajorStrides strides = {});

// Backward of L2 and SwiGLU (dgrad): z_r = w_down_e^T dy_t for each sorted row r (A = dy
// rows, gathered when args.a_row_index is set; B = w_down [E, H, I] as N-major K = H,
// N = I = args.n), fused with da = p z, dh = [da u silu'(g), da silu(g)] from the
// recomputed h = [g | u], and per-(row, N-tile) partials of dp = <z, silu(g) u>.
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
int64_t swiglu_backward_n_tiles(int64_t intermediate);

// Weight gradient, K-grouped over the experts' padded rows r (zeros in pad rows):
//   c[e * m + i, j] = sum_r a[r, i] * b[r, j]     (a [rows, m], b [rows, n], both row-major)
// e.g. dW_down = (p dy)^T a and dW_gate_up = dh^T x. An expert without rows gets zeros.
struct WgradArgs {
  const __nv_bfloat16* a;
  const __nv_bfloat16* b;
  int64_t padded_rows;           // rows allocated in a and b (>= tile_offsets[E] * 128)
  int64_t m, n;                  // multiples of 128
  int64_t num_experts;
  const int32_t* tile_offsets;   // device [E+1]
  __nv_bfloat16* c;              // [num_experts * m, n], written (unused with c_accumulate)
  float* c_accumulate = nullptr; // [num_experts * m, n] fp32: C += the gradient instead
};
void grouped_gemm_wgrad(const WgradArgs& args, cudaStream_t stream);

// Rows of an M-tile: expert groups are padded to a multiple of this for tile_offsets.
constexpr int kGroupedGemmBlockM = 128;

}  // namespace megamoe::sm90
