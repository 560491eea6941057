// Host side shared by the M-grouped GEMM launchers (m_grouped_gemm*.cu): argument checks,
// the choice of tile width and A loader, and the parameters common to all of them.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/gemm_variants.cuh"

namespace megamoe::sm90 {

static_assert(kGemmBlockM == kBlockM);

// Throws the argument errors every M-grouped GEMM shares; `name` is the function's.
inline void check_m_grouped(const MGroupedGemmArgs& a, const char* name) {
  const std::string who = name;
  if (a.k % 64 != 0 || a.k < 1) throw_invalid(who + ": K must be a positive multiple of 64");
  if (a.c.ld % 8 != 0 || reinterpret_cast<uintptr_t>(a.c.data) % 16) {
    throw_invalid(who + ": C rows must be 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(a.a.data) % 16 || reinterpret_cast<uintptr_t>(a.b) % 16) {
    throw_invalid(who + ": A and B must be 16-byte aligned");
  }
  if (a.a.gather != nullptr && a.a.rows < 1) {
    throw_invalid(who + ": gathered A has no rows");
  }
}

// Calls run(std::integral_constant<int, kBlockN>{}, std::bool_constant<gathered>{}) for
// 256-wide tiles if `wide`, else 128-wide, and A gathered if the call gathers.
template <class Run>
void dispatch_m_grouped(const MGroupedGemmArgs& a, bool wide, Run&& run) {
  using N128 = std::integral_constant<int, 128>;
  using N256 = std::integral_constant<int, 256>;
  if (a.a.gather != nullptr) {
    wide ? run(N256{}, std::true_type{}) : run(N128{}, std::true_type{});
  } else {
    wide ? run(N256{}, std::false_type{}) : run(N128{}, std::false_type{});
  }
}

// Launches Gemm (an MGroupedGemm, gemm_variants.cuh) on the call's groups and A, with its B and epilogue.
template <class Gemm>
void launch_m_grouped(const MGroupedGemmArgs& a, const typename Gemm::BLoad::Params& b,
                      int64_t n_tiles, const typename Gemm::Epilogue::Params& epilogue,
                      cudaStream_t stream, MnMajorStrides strides = {}) {
  using Mainloop = typename Gemm::Mainloop;
  typename Gemm::Params p{};
  p.scheduler = Gemm::Scheduler::m_grouped(a.groups.expert_offsets, a.groups.tile_offsets,
                                           a.groups.num_experts, a.k, n_tiles);
  if constexpr (std::is_same_v<typename Gemm::ALoad, AGathered<Mainloop>>) {
    p.a = Gemm::ALoad::params(a.a.data, a.a.gather, a.k);
  } else {
    p.a = Gemm::ALoad::params(a.a.data, a.a.rows, a.k, a.a.layout == RowLayout::kPadded);
  }
  p.b = b;
  p.mainloop = {strides.lbo, strides.sbo};
  p.epilogue = epilogue;
  launch_grouped_gemm<Gemm>(p, Gemm::Scheduler::max_tiles(p.scheduler, a.groups.rows), stream);
}

}  // namespace megamoe::sm90
