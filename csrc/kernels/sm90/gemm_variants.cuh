// The parts of each GEMM of gemm.h, one alias each: the one place where parts are chosen.
// A new mainloop (e.g. FP8 with its scales) or a new A loader (e.g. one that waits on the
// arrival counters of an overlapped dispatch) is a new file plus a change to a line here.
#pragma once

#include <type_traits>

#include "kernels/sm90/epilogue_fp8_rows.cuh"
#include "kernels/sm90/epilogue_peer_rows.cuh"
#include "kernels/sm90/epilogue_store.cuh"
#include "kernels/sm90/epilogue_swiglu_backward.cuh"
#include "kernels/sm90/epilogue_swiglu_saved_h.cuh"
#include "kernels/sm90/epilogue_weight_grad.cuh"
#include "kernels/sm90/grouped_gemm_kernel.cuh"
#include "kernels/sm90/mainloop_bf16.cuh"
#include "kernels/sm90/mainloop_fp8.cuh"
#include "kernels/sm90/operand_gathered.cuh"
#include "kernels/sm90/operand_tma.cuh"

// Wider tiles halve the shared-memory traffic per MMA; 128-wide ones cover the other sizes.
// (The bf16 m_grouped_gemm_nt and _nt_swiglu and the M-grouped FP8 GEMMs; a build with 128
// measures the narrow tiles alone.)
#ifndef MEGAMOE_GEMM_MAX_BLOCK_N
#define MEGAMOE_GEMM_MAX_BLOCK_N 256
#endif

namespace megamoe::sm90 {

// M-grouped: A by TMA or gathered, B by TMA in the mainloop's major order, with the B tile
// the epilogue needs. K-grouped: both by TMA.
template <class Mainloop, bool kGathered, class Epilogue>
using MGroupedGemm =
    GroupedGemm<Grouping::kM, Mainloop,
                std::conditional_t<kGathered, AGathered<Mainloop>, ATma<Mainloop>>,
                BTma<Mainloop, Epilogue::kBColumns>, Epilogue>;
template <class Mainloop, class Epilogue>
using KGroupedGemm =
    GroupedGemm<Grouping::kK, Mainloop, ATma<Mainloop, Grouping::kK>, BTma<Mainloop>, Epilogue>;

template <int kBlockN, bool kGathered>
using MGroupedGemmNt =
    MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kK>, kGathered, StoreEpilogue<kBlockN>>;
// The same GEMM with its rows sent to their tokens' ranks (m_grouped_gemm_nt_to_peers).
template <int kBlockN>
using MGroupedGemmNtToPeers =
    MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kK>, false, PeerRowsEpilogue<kBlockN>>;
template <int kBlockN, bool kGathered>
using MGroupedGemmNn =
    MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kMN>, kGathered, StoreEpilogue<kBlockN>>;
// The same with its rows sent to their tokens' ranks (m_grouped_gemm_nn_to_peers).
template <int kBlockN>
using MGroupedGemmNnToPeers =
    MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kMN>, false, PeerRowsEpilogue<kBlockN>>;
template <int kBlockN, bool kGathered>
using MGroupedGemmNtSwiGLU = MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kK>, kGathered,
                                          SwiGLUSavedHEpilogue<kBlockN>>;
template <int kBlockN, bool kGathered>
using MGroupedGemmNnSwiGLUBackward =
    MGroupedGemm<MainloopBf16<kBlockN, Major::kK, Major::kMN>, kGathered,
                 SwiGLUBackwardEpilogue<kBlockN>>;
template <int kBlockN>
using KGroupedGemmTn =
    KGroupedGemm<MainloopBf16<kBlockN, Major::kMN, Major::kMN>, WeightGradEpilogue<kBlockN>>;

// Blockwise FP8 (gemm_fp8.h): B K-major, weights scaled per 128 x 128 block. 256-wide tiles
// where N allows and A comes by TMA (the gathering producer needs more registers than the
// wide consumers leave it), 128-wide otherwise; the weight gradients' B scaled per row like
// A. The SwiGLU L1 writes its output in bf16 or, with kFp8Rows (wide tiles only: a row's
// 128 output columns are then one 1x128 block), as the e4m3 rows the FP8 L2 reads.
template <int kBlockN, BColumns kColumns = BColumns::kContiguous>
using WeightScales = MainloopFp8<BScales::kBlocks128, kColumns, kBlockN>;
template <int kBlockN, bool kGathered>
using MGroupedFp8GemmNt = MGroupedGemm<WeightScales<kBlockN>, kGathered, StoreEpilogue<kBlockN>>;
// The same with its rows sent to their tokens' ranks (m_grouped_fp8_gemm_nt_to_peers).
template <int kBlockN>
using MGroupedFp8GemmNtToPeers =
    MGroupedGemm<WeightScales<kBlockN>, false, PeerRowsEpilogue<kBlockN>>;
template <int kBlockN, bool kFp8Rows>
using SwiGLUOutput = std::conditional_t<kFp8Rows, Fp8RowsEpilogue<kBlockN, SwiGLUValues<kBlockN>>,
                                        SwiGLUEpilogue<kBlockN>>;
template <int kBlockN, bool kGathered, bool kFp8Rows = false>
using MGroupedFp8GemmNtSwiGLU =
    MGroupedGemm<WeightScales<kBlockN, BColumns::kGateUpHalves>, kGathered,
                 SwiGLUSavedHEpilogue<kBlockN, SwiGLUOutput<kBlockN, kFp8Rows>>>;
template <int kBlockN, bool kGathered>
using MGroupedFp8GemmNtSwiGLUBackward =
    MGroupedGemm<WeightScales<kBlockN>, kGathered, SwiGLUBackwardEpilogue<kBlockN, true>>;
// kBScales: kRows, or kRowTiles for B quantized in 128 x 128 tiles (gemm_fp8.h).
template <int kBlockN, BScales kBScales = BScales::kRows>
using KGroupedFp8GemmTn = KGroupedGemm<MainloopFp8<kBScales, BColumns::kContiguous, kBlockN>,
                                       WeightGradEpilogue<kBlockN>>;

}  // namespace megamoe::sm90
