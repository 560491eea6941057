// The sm_90a blockwise-FP8 grouped GEMMs of the expert layers (host API): the same GEMMs as
// gemm.h (same names with _fp8_, same groups, C and epilogues), with e4m3 operands and fp32
// block scales (the DeepSeek-V3 recipe; megamoe/fp8.py is its reference). FP8 wgmma reads
// both operands K-major, so every B is stored [n, k] (a weight's transposed copy where the
// bf16 GEMM reads it N-major) and the weight gradients' operands token-contiguous. Tiles are
// kGemmBlockM x 256 where N allows (a multiple of 256 output columns, A not gathered), else
// kGemmBlockM x 128; K is a multiple of 128 (one scale block).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/sm90/gemm.h"

namespace megamoe::sm90 {

// A [rows, k] e4m3 row-major with 1x128 scales: the scale of row r's k-block j (columns
// 128j..) at scales[j * scale_ld + r], r a row of `data` (for a gathered A, the source row).
// scale_ld >= rows, a multiple of 4. Materialised in `layout`, or gathered as in gemm.h.
struct MGroupedFp8A {
  const __nv_fp8_e4m3* data = nullptr;
  int64_t rows = 0;
  RowLayout layout = RowLayout::kSorted;
  const int32_t* gather = nullptr;
  const float* scales = nullptr;
  int64_t scale_ld = 0;
};

// The experts' weights, B_e [n, k] e4m3 stacked to [E * n, k], with one scale per 128 x 128
// block: block (i, j) of expert e (rows 128i.., columns 128j..) at
// scales[e * s_expert + i * s_n + j * s_k]. The strides let a transposed copy of W read W's
// own scales (a block's scale serves W and W^T).
struct Fp8Weights {
  const __nv_fp8_e4m3* data = nullptr;
  const float* scales = nullptr;
  int64_t s_expert = 0, s_n = 0, s_k = 0;
};

struct MGroupedFp8GemmArgs {
  ExpertGroups groups;
  MGroupedFp8A a;
  Fp8Weights b;
  int64_t k = 0;  // multiple of 128
  int64_t n = 0;  // output columns
  MGroupedC c;
};

// C[r, :n] = A_r . B_e^T (bf16 C), b = [E * n, k]; n a multiple of 128. E.g. L2 (w_down
// [E, H, I]) and the dgrad of L1 (W_gate_up^T [E, H, 2I]).
void m_grouped_fp8_gemm_nt(const MGroupedFp8GemmArgs& args, cudaStream_t stream);
// m_grouped_fp8_gemm_nt with every output row sent as m_grouped_gemm_nt_to_peers sends them
// (gemm.h: the expert-parallel epilogue combine's L2 and L1 dgrad). A materialised, n a
// multiple of 128; the same bits per row as m_grouped_fp8_gemm_nt.
void m_grouped_fp8_gemm_nt_to_peers(const MGroupedFp8GemmArgs& args, const PeerRowsOut& out,
                                    cudaStream_t stream);

// L1 with the SwiGLU: as m_grouped_gemm_nt_swiglu, b = w_gate_up [E * 2n, k] (n = I, a
// multiple of 128), h optional.
void m_grouped_fp8_gemm_nt_swiglu(const MGroupedFp8GemmArgs& args, __nv_bfloat16* h,
                                  cudaStream_t stream);

// The SwiGLU output quantized for an FP8 GEMM that reads it as its A (MGroupedFp8A): e4m3
// rows q [c.rows, n] (row-major, ld = n) in C's row layout with 1x128 scales, the scale of
// row r's block j (columns 128j..) at scales[j * scale_ld + r]; q and scales 16-byte
// aligned, scale_ld >= c.rows and a multiple of 4. The rows C would have are written, the
// others are left as they are.
struct Fp8RowsOut {
  __nv_fp8_e4m3* q = nullptr;
  float* scales = nullptr;
  int64_t scale_ld = 0;
};

// The same GEMM writing `out` instead of a bf16 C (args.c gives the rows and their layout;
// c.data must be null): the bits of the bf16 C quantized by quantize_fp8 (kRows1x128), in
// one pass. Only where a tile's output columns are one 1x128 block, the 256-wide tiles:
// fp8_swiglu_quantizes(n, gathered) says whether a call can (A by TMA, this build's tiles
// wide); the others are rejected.
void m_grouped_fp8_gemm_nt_swiglu(const MGroupedFp8GemmArgs& args, __nv_bfloat16* h,
                                  const Fp8RowsOut& out, cudaStream_t stream);
bool fp8_swiglu_quantizes(int64_t n, bool gathered);

// The dgrad of L2 with the SwiGLU backward, as m_grouped_gemm_nn_swiglu_backward, with
// b = W_down^T [E * I, H] (k = H, n = I, a multiple of 128) and dp_partial
// [groups.rows, fp8_swiglu_backward_dp_columns(I, A gathered)]: one partial per N-tile, and
// the tiles are 256-wide when I allows and A comes by TMA, else 128-wide (I / 128 partials,
// the most there can be).
void m_grouped_fp8_gemm_nt_swiglu_backward(const MGroupedFp8GemmArgs& args,
                                           const SwiGLUGradArgs& grads, cudaStream_t stream);
int64_t fp8_swiglu_backward_dp_columns(int64_t n, bool gathered);

// The weight gradient C[e * m + i, j] = sum_r a[r, i] * b[r, j] over expert e's padded rows,
// from token-contiguous copies with a scale per column and 128 rows:
//   a_t [m, padded_rows] e4m3, a_scales [padded_rows / 128, m] (column i, rows 128j.. at
//   a_scales[j * m + i]); b_t [n, padded_rows], b_scales [padded_rows / 128, n].
// m, n multiples of 128; C as in k_grouped_gemm_tn (bf16 written, or fp32 added into).
// b_tile_scales: b was quantized in 128 x 128 tiles (Fp8Blocks::kColumnTiles128: b_scales
// equal over each 128 of b's columns j), so that each k-block is promoted with one b scale
// per 128 columns of C instead of a product of two scales per element (about 20% of the
// kernel's time on the presets). The scales are not checked: with b_tile_scales and
// scales that differ within a tile, C is wrong.
struct KGroupedFp8GemmArgs {
  const __nv_fp8_e4m3* a_t = nullptr;
  const float* a_scales = nullptr;
  const __nv_fp8_e4m3* b_t = nullptr;
  const float* b_scales = nullptr;
  int64_t padded_rows = 0;
  int64_t m = 0, n = 0;
  int64_t num_experts = 0;
  const int32_t* tile_offsets = nullptr;
  __nv_bfloat16* c = nullptr;
  float* c_accumulate = nullptr;
  bool b_tile_scales = false;
};
void k_grouped_fp8_gemm_tn(const KGroupedFp8GemmArgs& args, cudaStream_t stream);

}  // namespace megamoe::sm90
