// The M-grouped blockwise-FP8 GEMMs (gemm_fp8.h): m_grouped_fp8_gemm_nt (and _to_peers),
// _nt_swiglu and _nt_swiglu_backward.
#include <limits>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm_fp8.h"
#include "kernels/sm90/gemm_variants.cuh"

namespace megamoe::sm90 {
namespace {

void check_fp8(const MGroupedFp8GemmArgs& a, const std::string& name) {
  if (a.k % 128 != 0 || a.k < 1) throw_invalid(name + ": K must be a positive multiple of 128");
  if (a.c.ld % 8 != 0 || reinterpret_cast<uintptr_t>(a.c.data) % 16) {
    throw_invalid(name + ": C rows must be 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(a.a.data) % 16 || reinterpret_cast<uintptr_t>(a.b.data) % 16) {
    throw_invalid(name + ": A and B must be 16-byte aligned");
  }
  if (!a.a.scales || !a.b.scales) throw_invalid(name + ": null A or B scales");
  // The producer forms B's scale offsets in 32 bits (MainloopFp8::load_extras); 2n rows
  // bound a gate-up B too.
  const int64_t last_scale = (a.groups.num_experts - 1) * a.b.s_expert +
                             (2 * a.n / 128) * a.b.s_n + (a.k / 128) * a.b.s_k;
  if (last_scale > std::numeric_limits<int32_t>::max()) {
    throw_invalid(name + ": B's block scales span more than 2^31 floats");
  }
  // TMA reads A's scales in rows of scale_ld floats: 16-byte strides.
  if (a.a.scale_ld % 4 != 0 || a.a.scale_ld < a.a.rows || reinterpret_cast<uintptr_t>(a.a.scales) % 16) {
    throw_invalid(name + ": A's scale_ld must be a multiple of 4 and at least A's rows, and "
                         "the scales 16-byte aligned");
  }
  if (a.a.gather != nullptr && a.a.rows < 1) throw_invalid(name + ": gathered A has no rows");
}

// Launches Gemm over the call's groups, its A (gathered or by TMA) with A's scales, B and
// the epilogue. up_block: the block row of an expert's first up row (gate-up B).
template <class Gemm>
void launch(const MGroupedFp8GemmArgs& a, const typename Gemm::BLoad::Params& b, int64_t n_tiles,
            int64_t up_block, const typename Gemm::Epilogue::Params& epilogue,
            cudaStream_t stream) {
  typename Gemm::Params p{};
  p.scheduler = Gemm::Scheduler::m_grouped(a.groups.expert_offsets, a.groups.tile_offsets,
                                           a.groups.num_experts, a.k, n_tiles);
  if constexpr (std::is_same_v<typename Gemm::ALoad, AGathered<typename Gemm::Mainloop>>) {
    p.a = Gemm::ALoad::params(a.a.data, a.a.gather, a.k, a.a.scales, a.a.scale_ld);
  } else {
    p.a = Gemm::ALoad::params(a.a.data, a.a.rows, a.k, a.a.layout == RowLayout::kPadded,
                              a.a.scales, a.a.scale_ld);
  }
  p.b = b;
  p.mainloop.b_scales = a.b.scales;
  p.mainloop.s_expert = a.b.s_expert;
  p.mainloop.s_n = static_cast<int32_t>(a.b.s_n);
  p.mainloop.s_k = static_cast<int32_t>(a.b.s_k);
  p.mainloop.up_block = static_cast<int32_t>(up_block);
  p.mainloop.a_sorted_tma = a.a.gather == nullptr && a.a.layout == RowLayout::kSorted;
  p.epilogue = epilogue;
  launch_grouped_gemm<Gemm>(p, Gemm::Scheduler::max_tiles(p.scheduler, a.groups.rows), stream);
}

// Calls run(std::integral_constant<int, kBlockN>{}, std::bool_constant<gathered>{}): 256-wide
// tiles if `wide` and A comes by TMA, else 128-wide (gemm_variants.cuh).
template <class Run>
void dispatch(const MGroupedFp8GemmArgs& a, bool wide, Run&& run) {
  using N128 = std::integral_constant<int, 128>;
  using N256 = std::integral_constant<int, 256>;
  if (a.a.gather != nullptr) {
    run(N128{}, std::true_type{});
  } else {
    wide ? run(N256{}, std::false_type{}) : run(N128{}, std::false_type{});
  }
}

// N in 256-wide tiles: a multiple of 256 output columns (not for a gathered A).
bool wide_n(bool gathered, int64_t n) {
  return MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && !gathered && n % 256 == 0;
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<MGroupedFp8GemmNt<256, false>>);

}  // namespace

void m_grouped_fp8_gemm_nt(const MGroupedFp8GemmArgs& a, cudaStream_t stream) {
  const std::string name = "m_grouped_fp8_gemm_nt";
  if (a.n % 128 != 0 || a.n < 1) throw_invalid(name + ": N must be a positive multiple of 128");
  check_fp8(a, name);
  if (a.groups.rows == 0) return;
  dispatch(a, wide_n(a.a.gather != nullptr, a.n), [&](auto block_n, auto gathered) {
    using Gemm = MGroupedFp8GemmNt<decltype(block_n)::value, decltype(gathered)::value>;
    const auto b = Gemm::BLoad::params(a.b.data, a.groups.num_experts * a.n, a.k, a.n);
    const auto epilogue = Gemm::Epilogue::params(a.c.data, a.c.rows, a.c.ld,
                                                 a.c.layout == RowLayout::kPadded);
    launch<Gemm>(a, b, a.n / block_n, 0, epilogue, stream);
  });
}

void m_grouped_fp8_gemm_nt_to_peers(const MGroupedFp8GemmArgs& a, const PeerRowsOut& out,
                                    cudaStream_t stream) {
  const char* name = "m_grouped_fp8_gemm_nt_to_peers";
  check_peer_rows_out(out, a.n, a.a.gather != nullptr, name);
  check_fp8(a, name);
  if (a.groups.rows == 0) return;
  // The tile width m_grouped_fp8_gemm_nt takes for the same n: the same bits per row.
  const auto run = [&](auto block_n) {
    using Gemm = MGroupedFp8GemmNtToPeers<decltype(block_n)::value>;
    const auto b = Gemm::BLoad::params(a.b.data, a.groups.num_experts * a.n, a.k, a.n);
    launch<Gemm>(a, b, a.n / block_n, 0, Gemm::Epilogue::params(out, a.n), stream);
  };
  if (wide_n(false, a.n)) {
    run(std::integral_constant<int, 256>{});
  } else {
    run(std::integral_constant<int, 128>{});
  }
}

namespace {

// The checks of both SwiGLU entries.
void check_swiglu(const MGroupedFp8GemmArgs& a, const std::string& name) {
  // A tile's 64 gate rows must lie in one 128-row scale block, and so must its up rows.
  if (a.n % 128 != 0 || a.n < 1) throw_invalid(name + ": I (n) must be a positive multiple of 128");
  check_fp8(a, name);
}

// Launches the SwiGLU L1 with the output out_params(std::type_identity<Out>{}) gives, Out
// the output part of the tile's epilogue (gemm_variants.cuh). A 256-wide tile holds 128
// gate and 128 up columns: I a multiple of 128 is enough. The FP8 rows need the wide tile,
// which the caller has checked.
template <bool kFp8Rows, class OutParams>
void launch_swiglu(const MGroupedFp8GemmArgs& a, __nv_bfloat16* h, OutParams&& out_params,
                   cudaStream_t stream) {
  dispatch(a, wide_n(a.a.gather != nullptr, 2 * a.n), [&](auto block_n, auto gathered) {
    constexpr int kBlockN = decltype(block_n)::value;
    if constexpr (!kFp8Rows || (kBlockN == 256 && !decltype(gathered)::value)) {
      using Gemm = MGroupedFp8GemmNtSwiGLU<kBlockN, decltype(gathered)::value, kFp8Rows>;
      using Epilogue = typename Gemm::Epilogue;
      const auto b =
          Gemm::BLoad::params(a.b.data, a.groups.num_experts * 2 * a.n, a.k, 2 * a.n, a.n);
      const auto out = out_params(std::type_identity<SwiGLUOutput<kBlockN, kFp8Rows>>{});
      launch<Gemm>(a, b, a.n / Epilogue::kOutCols, a.n / 128,
                   Epilogue::params(out, h, a.c.rows, a.n), stream);
    }
  });
}

}  // namespace

void m_grouped_fp8_gemm_nt_swiglu(const MGroupedFp8GemmArgs& a, __nv_bfloat16* h,
                                  cudaStream_t stream) {
  check_swiglu(a, "m_grouped_fp8_gemm_nt_swiglu");
  if (a.groups.rows == 0) return;
  launch_swiglu<false>(a, h, [&](auto out) {
    return decltype(out)::type::params(a.c.data, a.c.rows, a.c.ld,
                                       a.c.layout == RowLayout::kPadded);
  }, stream);
}

void m_grouped_fp8_gemm_nt_swiglu(const MGroupedFp8GemmArgs& a, __nv_bfloat16* h,
                                  const Fp8RowsOut& out, cudaStream_t stream) {
  const std::string name = "m_grouped_fp8_gemm_nt_swiglu (FP8 rows out)";
  check_swiglu(a, name);
  if (a.a.gather != nullptr) {
    throw_invalid(name + ": out needs 256-wide tiles, which a gathered A (args.a.gather) "
                         "does not get: write a bf16 C and quantize it");
  }
  if (!fp8_swiglu_quantizes(a.n, false)) {
    throw_invalid(name + ": out needs 256-wide tiles, and this build's are at most 128 wide "
                         "(MEGAMOE_GEMM_MAX_BLOCK_N)");
  }
  if (a.c.data != nullptr) throw_invalid(name + ": args.c.data must be null (no bf16 C is written)");
  if (!out.q || !out.scales) throw_invalid(name + ": null out.q or out.scales");
  if (reinterpret_cast<uintptr_t>(out.q) % 16 || reinterpret_cast<uintptr_t>(out.scales) % 16) {
    throw_invalid(name + ": out.q and out.scales must be 16-byte aligned");
  }
  if (out.scale_ld % 4 != 0 || out.scale_ld < a.c.rows) {
    throw_invalid(name + ": out.scale_ld must be a multiple of 4 and at least args.c.rows");
  }
  if (a.groups.rows == 0) return;
  launch_swiglu<true>(a, h, [&](auto output) {
    return decltype(output)::type::params(out.q, out.scales, a.c.rows, a.n, out.scale_ld,
                                          a.c.layout == RowLayout::kPadded);
  }, stream);
}

bool fp8_swiglu_quantizes(int64_t n, bool gathered) { return wide_n(gathered, 2 * n); }

void m_grouped_fp8_gemm_nt_swiglu_backward(const MGroupedFp8GemmArgs& a, const SwiGLUGradArgs& g,
                                           cudaStream_t stream) {
  const std::string name = "m_grouped_fp8_gemm_nt_swiglu_backward";
  if (a.n % 128 != 0 || a.n < 1) throw_invalid(name + ": I (n) must be a positive multiple of 128");
  if (!g.h || !a.c.data || !g.slot_weights || !g.row_slot || !g.dp_partial) {
    throw_invalid(name + ": null h, dh (C), slot_weights, row_slot or dp_partial");
  }
  if (a.c.ld != 2 * a.n) throw_invalid(name + ": dh (C) must have ld = 2I (2n)");
  check_fp8(a, name);
  if (a.groups.rows == 0) return;
  dispatch(a, wide_n(a.a.gather != nullptr, a.n), [&](auto block_n, auto gathered) {
    using Gemm = MGroupedFp8GemmNtSwiGLUBackward<decltype(block_n)::value, decltype(gathered)::value>;
    const auto b = Gemm::BLoad::params(a.b.data, a.groups.num_experts * a.n, a.k, a.n);
    const auto epilogue = Gemm::Epilogue::params(
        g.h, a.groups.rows, a.c.data, g.a_out, a.c.rows, a.c.layout == RowLayout::kPadded,
        g.slot_weights, g.row_slot, g.dp_partial, a.n);
    launch<Gemm>(a, b, a.n / block_n, 0, epilogue, stream);
  });
}

int64_t fp8_swiglu_backward_dp_columns(int64_t n, bool gathered) {
  return n / (wide_n(gathered, n) ? 256 : 128);
}

}  // namespace megamoe::sm90
