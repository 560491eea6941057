// The first host API (grouped_gemm.h) as forwards to gemm.h.
#include "kernels/sm90/grouped_gemm.h"

namespace megamoe::sm90 {
namespace {

MGroupedGemmArgs m_grouped_args(const GroupedGemmArgs& a, int64_t n) {
  MGroupedGemmArgs m;
  m.groups = {a.num_experts, a.expert_offsets, a.tile_offsets, a.a_rows};
  m.a.data = a.a;
  m.a.rows = a.a_row_index != nullptr ? a.a_source_rows : a.a_rows;
  m.a.layout = a.a_padded ? RowLayout::kPadded : RowLayout::kSorted;
  m.a.gather = a.a_row_index;
  m.b = a.b;
  m.k = a.k;
  m.n = n;
  m.c = {a.c, a.ldc, a.c_rows > 0 ? a.c_rows : a.a_rows,
         a.c_padded ? RowLayout::kPadded : RowLayout::kSorted};
  return m;
}

}  // namespace

void grouped_gemm_swiglu(const GroupedGemmArgs& args, int64_t intermediate, cudaStream_t stream) {
  m_grouped_gemm_nt_swiglu(m_grouped_args(args, intermediate), args.h_out, stream);
}

void grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  m_grouped_gemm_nt(m_grouped_args(args, args.b_rows_per_expert), stream);
}

void grouped_gemm_b_n_major(const GroupedGemmArgs& args, cudaStream_t stream,
                            MnMajorStrides strides) {
  m_grouped_gemm_nn(m_grouped_args(args, args.n), stream, strides);
}

void grouped_gemm_swiglu_backward(const GroupedGemmArgs& args, const SwiGLUBackwardArgs& bw,
                                  cudaStream_t stream) {
  MGroupedGemmArgs m = m_grouped_args(args, args.n);
  m.c.data = bw.dh;
  m.c.ld = 2 * args.n;
  m_grouped_gemm_nn_swiglu_backward(m, {bw.h, bw.slot_weights, bw.row_slot, bw.dp_partial, bw.a_out},
                                    stream);
}

int64_t swiglu_backward_n_tiles(int64_t intermediate) {
  return swiglu_backward_dp_columns(intermediate);
}

void grouped_gemm_wgrad(const WgradArgs& args, cudaStream_t stream) {
  k_grouped_gemm_tn(args, stream);
}

}  // namespace megamoe::sm90
