// Blockwise FP8 quantizers (the recipe of fp8_recipe.cuh) over bf16 matrices: one read of
// the bf16 values, one write of the e4m3 values and the fp32 scales. Internal; asynchronous
// on `stream`, no host sync, capturable; the outputs depend only on the inputs (bitwise
// reproducible). The C ABI entries (quantize_fp8_entry.cpp) validate the descriptors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe {

// Which elements share a scale.
enum class Fp8Blocks {
  kRows1x128,    // one row x 128 columns (activations, activation gradients)
  kTiles128,     // 128 x 128 (weights)
  kColumns128,   // 128 rows x one column, written transposed (weight-gradient operands)
  // 128 x 128, written transposed as kColumns128 is, with the tile's scale at each of its
  // 128 columns' places (a weight gradient's activation operand, b_tile_scales of
  // k_grouped_fp8_gemm_tn: the opt-in MEGAMOE_FP8_WGRAD_TILES of the FP8 chain).
  kColumnTiles128,
};

// A batch of `batches` bf16 matrices [rows, cols] and where their quantized copies go.
// Strides are in elements (bytes for the e4m3 outputs); the innermost stride is 1.
// cols must be a positive multiple of 128, and rows as well for kTiles128. Every pointer is
// 16-byte aligned, and every row and batch stride of x, q and q_t a multiple of 16 bytes.
struct Fp8QuantizeArgs {
  const __nv_bfloat16* x = nullptr;
  int64_t x_batch = 0, x_row = 0;
  int64_t batches = 1, rows = 0, cols = 0;
  // Direct copy [b][rows][cols] (kRows1x128, kTiles128; null for kColumns128 and
  // kColumnTiles128, optional for kTiles128).
  uint8_t* q = nullptr;
  int64_t q_batch = 0, q_row = 0;
  // Transposed copy [b][cols][padded_rows] with padded_rows = rows rounded up to 128, pad
  // columns written as zeros (kColumns128, kColumnTiles128; optional for kTiles128, null
  // for kRows1x128).
  uint8_t* q_t = nullptr;
  int64_t t_batch = 0, t_row = 0;
  // Scale of block (b, i, j) at scales[b * s_batch + i * s_0 + j * s_1], with (i, j) =
  // (row, column block) for kRows1x128, (row block, column block) for kTiles128, and
  // (column, row block) for kColumns128 and kColumnTiles128. Any strides.
  float* scales = nullptr;
  int64_t s_batch = 0, s_0 = 0, s_1 = 0;
};

void quantize_fp8(Fp8Blocks blocks, const Fp8QuantizeArgs& args, cudaStream_t stream);

// quantize_fp8(kRows1x128, rows) and quantize_fp8(kColumns128, columns) of one bf16 matrix
// (rows and columns must agree on x, x_row, x_batch, batches, rows and cols) in one pass:
// each 128 x 128 tile of x read once, both copies' bits. For a matrix that feeds both a
// dgrad (1x128 rows) and a weight gradient (128-token columns), such as the backward's dh:
// the separate passes read it twice. Errors name the argument set ("rows: ", "columns: ").
// A separate kernel (it loops over the tiles, as quantize_fp8_to_rows).
void quantize_fp8_rows_and_columns(const Fp8QuantizeArgs& rows, const Fp8QuantizeArgs& columns,
                                   cudaStream_t stream);

// Where quantize_fp8_to_rows writes row r of x: rows rows[r * per_row + j] (j < per_row) of
// q and of the scales (their i), none for a negative entry; rows that no entry names are
// left untouched. For a token matrix quantized straight into a routing plan's expert-sorted
// rows (rows = slot_row, per_row = top-k). Device memory, unchecked: every entry is
// negative or below q's rows.
struct Fp8RowDests {
  const int32_t* rows = nullptr;
  int64_t per_row = 1;
  // Optional, quantize_fp8_to_rows only: the scales written once per row of x, into
  // row_scales [rows of x][cols / 128] (scratch, 16-byte aligned), and then to their rows
  // by a second kernel that walks the destinations in order: sources[d] (d < dest_rows) is
  // the row of x that row d copies, negative for none. Device memory, unchecked: sources
  // must be the exact inverse of `rows` (a routing plan's row_token and slot_row are). The
  // same bits; per_row scattered 4-byte stores of each row and block become one, and the
  // second kernel's stores are coalesced. Needs s_0 = 1 (scales [block][row]) and one batch.
  const int32_t* sources = nullptr;
  int64_t dest_rows = 0;
  float* row_scales = nullptr;
};

