#include "chain/expert_chain.h"

#include <algorithm>
#include <type_traits>

#include "core/env_switch.h"
#include "core/error.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/quantize_fp8.h"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/gemm_fp8.h"

namespace megamoe::chain {
namespace {

using sm90::RowLayout;

// An M-grouped GEMM over the rows: A with k columns, the experts' weights b, and
// C = c [rows, n] in row order; bf16 (MGroupedA, weights) or FP8 (MGroupedFp8A, Fp8Weights).
template <class A, class B>
auto over_rows(const Rows& r, const A& a, const B& b, int64_t k, int64_t n, __nv_bfloat16* c) {
  std::conditional_t<std::is_same_v<A, sm90::MGroupedFp8A>, sm90::MGroupedFp8GemmArgs,
                     sm90::MGroupedGemmArgs>
      g;
  g.groups = {r.num_experts, r.plan.expert_offsets, r.plan.tile_offsets, r.rows};
  g.a = a;
  g.b = b;
  g.k = k;
  g.n = n;
  g.c = {c, n, r.rows, RowLayout::kSorted};
  return g;
}

// A gathered from a token matrix by the GEMM's producer (no permuted copy of the tokens is
// written).
sm90::MGroupedA gathered(const Rows& r, const __nv_bfloat16* tokens) {
  return {tokens, r.tokens, RowLayout::kSorted, r.plan.row_token};
}

// ---- FP8 ------------------------------------------------------------------------------

// A bf16 buffer of `elements` whose bytes also hold, before it is written, an e4m3 copy of
// rows x cols with its scales (`fp8`) and the quantizer's scratch of the token matrix's
// scales (`token_scales`, [tokens, cols / 128]): the piece is as large as the larger of the
// two.
__nv_bfloat16* carve_shared_with_rows(WorkspaceCarver& c, int64_t elements, int64_t rows,
                                      int64_t tokens, int64_t cols, Fp8Rows& fp8,
                                      float*& token_scales) {
  const auto carve = [&](WorkspaceCarver& w) {
    fp8 = carve_fp8_rows(w, rows, cols);
    token_scales = w.take<float>(tokens * (cols / 128));
  };
  WorkspaceCarver count;
  carve(count);
  const size_t bytes = std::max(static_cast<size_t>(elements) * sizeof(__nv_bfloat16),
                                count.bytes());
  char* piece = c.take<char>(static_cast<int64_t>(bytes));
  WorkspaceCarver inside(piece, bytes);  // counts only when `c` does (piece is null)
  carve(inside);
  return reinterpret_cast<__nv_bfloat16*>(piece);
}

Fp8Columns carve_columns(WorkspaceCarver& c, int64_t padded_rows, int64_t cols) {
  return {c.take<__nv_fp8_e4m3>(cols * padded_rows), c.take<float>(padded_rows / 128 * cols)};
}

// x [rows, cols] bf16 (row-major, ld = cols) -> 1x128 blocks, row r of x at row r of out,
// or, with dests.rows, at the rows of out that dests gives it (quantize_fp8_to_rows).
// rows_args: the quantizer's arguments for the first.
Fp8QuantizeArgs rows_args(const __nv_bfloat16* x, int64_t rows, int64_t cols,
                          const Fp8Rows& out) {
  Fp8QuantizeArgs q;
  q.x = x;
  q.x_row = cols;
  q.rows = rows;
  q.cols = cols;
  q.q = reinterpret_cast<uint8_t*>(out.q);
  q.q_row = cols;
  q.scales = out.scales;
  q.s_0 = 1;
  q.s_1 = out.scale_ld;
  return q;
}
void quantize_rows(const __nv_bfloat16* x, int64_t rows, int64_t cols, const Fp8Rows& out,
                   cudaStream_t stream, const Fp8RowDests& dests = {}) {
  const Fp8QuantizeArgs q = rows_args(x, rows, cols, out);
  if (dests.rows != nullptr) {
    quantize_fp8_to_rows(q, dests, stream);
  } else {
    quantize_fp8(Fp8Blocks::kRows1x128, q, stream);
  }
}

// The column quantization of [padded_rows, cols] bf16 rows (x's rows of `cols` elements)
// into the token-contiguous copy `out` [cols, padded_rows].
Fp8QuantizeArgs columns_args(const __nv_bfloat16* x, int64_t padded_rows, int64_t cols,
                             const Fp8Columns& out) {
  Fp8QuantizeArgs q;
  q.x = x;
  q.x_row = cols;
  q.rows = padded_rows;
  q.cols = cols;
  q.q_t = reinterpret_cast<uint8_t*>(out.q);
  q.t_row = padded_rows;
  q.scales = out.scales;
  q.s_0 = 1;
  q.s_1 = cols;
  return q;
}

// x [padded_rows, cols] bf16 -> the token-contiguous copy [cols, padded_rows], with a scale
// per column and 128 rows (kColumns128) or per 128 x 128 tile (kColumnTiles128).
void quantize_columns(const __nv_bfloat16* x, int64_t padded_rows, int64_t cols,
                      const Fp8Columns& out, cudaStream_t stream,
                      Fp8Blocks blocks = Fp8Blocks::kColumns128) {
  quantize_fp8(blocks, columns_args(x, padded_rows, cols, out), stream);
}

// The FP8 chain's switches below (core/env_switch.h) are read on every call (one getenv) so
// that a test can compare both paths in one process; a CUDA graph keeps the path it was
// captured with.

// MEGAMOE_FP8_UNFUSED_COLS set (and not "0"): the FP8 weight gradients' token-row operands
// (p dy and x) are gathered into b.token_rows in bf16 (gather_rows_padded) and
// column-quantized from there, instead of column-quantized straight from the token matrix
// (quantize_fp8_columns_gathered). A diagnostic, for an A/B of the two on the GPU; the
// bits are the same.
bool fp8_unfused_columns() { return env_switch("MEGAMOE_FP8_UNFUSED_COLS"); }

// MEGAMOE_FP8_UNFUSED_QUANT set (and not "0"): the FP8 backward quantizes dh into its 1x128
// rows (the L1 dgrad's A) and into its token-contiguous copy (dW_gate_up's lhs) in two
// passes, each reading dh, instead of one pass that reads it once
// (quantize_fp8_rows_and_columns). A diagnostic, for an A/B of the two on the GPU; the
// bits are the same.
bool fp8_unfused_quantization() { return env_switch("MEGAMOE_FP8_UNFUSED_QUANT"); }

// MEGAMOE_FP8_WGRAD_TILES set (and not "0"), opt-in: the FP8 weight gradients' activation
// operands (x for dW_gate_up, a for dW_down) quantized in 128 x 128 tiles (128 channels x
// 128 tokens) instead of per channel and 128 tokens, so that their GEMMs promote each
// k-block with one scale per 128 columns rather than a product of two scales per element
// (b_tile_scales of k_grouped_fp8_gemm_tn). Coarser than the recipe: docs/fp8.md says what
// it costs and buys. The gradient operands (dh, p dy) keep their per-channel scales. Read
// on every call, like the diagnostic switches.
bool fp8_wgrad_tiles() { return env_switch("MEGAMOE_FP8_WGRAD_TILES"); }

// The padded rows of the plan over a token matrix (x, or dy scaled by the rows' slot
// weights: p dy), [padded_rows, cols] as gather_rows_padded writes them, quantized into
// the token-contiguous copy `out` without the bf16 copy (or, with fp8_unfused_columns(),
// through it in `padded`). Column blocks from tile_offsets[E] on are written only by the
// unfused path (from whatever `padded` holds there); the K-grouped GEMMs read none.
void quantize_token_columns(const Rows& r, const __nv_bfloat16* tokens,
                            const float* slot_weights, int64_t cols, int64_t padded_rows,
                            __nv_bfloat16* padded, const Fp8Columns& out, cudaStream_t stream,
                            Fp8Blocks blocks = Fp8Blocks::kColumns128) {
  if (fp8_unfused_columns()) {
    gather_rows_padded(tokens, cols, r.plan, r.num_experts, slot_weights, padded_rows, padded,
                       stream);
    quantize_columns(padded, padded_rows, cols, out, stream, blocks);
    return;
  }
  Fp8PaddedSource src;
  src.expert_offsets = r.plan.expert_offsets;
  src.tile_offsets = r.plan.tile_offsets;
  src.row_token = r.plan.row_token;
  src.row_slot = r.plan.row_slot;
  src.slot_weights = slot_weights;
  src.num_experts = r.num_experts;
  quantize_fp8_columns_gathered(columns_args(tokens, padded_rows, cols, out), src, stream,
                                blocks);
}

// W [E, N, K] (scales [E, N/128, K/128]) as the B of an nt GEMM (B_e = W_e: the GEMM's n
// is N, its k is K) or, transposed, of the GEMM that reads it N-major in bf16 (B_e = W_e^T
// [K, N]: the GEMM's n-block j and k-block i are W's block (i, j)). The same scales either
// way.
sm90::Fp8Weights as_b(const Fp8Weight& w, int64_t N, int64_t K, bool transposed) {
  const int64_t nb = N / 128, kb = K / 128;
  if (!transposed) return {w.q, w.scales, nb * kb, kb, 1};
  return {w.q_t, w.scales, nb * kb, 1, kb};
}

// MEGAMOE_FP8_GATHER_A set (and not "0"): the FP8 GEMMs on x and dy gather their A rows
// from a token-matrix copy (the producer's cp.async) instead of reading the sorted copy by
// TMA. A diagnostic, for an A/B of the two paths on the GPU: the same bits, but for
// d topk_weights (the gathering GEMMs run 128-wide tiles, and the L2 dgrad's dp sums one
// partial per N-tile).
bool fp8_gather_a() { return env_switch("MEGAMOE_FP8_GATHER_A"); }

// The A operand of a GEMM over the rows on a token matrix (x or dy [tokens, cols]),
// quantized into `out` (at least max(rows, tokens) rows): by default every token's row and
// scales at each sorted row the plan routes it to (slot_row), read by TMA; with
// fp8_gather_a() the token matrix, gathered by the GEMM's producer. A row's values and
// scales do not depend on where they are written, and the mainloop's arithmetic per output
// not on how A arrives or on the tile width: each output has the same bits either way.
// quantized: the token matrix already quantized (Rows::x_quantized), copied instead of
// quantized (q null: quantize `tokens`); with fp8_gather_a() the GEMM gathers from it.
// MEGAMOE_FP8_ROW_SCALES_SCATTERED set (and not "0"): x's and dy's quantizer writes each
// scale straight to every sorted row its token goes to, instead of once per token and then
// moved to the rows in order (Fp8RowDests::sources). A diagnostic, for an A/B of the two on
// the GPU; the bits are the same.
bool fp8_row_scales_scattered() { return env_switch("MEGAMOE_FP8_ROW_SCALES_SCATTERED"); }

// token_scales: [r.tokens, cols / 128] scratch of the quantizer.
sm90::MGroupedFp8A token_rows_fp8(const Rows& r, const __nv_bfloat16* tokens,
                                  const Fp8Rows& quantized, int64_t cols, const Fp8Rows& out,
                                  float* token_scales, cudaStream_t stream) {
  if (fp8_gather_a()) {
    Fp8Rows from = quantized;
    if (from.q == nullptr) {
      quantize_rows(tokens, r.tokens, cols, out, stream);
      from = out;
    }
    return {from.q, r.tokens, RowLayout::kSorted, r.plan.row_token, from.scales, from.scale_ld};
  }
  if (r.tokens > 0 && (r.topk < 1 || r.plan.slot_row == nullptr)) {
    throw_invalid("expert chain: FP8 rows need the plan's slot_row and topk");
  }
  if (quantized.q != nullptr) {
    Fp8RowsCopyArgs copy;
    copy.q = reinterpret_cast<const uint8_t*>(quantized.q);
    copy.scales = quantized.scales;
    copy.scale_ld = quantized.scale_ld;
    copy.rows = r.tokens;
    copy.cols = cols;
    copy.out_q = reinterpret_cast<uint8_t*>(out.q);
    copy.out_scales = out.scales;
    copy.out_scale_ld = out.scale_ld;
    copy_fp8_to_rows(copy, {r.plan.slot_row, r.topk}, stream);
  } else {
    Fp8RowDests dests{r.plan.slot_row, r.topk};
    if (r.row_token_inverts_slot_row && !fp8_row_scales_scattered()) {
      dests.sources = r.plan.row_token;
      dests.dest_rows = r.rows;
      dests.row_scales = token_scales;
    }
    quantize_rows(tokens, r.tokens, cols, out, stream, dests);
  }
  // Sorted rows past expert_offsets[E] stay unwritten: the GEMMs store no row of them.
  return {out.q, r.rows, RowLayout::kSorted, nullptr, out.scales, out.scale_ld};
}

// MEGAMOE_FP8_UNFUSED_ACT set (and not "0"): the FP8 forward's L1 writes the activation in
// bf16 and quantize_rows makes L2's e4m3 rows of it, instead of its epilogue writing them
// (m_grouped_fp8_gemm_nt_swiglu with Fp8RowsOut). A diagnostic, for an A/B of the two on
// the GPU; the bits are the same.
bool fp8_unfused_activation() { return env_switch("MEGAMOE_FP8_UNFUSED_ACT"); }

}  // namespace

int64_t fp8_scale_ld(int64_t rows) { return (rows + 3) / 4 * 4; }

Fp8Rows carve_fp8_rows(WorkspaceCarver& c, int64_t rows, int64_t cols) {
  Fp8Rows r;
  r.scale_ld = fp8_scale_ld(rows);
  r.q = c.take<__nv_fp8_e4m3>(rows * cols);
  r.scales = c.take<float>(cols / 128 * r.scale_ld);
  return r;
}

void quantize_tokens(const __nv_bfloat16* x, int64_t tokens, int64_t cols, const Fp8Rows& out,
                     cudaStream_t stream) {
  quantize_rows(x, tokens, cols, out, stream);
}

ForwardBuffers carve_forward(WorkspaceCarver& carver, int64_t rows, int64_t tokens, int64_t H,
                             int64_t I, Precision precision) {
  ForwardBuffers b{};
  b.activation = carver.take<__nv_bfloat16>(rows * I);
  if (precision == Precision::kFp8) {
    b.out = carve_shared_with_rows(carver, rows * H, std::max(rows, tokens), tokens, H, b.x_fp8,
                                   b.token_scales);
    b.activation_fp8 = carve_fp8_rows(carver, rows, I);
  } else {
    b.out = carver.take<__nv_bfloat16>(rows * H);
  }
  return b;
}

void forward(const Rows& rows, const Experts& w, const ForwardBuffers& b,
             __nv_bfloat16* saved_h, cudaStream_t stream, const sm90::PeerRowsOut* l2_to_peers,
             bool with_l2) {
  const int64_t H = w.hidden, I = w.intermediate;
  if (w.fp8_forward()) {
    const sm90::MGroupedFp8A x =
        token_rows_fp8(rows, rows.x, rows.x_quantized, H, b.x_fp8, b.token_scales, stream);
    const sm90::Fp8Weights gate_up = as_b(w.fp8_gate_up, 2 * I, H, false);
    // L2's A straight from L1's epilogue where its tiles allow (A by TMA), else through the
    // bf16 activation.
    if (sm90::fp8_swiglu_quantizes(I, x.gather != nullptr) && !fp8_unfused_activation()) {
      sm90::m_grouped_fp8_gemm_nt_swiglu(
          over_rows(rows, x, gate_up, H, I, nullptr), saved_h,
          {b.activation_fp8.q, b.activation_fp8.scales, b.activation_fp8.scale_ld}, stream);
    } else {
      sm90::m_grouped_fp8_gemm_nt_swiglu(over_rows(rows, x, gate_up, H, I, b.activation),
                                         saved_h, stream);
      quantize_rows(b.activation, rows.rows, I, b.activation_fp8, stream);
    }
    if (!with_l2) return;
    const sm90::MGroupedFp8A activation{b.activation_fp8.q, rows.rows, RowLayout::kSorted,
                                        nullptr, b.activation_fp8.scales,
                                        b.activation_fp8.scale_ld};
    const sm90::Fp8Weights down = as_b(w.fp8_down, H, I, false);
    if (l2_to_peers != nullptr) {
      sm90::m_grouped_fp8_gemm_nt_to_peers(over_rows(rows, activation, down, I, H, nullptr),
                                           *l2_to_peers, stream);
    } else {
      sm90::m_grouped_fp8_gemm_nt(over_rows(rows, activation, down, I, H, b.out), stream);
    }
    return;
  }
  forward_l1(rows, w, b, saved_h, stream);
  if (with_l2) forward_l2(rows, w, b, stream, l2_to_peers);
}

void forward_l1(const Rows& rows, const Experts& w, const ForwardBuffers& b,
                __nv_bfloat16* saved_h, cudaStream_t stream, sm90::HRowShift h_shift) {
  if (w.fp8_forward()) throw_invalid("expert chain: forward_l1 is the bf16 forward's");
  sm90::m_grouped_gemm_nt_swiglu(
      over_rows(rows, gathered(rows, rows.x), w.w_gate_up, w.hidden, w.intermediate,
                b.activation),
      saved_h, stream, h_shift);
}

void forward_l2(const Rows& rows, const Experts& w, const ForwardBuffers& b, cudaStream_t stream,
                const sm90::PeerRowsOut* l2_to_peers) {
  if (w.fp8_forward()) throw_invalid("expert chain: forward_l2 is the bf16 forward's");
  const int64_t H = w.hidden, I = w.intermediate;
  const sm90::MGroupedA activation{b.activation, rows.rows, RowLayout::kSorted, nullptr};
  if (l2_to_peers != nullptr) {
    sm90::m_grouped_gemm_nt_to_peers(over_rows(rows, activation, w.w_down, I, H, nullptr),
                                     *l2_to_peers, stream);
    return;
  }
  sm90::m_grouped_gemm_nt(over_rows(rows, activation, w.w_down, I, H, b.out), stream);
}

BackwardBuffers carve_backward(WorkspaceCarver& carver, int64_t rows, int64_t tokens,
                               int64_t num_experts, int64_t H, int64_t I, bool h_saved,
                               Precision precision, bool separate_dx_rows) {
  BackwardBuffers b{};
  b.padded_rows = padded_rows_bound(rows, num_experts);
  const bool fp8 = precision != Precision::kBf16;
  // FP8: room for the narrow tiles' partials, whichever path the call then takes.
  b.dp_parts = fp8 ? sm90::fp8_swiglu_backward_dp_columns(I, fp8_gather_a())
                   : sm90::swiglu_backward_dp_columns(I);
  b.h = h_saved ? nullptr : carver.take<__nv_bfloat16>(rows * 2 * I);
  b.dh = carver.take<__nv_bfloat16>(b.padded_rows * 2 * I);
  b.a = carver.take<__nv_bfloat16>(b.padded_rows * I);
  b.dp_partial = carver.take<float>(rows * (fp8 ? I / 128 : b.dp_parts));
  if (fp8) {
    b.token_rows = carve_shared_with_rows(carver, b.padded_rows * H, std::max(rows, tokens),
                                          tokens, H, b.dy_fp8, b.token_scales);
    if (precision == Precision::kFp8 && !h_saved) b.x_fp8 = b.dy_fp8;  // x's, then dy's
    b.dh_fp8 = carve_fp8_rows(carver, b.padded_rows, 2 * I);
    b.lhs_fp8 = carve_columns(carver, b.padded_rows, std::max(H, 2 * I));
    b.rhs_fp8 = carve_columns(carver, b.padded_rows, std::max(I, H));
  } else {
    b.token_rows = carver.take<__nv_bfloat16>(b.padded_rows * H);
  }
  b.dx_rows = separate_dx_rows ? carver.take<__nv_bfloat16>(rows * H) : b.token_rows;
  return b;
}

namespace {

// The FP8 dgrad of L2: z = dy W_down^T's product with dy quantized (into the sorted rows,
// or gathered) -> dh, a and the dp partials.
void backward_dgrad_l2_fp8(const Rows& rows, const Experts& w, const __nv_bfloat16* h,
                           const BackwardBuffers& b, cudaStream_t stream) {
  const int64_t H = w.hidden, I = w.intermediate;
  const sm90::MGroupedFp8A dy =
      token_rows_fp8(rows, rows.dy, {}, H, b.dy_fp8, b.token_scales, stream);
  sm90::MGroupedFp8GemmArgs l2 = over_rows(rows, dy, as_b(w.fp8_down, H, I, true), H, I, nullptr);
  l2.c = {b.dh, 2 * I, b.padded_rows, RowLayout::kPadded};
  sm90::m_grouped_fp8_gemm_nt_swiglu_backward(
      l2, {h, rows.slot_weights, rows.plan.row_slot, b.dp_partial, b.a}, stream);
}

}  // namespace

DgradDone backward_dgrad(const Rows& rows, const Experts& w, const __nv_bfloat16* saved_h,
                         const BackwardBuffers& b, bool dx_rows, cudaStream_t stream,
                         bool d_w_gate_up_wanted) {
  const int64_t H = w.hidden, I = w.intermediate;
  // h = [gate | up] of every row: saved by the forward, or recomputed (x rows gathered, or
  // in FP8 quantized into the sorted rows).
  const __nv_bfloat16* h = saved_h;
  if (h == nullptr && w.fp8_forward()) {  // the forward's FP8 GEMM, bit for bit
    const sm90::MGroupedFp8A x =
        token_rows_fp8(rows, rows.x, {}, H, b.x_fp8, b.token_scales, stream);
    sm90::m_grouped_fp8_gemm_nt(
        over_rows(rows, x, as_b(w.fp8_gate_up, 2 * I, H, false), H, 2 * I, b.h), stream);
    h = b.h;
  } else if (h == nullptr) {
    sm90::m_grouped_gemm_nt(over_rows(rows, gathered(rows, rows.x), w.w_gate_up, H, 2 * I, b.h),
                            stream);
    h = b.h;
  }
  if (w.fp8_backward()) {
    backward_dgrad_l2_fp8(rows, w, h, b, stream);
  } else {
    // z = w_down^T dy (dy rows gathered, w_down read N-major) -> dh and a, padded since they
    // feed the weight gradients, and the dp partials.
    sm90::MGroupedGemmArgs l2 = over_rows(rows, gathered(rows, rows.dy), w.w_down, H, I, nullptr);
    l2.c = {b.dh, 2 * I, b.padded_rows, RowLayout::kPadded};
    sm90::m_grouped_gemm_nn_swiglu_backward(
        l2, {h, rows.slot_weights, rows.plan.row_slot, b.dp_partial, b.a}, stream);
  }
  if (!dx_rows) return {};
  return backward_dgrad_l1(rows, w, b, stream, d_w_gate_up_wanted);
}

DgradDone backward_dgrad_l1(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                            cudaStream_t stream, bool d_w_gate_up_wanted,
                            const sm90::PeerRowsOut* dx_to_peers) {
  const int64_t H = w.hidden, I = w.intermediate;
  if (w.fp8_backward()) {
    // dh quantized (into dh_fp8), with its token-contiguous copy for dW_gate_up into
    // b.lhs_fp8 from the same read of dh when d_w_gate_up_wanted (unless
    // fp8_unfused_quantization()); then dx rows = dh W_gate_up into dx_rows (token_rows'
    // bytes unless carved apart, after the L2 dgrad has read dy's copy there).
    DgradDone done;
    done.dh_columns = d_w_gate_up_wanted && !fp8_unfused_quantization();
    if (done.dh_columns) {
      quantize_fp8_rows_and_columns(rows_args(b.dh, b.padded_rows, 2 * I, b.dh_fp8),
                                    columns_args(b.dh, b.padded_rows, 2 * I, b.lhs_fp8), stream);
    } else {
      quantize_rows(b.dh, b.padded_rows, 2 * I, b.dh_fp8, stream);
    }
    const sm90::MGroupedFp8A dh{b.dh_fp8.q, b.padded_rows, RowLayout::kPadded, nullptr,
                                b.dh_fp8.scales, b.dh_fp8.scale_ld};
    sm90::MGroupedFp8GemmArgs l1 =
        over_rows(rows, dh, as_b(w.fp8_gate_up, 2 * I, H, true), 2 * I, H,
                  dx_to_peers != nullptr ? nullptr : b.dx_rows);
    l1.groups.rows = b.padded_rows;
    if (dx_to_peers != nullptr) {
      sm90::m_grouped_fp8_gemm_nt_to_peers(l1, *dx_to_peers, stream);
    } else {
      sm90::m_grouped_fp8_gemm_nt(l1, stream);
    }
    return done;
  }
  // dx rows = dh . w_gate_up (w_gate_up read N-major: K = 2I, N = H), in row order.
  const sm90::MGroupedA dh{b.dh, b.padded_rows, RowLayout::kPadded, nullptr};
  sm90::MGroupedGemmArgs l1_dgrad = over_rows(rows, dh, w.w_gate_up, 2 * I, H,
                                              dx_to_peers != nullptr ? nullptr : b.dx_rows);
  l1_dgrad.groups.rows = b.padded_rows;  // A's padded rows, from which the grid is sized
  if (dx_to_peers != nullptr) {
    sm90::m_grouped_gemm_nn_to_peers(l1_dgrad, *dx_to_peers, stream);
  } else {
    sm90::m_grouped_gemm_nn(l1_dgrad, stream);
  }
  return {};
}

bool wgrad_writes_token_rows(const Experts& w) {
  return !w.fp8_backward() || fp8_unfused_columns();
}

void backward_wgrad(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                    const WeightGrad& d_w_gate_up, const WeightGrad& d_w_down,
                    cudaStream_t stream, const DgradDone& done) {
  const int64_t H = w.hidden, I = w.intermediate, E = rows.num_experts;
  if (w.fp8_backward()) {
    // Scales per 128 tokens: quantized from the bf16 rows, not from a 1x128 copy; p dy and
    // x straight from the token matrices (quantize_token_columns). dW_gate_up first: its
    // lhs, dh's copy, may be in lhs_fp8 already (written with dh's rows by the dgrad),
    // and dW_down's p dy goes into the same bytes. The order changes no bits (two
    // separate outputs).
    const bool tiles = fp8_wgrad_tiles();
    const Fp8Blocks rhs_blocks = tiles ? Fp8Blocks::kColumnTiles128 : Fp8Blocks::kColumns128;
    const auto gemm = [&](int64_t m, int64_t n, const WeightGrad& g) {
      sm90::KGroupedFp8GemmArgs args{b.lhs_fp8.q, b.lhs_fp8.scales, b.rhs_fp8.q,
                                     b.rhs_fp8.scales, b.padded_rows, m, n, E,
                                     rows.plan.tile_offsets};
      args.c = g.bf16;
      args.c_accumulate = g.f32;
      args.b_tile_scales = tiles;
      sm90::k_grouped_fp8_gemm_tn(args, stream);
    };
    if (d_w_gate_up.wanted()) {
      if (!done.dh_columns) quantize_columns(b.dh, b.padded_rows, 2 * I, b.lhs_fp8, stream);
      quantize_token_columns(rows, rows.x, nullptr, H, b.padded_rows, b.token_rows, b.rhs_fp8,
                             stream, rhs_blocks);
      gemm(2 * I, H, d_w_gate_up);
    }
    if (d_w_down.wanted()) {
      quantize_token_columns(rows, rows.dy, rows.slot_weights, H, b.padded_rows, b.token_rows,
                             b.lhs_fp8, stream);
      quantize_columns(b.a, b.padded_rows, I, b.rhs_fp8, stream, rhs_blocks);
      gemm(H, I, d_w_down);
    }
    return;
  }
  const auto wgrad = [&](const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, int64_t m,
                         int64_t n, const WeightGrad& g) {
    sm90::KGroupedGemmArgs args{lhs, rhs, b.padded_rows, m, n, E, rows.plan.tile_offsets};
    args.c = g.bf16;
    args.c_accumulate = g.f32;
    sm90::k_grouped_gemm_tn(args, stream);
  };
  if (d_w_down.wanted()) {
    gather_rows_padded(rows.dy, H, rows.plan, E, rows.slot_weights, b.padded_rows,
                       b.token_rows, stream);
    wgrad(b.token_rows, b.a, H, I, d_w_down);
  }
  if (d_w_gate_up.wanted()) {
    gather_rows_padded(rows.x, H, rows.plan, E, nullptr, b.padded_rows, b.token_rows, stream);
    wgrad(b.dh, b.token_rows, 2 * I, H, d_w_gate_up);
  }
}

}  // namespace megamoe::chain
