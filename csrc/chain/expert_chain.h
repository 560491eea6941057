// The expert chain: the grouped GEMMs of the experts, forward and backward, over the rows
// this GPU computes. The one-GPU layer (fused/layer.cpp) and the expert-parallel layer
// (comm/ep_layer.cpp) differ only in how the rows arrive (a routing plan over local x, or
// the rows received from every rank) and where the results go (a combine into y and dx
// here, or the combine send to the tokens' ranks). Both run this code in between, so their
// GEMMs see the same operands in the same order: an expert's rows in the same order give
// bitwise the same results on either path.
//
//   forward:  L1 + SwiGLU (A rows gathered from the token matrix; optionally saving h) ->
//             activation; L2 -> the output rows, unweighted, one per row.
//   backward: L1 recomputed unless h was saved; dgrad of L2 with the SwiGLU backward
//             (dh and a padded, per-tile partials of dp); dgrad of L1 -> the dx rows;
//             then, once the caller has taken the dx rows and dp partials, the weight
//             gradients (K-grouped over each expert's padded rows).
// Precision::kFp8 runs every GEMM in blockwise FP8 (kernels/sm90/gemm_fp8.h), kFp8Backward
// the backward's only. Each GEMM's A is quantized once from bf16 just before it: x and dy
// straight into the sorted rows (each token read and its scales computed once, its e4m3 row
// written to every row it is routed to, so that the GEMMs read A by TMA: a gather producer
// cannot feed FP8's k-block rate), dh as rows, and the weight gradients' operands
// token-contiguous per 128 rows (quantize_fp8.h), p dy and x among them straight from the
// token matrices through the padded layout (no bf16 padded copy). The activation leaves the
// FP8 L1's epilogue already as L2's e4m3 rows (wide tiles; with a gathered A, as bf16 rows
// quantized after). MEGAMOE_FP8_GATHER_A=1 (read on every call) quantizes x and dy as token
// matrices instead and gathers the GEMMs' A rows, MEGAMOE_FP8_UNFUSED_COLS=1 gathers p dy
// and x into token_rows in bf16 before their column quantization,
// MEGAMOE_FP8_UNFUSED_ACT=1 writes the activation in bf16 and quantizes it after, and
// MEGAMOE_FP8_ROW_SCALES_SCATTERED=1 writes x's and dy's scales straight to every sorted row
// instead of once per token and then to the rows in order, for A/Bs on the GPU: the same
// bits either way. dh's rows and its token-contiguous copy come from
// one read of dh (quantize_fp8_rows_and_columns) when the caller wants both;
// MEGAMOE_FP8_UNFUSED_QUANT=1 quantizes them in two passes, for the same A/B. The weights'
// FP8 copies are the caller's (quantized once per optimizer step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/workspace.h"
#include "kernels/common/routing_plan.h"
#include "kernels/sm90/gemm.h"

