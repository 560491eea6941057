// k_grouped_fp8_gemm_tn: the blockwise-FP8 weight gradients (gemm_fp8.h).
#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm_fp8.h"
#include "kernels/sm90/gemm_variants.cuh"

namespace megamoe::sm90 {
namespace {

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<KGroupedFp8GemmTn<256>>);

bool misaligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; }

}  // namespace

void k_grouped_fp8_gemm_tn(const KGroupedFp8GemmArgs& w, cudaStream_t stream) {
  if (w.m % kBlockM || w.n % 128 || w.m < 1 || w.n < 1) {
    throw_invalid("k_grouped_fp8_gemm_tn: M and N must be positive multiples of 128");
  }
  if (w.padded_rows % 128 != 0) {
    throw_invalid("k_grouped_fp8_gemm_tn: padded_rows must be a multiple of 128");
  }
  if (!w.a_t || !w.b_t || !w.a_scales || !w.b_scales || !(w.c || w.c_accumulate) ||
      !w.tile_offsets) {
    throw_invalid("k_grouped_fp8_gemm_tn: null a_t, b_t, a_scales, b_scales, tile_offsets, or "
                  "both c and c_accumulate");
  }
  if (misaligned(w.a_t) || misaligned(w.b_t) || misaligned(w.a_scales) || misaligned(w.b_scales)) {
    throw_invalid("k_grouped_fp8_gemm_tn: operands and scales must be 16-byte aligned");
  }
  if (w.padded_rows == 0 || w.num_experts == 0) return;
  // 256-wide tiles where N allows (gemm_variants.cuh).
  const auto run = [&](auto block_n, auto b_scales) {
    using Gemm = KGroupedFp8GemmTn<decltype(block_n)::value, decltype(b_scales)::value>;
    typename Gemm::Params p{};
    p.scheduler = Gemm::Scheduler::k_grouped(w.tile_offsets, w.num_experts, w.m, w.n / block_n);
    p.a = Gemm::ALoad::params(w.a_t, w.m, w.padded_rows, false, w.a_scales, w.m);
    p.b = Gemm::BLoad::params(w.b_t, w.n, w.padded_rows, 0, 0, w.b_scales);
    p.mainloop = {};
    p.epilogue = Gemm::Epilogue::params(w.c, w.c_accumulate, w.num_experts * w.m, w.n);
    launch_grouped_gemm<Gemm>(p, Gemm::Scheduler::max_tiles(p.scheduler, 0), stream);
  };
  const auto run_n = [&](auto b_scales) {
    if (MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && w.n % 256 == 0) {
      run(std::integral_constant<int, 256>{}, b_scales);
    } else {
      run(std::integral_constant<int, 128>{}, b_scales);
    }
  };
  if (w.b_tile_scales) {
    run_n(std::integral_constant<BScales, BScales::kRowTiles>{});
  } else {
    run_n(std::integral_constant<BScales, BScales::kRows>{});
  }
}

}  // namespace megamoe::sm90
