// m_grouped_gemm_nt_swiglu: L1 of the expert MLP, the SwiGLU (and optionally the saved h) in
// the epilogue.
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/m_grouped_launch.cuh"

namespace megamoe::sm90 {

[[maybe_unused]] static const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<MGroupedGemmNtSwiGLU<128, false>>);

void m_grouped_gemm_nt_swiglu(const MGroupedGemmArgs& a, __nv_bfloat16* h,
                              cudaStream_t stream, HRowShift h_shift) {
  const char* name = "m_grouped_gemm_nt_swiglu";
  if (a.n % 64 != 0 || a.n < 1) {
    throw_invalid(std::string(name) + ": I (n) must be a positive multiple of 64");
  }
  check_m_grouped(a, name);
  if (a.groups.rows == 0) return;
  // A 256-wide tile holds 128 gate and 128 up columns.
  const bool wide = MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && a.n % 128 == 0;
  dispatch_m_grouped(a, wide, [&](auto block_n, auto gathered) {
    constexpr int kBlockN = decltype(block_n)::value;
    using Gemm = MGroupedGemmNtSwiGLU<kBlockN, decltype(gathered)::value>;
    using Epilogue = typename Gemm::Epilogue;
    const auto b = Gemm::BLoad::params(a.b, a.groups.num_experts * 2 * a.n, a.k, 2 * a.n, a.n);
    const auto out = SwiGLUEpilogue<kBlockN>::params(a.c.data, a.c.rows, a.c.ld,
                                                     a.c.layout == RowLayout::kPadded);
    launch_m_grouped<Gemm>(a, b, a.n / Epilogue::kOutCols,
                           Epilogue::params(out, h, a.c.rows, a.n, h_shift), stream);
  });
}

}  // namespace megamoe::sm90