namespace megamoe::chain {

// An e4m3 matrix with 1x128 scales, the scale of row r's block j at scales[j * scale_ld + r].
struct Fp8Rows {
  __nv_fp8_e4m3* q = nullptr;
  float* scales = nullptr;
  int64_t scale_ld = 0;
};
// The scale_ld of an Fp8Rows of `rows` rows: rows rounded up to a multiple of 4 (scale rows
// start 16-byte aligned for the GEMMs' TMA loads of them).
int64_t fp8_scale_ld(int64_t rows);
// An Fp8Rows [rows, cols] from the carver, with fp8_scale_ld(rows).
Fp8Rows carve_fp8_rows(WorkspaceCarver& carver, int64_t rows, int64_t cols);

// The rows, in expert-sorted order: expert e's rows are [expert_offsets[e],
// expert_offsets[e+1]) with their M-tiles (128 rows) from tile_offsets[e]; row r is row
// row_token[r] of the token matrices and carries the router weight
// slot_weights[row_slot[r]].
struct Rows {
  // expert_offsets, tile_offsets [E+1], row_token [rows]; backward: row_slot [rows]; FP8
  // (x and dy quantized into the sorted rows): slot_row [tokens * topk]. The other members
  // are not read.
  RoutingPlan plan;
  int64_t topk = 0;           // FP8: slots per token of plan.slot_row
  int64_t rows;               // rows allocated (at least expert_offsets[E])
  int64_t num_experts;        // E of the offsets, of the weights and of their gradients
  int64_t tokens;             // rows of x and dy
  const __nv_bfloat16* x;     // [tokens, H]
  const __nv_bfloat16* dy;    // [tokens, H], backward only
  const float* slot_weights;  // backward only
  // kFp8 forward: x already quantized as a token matrix [tokens, H] (quantize_tokens), e.g.
  // on the tokens' own rank before they moved: each token's e4m3 row and scales are copied
  // to its sorted rows (by slot_row) instead of quantized there, and x is not read. The same
  // bits. q null: x is quantized here.
  Fp8Rows x_quantized = {};
  // FP8: plan.row_token is the exact inverse of plan.slot_row over `rows` rows (a plan of
  // build_routing_plan): x and dy are then quantized into the sorted rows with their scales
  // written once per token and moved to the rows in order (Fp8RowDests::sources). The
  // same bits.
  bool row_token_inverts_slot_row = false;
};

// x [tokens, cols] bf16 quantized into out [tokens, cols] (scale_ld >= tokens) as
// Rows::x_quantized takes it: each row's e4m3 values and 1x128 scales are those the chain
// gives the row when it quantizes x itself.
void quantize_tokens(const __nv_bfloat16* x, int64_t tokens, int64_t cols, const Fp8Rows& out,
                     cudaStream_t stream);

enum class Precision { kBf16, kFp8, kFp8Backward };

// A weight W [E, N, K] quantized per 128 x 128 block: q = W's e4m3 values, q_t = W^T's
// ([E, K, N]), scales [E, N/128, K/128] (they serve both).
struct Fp8Weight {
  const __nv_fp8_e4m3* q = nullptr;
  const __nv_fp8_e4m3* q_t = nullptr;
  const float* scales = nullptr;
};

// The experts' weights: w_gate_up [E, 2I, H] and w_down [E, H, I] bf16, and their FP8
// copies for the precisions that use them.
struct Experts {
  const __nv_bfloat16* w_gate_up;
  const __nv_bfloat16* w_down;
  int64_t hidden;        // H, a multiple of 128
  int64_t intermediate;  // I, a multiple of 128
  Precision precision = Precision::kBf16;
  Fp8Weight fp8_gate_up = {}, fp8_down = {};
  bool fp8_forward() const { return precision == Precision::kFp8; }
  bool fp8_backward() const { return precision != Precision::kBf16; }
};

// A token-contiguous e4m3 copy [C, padded_rows] with scales [padded_rows / 128, C].
struct Fp8Columns {
  __nv_fp8_e4m3* q = nullptr;
  float* scales = nullptr;
};

// A weight gradient: written in bf16 into `bf16`, or added into the fp32 buffer `f32`
// (one of them; neither skips it).
struct WeightGrad {
  __nv_bfloat16* bf16 = nullptr;
  float* f32 = nullptr;

