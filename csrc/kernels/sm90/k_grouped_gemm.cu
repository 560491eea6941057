// k_grouped_gemm_tn: the weight gradients, K-grouped over the experts' padded rows.
#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/gemm_variants.cuh"

namespace megamoe::sm90 {
namespace {

template <int kBlockN>
void run(const KGroupedGemmArgs& w, cudaStream_t stream) {
  using Gemm = KGroupedGemmTn<kBlockN>;
  typename Gemm::Params p{};
  p.scheduler = Gemm::Scheduler::k_grouped(w.tile_offsets, w.num_experts, w.m, w.n / kBlockN);
  p.a = Gemm::ALoad::params(w.a, w.padded_rows, w.m, false);
  p.b = Gemm::BLoad::params(w.b, w.padded_rows, w.n, 0);  // expert rows start at k_row0
  p.mainloop = {MnMajorStrides{}.lbo, MnMajorStrides{}.sbo};
  p.epilogue = Gemm::Epilogue::params(w.c, w.c_accumulate, w.num_experts * w.m, w.n);
  launch_grouped_gemm<Gemm>(p, Gemm::Scheduler::max_tiles(p.scheduler, 0), stream);
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<KGroupedGemmTn<128>>);

}  // namespace

void k_grouped_gemm_tn(const KGroupedGemmArgs& w, cudaStream_t stream) {
  if (w.m % kBlockM || w.n % 128 || w.m < 1 || w.n < 1) {
    throw_invalid("k_grouped_gemm_tn: M and N must be positive multiples of 128");
  }
  if (!w.a || !w.b || !(w.c || w.c_accumulate) || !w.tile_offsets) {
    throw_invalid("k_grouped_gemm_tn: null a, b, tile_offsets, or both c and c_accumulate");
  }
  w.n % 256 == 0 ? run<256>(w, stream) : run<128>(w, stream);
}

}  // namespace megamoe::sm90
