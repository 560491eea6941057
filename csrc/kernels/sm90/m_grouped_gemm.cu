// m_grouped_gemm_nt and m_grouped_gemm_nn: M-grouped GEMMs with C stored in bf16, or each row
// sent to its slot on its token's rank (_to_peers).
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/m_grouped_launch.cuh"

namespace megamoe::sm90 {
namespace {

// B_e is [n, k] (nt) or [k, n] (nn), stacked over the experts.
template <Major kBMajor>
void run_store(const MGroupedGemmArgs& a, bool wide, const char* name, MnMajorStrides strides,
               cudaStream_t stream) {
  if (a.n % 128 != 0 || a.n < 1) {
    throw_invalid(std::string(name) + ": N must be a positive multiple of 128");
  }
  check_m_grouped(a, name);
  if (a.groups.rows == 0) return;
  dispatch_m_grouped(a, wide, [&](auto block_n, auto gathered) {
    constexpr int kBlockN = decltype(block_n)::value;
    constexpr bool kGathered = decltype(gathered)::value;
    using Gemm = std::conditional_t<kBMajor == Major::kK, MGroupedGemmNt<kBlockN, kGathered>,
                                    MGroupedGemmNn<kBlockN, kGathered>>;
    const int64_t experts = a.groups.num_experts;
    const auto b = kBMajor == Major::kK ? Gemm::BLoad::params(a.b, experts * a.n, a.k, a.n)
                                        : Gemm::BLoad::params(a.b, experts * a.k, a.n, a.k);
    const auto epilogue = Gemm::Epilogue::params(a.c.data, a.c.rows, a.c.ld,
                                                 a.c.layout == RowLayout::kPadded);
    launch_m_grouped<Gemm>(a, b, a.n / kBlockN, epilogue, stream, strides);
  });
}

// The same GEMMs with every output row sent to its slot on its token's rank (PeerRowsOut)
// instead of stored in C.
template <Major kBMajor>
void run_to_peers(const MGroupedGemmArgs& a, const PeerRowsOut& out, bool wide,
                  const char* name, cudaStream_t stream) {
  check_peer_rows_out(out, a.n, a.a.gather != nullptr, name);
  check_m_grouped(a, name);
  if (a.groups.rows == 0) return;
  const auto run = [&](auto block_n) {
    constexpr int kBlockN = decltype(block_n)::value;
    using Gemm = std::conditional_t<kBMajor == Major::kK, MGroupedGemmNtToPeers<kBlockN>,
                                    MGroupedGemmNnToPeers<kBlockN>>;
    const int64_t experts = a.groups.num_experts;
    const auto e = Gemm::Epilogue::params(out, a.n);
    const auto b = kBMajor == Major::kK ? Gemm::BLoad::params(a.b, experts * a.n, a.k, a.n)
                                        : Gemm::BLoad::params(a.b, experts * a.k, a.n, a.k);
    launch_m_grouped<Gemm>(a, b, a.n / kBlockN, e, stream);
  };
  if (wide) {
    run(std::integral_constant<int, 256>{});
  } else {
    run(std::integral_constant<int, 128>{});
  }
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&grouped_gemm_kernel<MGroupedGemmNt<128, false>>);

}  // namespace

void m_grouped_gemm_nt(const MGroupedGemmArgs& args, cudaStream_t stream) {
  run_store<Major::kK>(args, MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && args.n % 256 == 0,
                       "m_grouped_gemm_nt", {}, stream);
}

void check_peer_rows_out(const PeerRowsOut& out, int64_t n, bool gathered, const char* name) {
  if (n % 128 != 0 || n < 1 || n > INT32_MAX / 2) {
    throw_invalid(std::string(name) + ": N must be a positive multiple of 128");
  }
  if (gathered) throw_invalid(std::string(name) + ": A must be materialised");
  if (out.row_dest == nullptr || out.skip == nullptr || out.slots_per_rank < 1 ||
      out.slots_per_rank > INT32_MAX || out.rows_offset % 16 || out.done_offset % 4) {
    throw_invalid(std::string(name) + ": bad destination (row_dest, skip, slots, offsets)");
  }
}

void m_grouped_gemm_nt_to_peers(const MGroupedGemmArgs& a, const PeerRowsOut& out,
                                cudaStream_t stream) {
  // The tile width m_grouped_gemm_nt takes for the same n: the same bits per row.
  run_to_peers<Major::kK>(a, out, MEGAMOE_GEMM_MAX_BLOCK_N >= 256 && a.n % 256 == 0,
                          "m_grouped_gemm_nt_to_peers", stream);
}

void m_grouped_gemm_nn_to_peers(const MGroupedGemmArgs& a, const PeerRowsOut& out,
                                cudaStream_t stream) {
  // The tile width m_grouped_gemm_nn takes for the same n: the same bits per row.
  run_to_peers<Major::kMN>(a, out, a.n % 256 == 0, "m_grouped_gemm_nn_to_peers", stream);
}

void m_grouped_gemm_nn(const MGroupedGemmArgs& args, cudaStream_t stream,
                       MnMajorStrides strides) {
  run_store<Major::kMN>(args, args.n % 256 == 0, "m_grouped_gemm_nn", strides, stream);
}

}  // namespace megamoe::sm90
