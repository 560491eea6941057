// m_grouped_gemm_nn_swiglu_backward: the dgrad of L2 with the SwiGLU backward in the
// epilogue.
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/m_grouped_launch.cuh"

namespace megamoe::sm90 {

[[maybe_unused]] static const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<MGroupedGemmNnSwiGLUBackward<128, false>>);

void m_grouped_gemm_nn_swiglu_backward(const MGroupedGemmArgs& a, const SwiGLUGradArgs& g,
                                       cudaStream_t stream) {
  const std::string name = "m_grouped_gemm_nn_swiglu_backward";
  if (a.n % 128 != 0 || a.n < 1) throw_invalid(name + ": I (n) must be a positive multiple of 128");
  if (!g.h || !a.c.data || !g.slot_weights || !g.row_slot || !g.dp_partial) {
    throw_invalid(name + ": null h, dh (C), slot_weights, row_slot or dp_partial");
  }
  if (a.c.ld != 2 * a.n) throw_invalid(name + ": dh (C) must have ld = 2I (2n)");
  check_m_grouped(a, name.c_str());
  if (a.groups.rows == 0) return;
  dispatch_m_grouped(a, a.n % 256 == 0, [&](auto block_n, auto gathered) {
    constexpr int kBlockN = decltype(block_n)::value;
    using Gemm = MGroupedGemmNnSwiGLUBackward<kBlockN, decltype(gathered)::value>;
    const auto b = Gemm::BLoad::params(a.b, a.groups.num_experts * a.k, a.n, a.k);
    const auto epilogue = Gemm::Epilogue::params(
        g.h, a.groups.rows, a.c.data, g.a_out, a.c.rows, a.c.layout == RowLayout::kPadded,
        g.slot_weights, g.row_slot, g.dp_partial, a.n);
    launch_m_grouped<Gemm>(a, b, a.n / kBlockN, epilogue, stream);
  });
}

int64_t swiglu_backward_dp_columns(int64_t n) { return n % 256 == 0 ? n / 256 : n / 128; }

}  // namespace megamoe::sm90