  // The gradient of a tensor of `data`: added into when fp32, written when bf16.
  static WeightGrad of(void* data, bool is_fp32) {
    WeightGrad g;
    if (is_fp32) {
      g.f32 = static_cast<float*>(data);
    } else {
      g.bf16 = static_cast<__nv_bfloat16*>(data);
    }
    return g;
  }
  bool wanted() const { return bf16 != nullptr || f32 != nullptr; }
};

struct ForwardBuffers {
  // [rows, I] silu(gate) * up. kFp8: written only where L1 cannot write activation_fp8
  // itself (a gathered A, MEGAMOE_FP8_UNFUSED_ACT), which is decided per call: carved always.
  __nv_bfloat16* activation;
  __nv_bfloat16* out;         // [rows, H] the L2 output rows
  // kFp8: x's sorted rows [rows, H] (MEGAMOE_FP8_GATHER_A: the token matrix [tokens, H]),
  // in out's bytes: L2 writes out after L1 has read them.
  Fp8Rows x_fp8;
  Fp8Rows activation_fp8;     // kFp8: [rows, I]
  float* token_scales;        // kFp8: [tokens, H / 128] scratch of the x quantizer, in out's bytes
};
ForwardBuffers carve_forward(WorkspaceCarver& carver, int64_t rows, int64_t tokens, int64_t H,
                             int64_t I, Precision precision = Precision::kBf16);

// saved_h: null, or [rows, 2I] that receives h = [gate | up] for a backward in saved mode.
// l2_to_peers: null, or where L2 sends each output row instead of b.out (the expert-parallel
// epilogue combine, sm90::m_grouped_gemm_nt_to_peers / m_grouped_fp8_gemm_nt_to_peers): the
// same bits.
// with_l2 false: L1 only (saved_h's bits, b.out not written), for a forward whose output
// is not wanted (the recompute of an activation-checkpointed region).
void forward(const Rows& rows, const Experts& w, const ForwardBuffers& b,
             __nv_bfloat16* saved_h, cudaStream_t stream,
             const sm90::PeerRowsOut* l2_to_peers = nullptr, bool with_l2 = true);
// The bf16 forward's two halves: L1 + SwiGLU into b.activation, and L2 from it, each over the
// rows' plan only (activation rows outside it are neither written nor read). The
// expert-parallel forward that overlaps its dispatch runs them on two plans over disjoint
// rows of the same buffers, one before the peers' rows have arrived; h_shift then puts each
// plan's rows of saved_h where the default layout has them.
void forward_l1(const Rows& rows, const Experts& w, const ForwardBuffers& b,
                __nv_bfloat16* saved_h, cudaStream_t stream, sm90::HRowShift h_shift = {});
void forward_l2(const Rows& rows, const Experts& w, const ForwardBuffers& b, cudaStream_t stream,
                const sm90::PeerRowsOut* l2_to_peers = nullptr);

// The backward's rows: unpadded ones in row order, padded ones (padded_rows =
// padded_rows_bound(rows, E)) at tile_offsets[e] * 128 + i, zeros in the pad rows, for the
// weight gradients.
struct BackwardBuffers {
  __nv_bfloat16* h;         // [rows, 2I] recomputed L1 output (null when h is saved)
  __nv_bfloat16* dh;        // [padded_rows, 2I]
  __nv_bfloat16* a;         // [padded_rows, I] silu(g) u
  float* dp_partial;        // [rows, dp_parts]
  // [padded_rows, H], used in stream order: the FP8 copies of x and dy (below), then the dx
  // rows ([rows, H]) until the caller has consumed them, then the p * dy rows of dW_down
  // and the x rows of dW_gate_up (bf16: in this order; FP8: x's, then p dy's, and only
  // with MEGAMOE_FP8_UNFUSED_COLS, which is read per call, so the padded size stays).
  __nv_bfloat16* token_rows;
  // [rows, H] where the dgrad of L1 writes the dx rows: token_rows, or a buffer of their
  // own (carve_backward's separate_dx_rows), so that the bf16 weight gradients, which
  // gather into token_rows, can run while a reader of the dx rows still runs beside them.
  __nv_bfloat16* dx_rows;
  int64_t padded_rows;
  int64_t dp_parts;         // partials of dp per row: one per N-tile of I
  // FP8 backward: x (for an FP8 recompute) and dy in the sorted rows (MEGAMOE_FP8_GATHER_A:
  // as token matrices), one buffer in token_rows' bytes used in stream order before the dx
  // rows are written (x_fp8 = dy_fp8 when both are used); dh as rows; and the weight
  // gradients' operands, reused by both gradients in stream order: lhs [max(H, 2I),
  // padded_rows] (dh, written by the dgrad with dh's rows unless
  // MEGAMOE_FP8_UNFUSED_QUANT, then p dy), rhs [max(I, H), padded_rows] (x, then a).
  Fp8Rows dy_fp8, x_fp8, dh_fp8;
  Fp8Columns lhs_fp8, rhs_fp8;
  float* token_scales;      // FP8: [tokens, H / 128] scratch of the x and dy quantizers
};
// separate_dx_rows: dx_rows gets [rows, H] of its own instead of token_rows' bytes.
BackwardBuffers carve_backward(WorkspaceCarver& carver, int64_t rows, int64_t tokens,
                               int64_t num_experts, int64_t H, int64_t I, bool h_saved,
                               Precision precision = Precision::kBf16,
                               bool separate_dx_rows = false);

// What backward_dgrad did of backward_wgrad's work, for the backward_wgrad of the same call.
struct DgradDone {
  // FP8: dh's token-contiguous copy (dW_gate_up's lhs) is in b.lhs_fp8, written by the
  // pass that quantized dh's rows for the L1 dgrad (one read of dh instead of two).
  bool dh_columns = false;
};

// L1 recompute (unless saved_h, the forward's h for the same rows), dgrad of L2 with the
// SwiGLU backward, and, when dx_rows, dgrad of L1 into b.dx_rows. Afterwards, in stream
// order, b.dp_partial holds each row's dp partials and b.dx_rows its dx row.
// d_w_gate_up_wanted: the caller's backward_wgrad will compute dW_gate_up, so that an FP8
// dgrad may quantize dh for it along with dh's rows (unless MEGAMOE_FP8_UNFUSED_QUANT);
// pass the result on to backward_wgrad.
DgradDone backward_dgrad(const Rows& rows, const Experts& w, const __nv_bfloat16* saved_h,
                         const BackwardBuffers& b, bool dx_rows, cudaStream_t stream,
                         bool d_w_gate_up_wanted = false);
// The dgrad of L1 alone, for a caller that ran backward_dgrad without dx_rows (the two
// halves on either side of something else): the dx rows into b.dx_rows, as backward_dgrad
// with dx_rows would have written them; or, with dx_to_peers, each dx row sent to its slot on
// its token's rank instead (the expert-parallel epilogue combine,
// sm90::m_grouped_gemm_nn_to_peers / m_grouped_fp8_gemm_nt_to_peers): the same bits.
DgradDone backward_dgrad_l1(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                            cudaStream_t stream, bool d_w_gate_up_wanted = false,
                            const sm90::PeerRowsOut* dx_to_peers = nullptr);

// The weight gradients dW_down = (p dy)^T a and dW_gate_up = dh^T x ([E, H, I] and
// [E, 2I, H]; zeros, or nothing added, for experts without rows). Overwrites b.token_rows
// where wgrad_writes_token_rows(w) says so: launch it after whatever reads the dx rows then,
// unless they are apart (b.dx_rows != b.token_rows).
// `done`: what this call's backward_dgrad returned (nothing between them may write
// b.lhs_fp8).
void backward_wgrad(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                    const WeightGrad& d_w_gate_up, const WeightGrad& d_w_down,
                    cudaStream_t stream, const DgradDone& done = {});
// Whether backward_wgrad writes b.token_rows (and so must not run beside a reader of the dx
// rows there): the bf16 weight gradients gather p dy and x into it; the FP8 ones read the
// token matrices in place, unless MEGAMOE_FP8_UNFUSED_COLS routes them through it. Read per
// call, like that switch.
bool wgrad_writes_token_rows(const Experts& w);

}  // namespace megamoe::chain