// kRows1x128 with every row of x written to the rows `dests` gives it: each row read and
// its scales computed once, however many rows it goes to; the same bits as quantize_fp8
// followed by a copy of the rows. A separate kernel, not a branch of quantize_fp8's: the
// loop's registers would cost the plain kernel an occupancy step.
void quantize_fp8_to_rows(const Fp8QuantizeArgs& args, const Fp8RowDests& dests,
                          cudaStream_t stream);

// Rows already quantized by quantize_fp8 (kRows1x128) as a dense matrix, and where their
// copies go: q [rows, cols] e4m3 (row-major, ld = cols) with the scale of row r's block j at
// scales[j * scale_ld + r], and the same layout for out_q and out_scales (out_scale_ld).
struct Fp8RowsCopyArgs {
  const uint8_t* q = nullptr;
  const float* scales = nullptr;
  int64_t scale_ld = 0;
  int64_t rows = 0, cols = 0;
  uint8_t* out_q = nullptr;
  float* out_scales = nullptr;
  int64_t out_scale_ld = 0;
};

// Every row of args.q and its scales copied to the rows of out that dests gives it (per_row
// at most 32): the bits quantize_fp8_to_rows writes there from the bf16 rows that q was
// quantized from. A row with no destination is not read; rows no entry names are left
// untouched. For tokens quantized before they moved to the GPU that computes their rows (the
// expert-parallel FP8 forward). cols a positive multiple of 128; q, out_q 16-byte aligned.
void copy_fp8_to_rows(const Fp8RowsCopyArgs& args, const Fp8RowDests& dests,
                      cudaStream_t stream);

// The padded expert-sorted rows of a routing plan over a token matrix, as
// gather_rows_padded (gather_padded.h) writes them: padded row p of expert e's tiles
// (tile_offsets[e] * 128 <= p < tile_offsets[e + 1] * 128, local row i = p -
// tile_offsets[e] * 128) is token row row_token[expert_offsets[e] + i] times
// slot_weights[row_slot[expert_offsets[e] + i]] (rounded to bf16 as gather_rows_padded
// rounds it; no multiply when slot_weights is null), or zeros for i >= the expert's count.
// Device memory, unchecked: the plan's offsets as build_routing_plan writes them (block_m
// 128), every row_token below the token matrix's rows.
struct Fp8PaddedSource {
  const int32_t* expert_offsets = nullptr;  // [E + 1]
  const int32_t* tile_offsets = nullptr;    // [E + 1]
  const int32_t* row_token = nullptr;
  const int32_t* row_slot = nullptr;        // read only with slot_weights
  const float* slot_weights = nullptr;      // null: the rows unscaled
  int64_t num_experts = 0;
};

// kColumns128 of the padded rows `src` gives over the token matrix args.x (args.x_row its
// row stride; args.rows = the padded rows, args.batches = 1): the bits of
// gather_rows_padded into a bf16 buffer followed by quantize_fp8(kColumns128) of it,
// without the buffer (each token row read straight from x). Row blocks from
// tile_offsets[E] on (whose bf16 rows gather_rows_padded leaves untouched) are not
// written: neither their columns of q_t nor their scales. A separate kernel instance, as
// quantize_fp8_to_rows.
// blocks: kColumns128, or kColumnTiles128 for the same rows in 128 x 128 tiles.
void quantize_fp8_columns_gathered(const Fp8QuantizeArgs& args, const Fp8PaddedSource& src,
                                   cudaStream_t stream,
                                   Fp8Blocks blocks = Fp8Blocks::kColumns128);

}  // namespace megamoe
