// The sm_90a grouped GEMMs of the expert layers (host API).
//
// Names: <g>_grouped_gemm_<ab>[_<epilogue>]
//   <g>  m: each expert owns a range of rows of A and of C and reduces the whole K (forward,
//           dgrad);
//        k: each expert owns a range of the reduction's rows and has its own C (weight
//           gradients).
//   <ab> C = op(A) op(B), in BLAS's terms for row-major matrices: n = the operand as stored,
//        t = its transpose.
//          nt: C = A B_e^T, A [rows, K], B_e [N, K] (both K-major; a weight as nn.Linear
//              stores it)
//          nn: C = A B_e,   A [rows, K], B_e [K, N] (B N-major)
//          tn: C_e = A_e^T B_e, A [rows, M], B [rows, N], expert e's rows reduced
//   <epilogue> none: C in bf16; swiglu: the SwiGLU of a [gate | up] product;
//        swiglu_backward: the SwiGLU backward fused into the dgrad of L2.
// Tiles are kGemmBlockM rows by 256 columns where N allows it, else 128.
//
// Rows of M-grouped operands: the sorted order puts expert e's rows at expert_offsets[e]..;
// the padded layout at tile_offsets[e] * kGemmBlockM.., each expert padded to a multiple of
// kGemmBlockM rows (the weight gradients' operands, whose pad rows hold zeros). An output in
// the padded layout: the SwiGLU backward writes its pad rows as zeros; the other GEMMs write
// only the experts' rows and leave pad rows as they are.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::sm90 {

// Rows of an M-tile: expert groups are padded to a multiple of this for tile_offsets.
constexpr int kGemmBlockM = 128;

enum class RowLayout { kSorted, kPadded };

struct ExpertGroups {
  int64_t num_experts = 0;
  const int32_t* expert_offsets = nullptr;  // device [E+1]: expert e's sorted rows start
  const int32_t* tile_offsets = nullptr;    // device [E+1]: expert e's first M-tile
  int64_t rows = 0;  // sorted rows allocated (>= expert_offsets[E]); 0: nothing to do
};

// A [rows, k] bf16 row-major, either materialised in `layout`, or gathered: sorted row r is
// row gather[r] of data (rows = rows of data, e.g. the tokens).
struct MGroupedA {
  const __nv_bfloat16* data = nullptr;
  int64_t rows = 0;
  RowLayout layout = RowLayout::kSorted;
  const int32_t* gather = nullptr;  // device [groups.rows] or null
};

// C [rows, ld] bf16 row-major (rows allocated), in `layout`.
struct MGroupedC {
  __nv_bfloat16* data = nullptr;
  int64_t ld = 0;
  int64_t rows = 0;
  RowLayout layout = RowLayout::kSorted;
};

struct MGroupedGemmArgs {
  ExpertGroups groups;
  MGroupedA a;
  const __nv_bfloat16* b = nullptr;  // the experts' weights, stacked (per function below)
  int64_t k = 0;                     // multiple of 64
  int64_t n = 0;                     // output columns
  MGroupedC c;
};

// Shared-memory descriptor strides of an N-major B tile (bytes); the defaults describe the
// layout the kernel's TMA boxes produce. Other values exist for tests of that reading.
struct MnMajorStrides {
  uint32_t lbo = 64 * 128;  // next 64 elements along N: the next box of 64 K-rows
  uint32_t sbo = 8 * 128;   // next 8 rows along K
};

// C[r, :n] = A_r . B_e^T, b = [E * n, k] (e.g. L2 with w_down [E, H, I]: n = H, k = I; the
// backward's L1 recompute with w_gate_up: n = 2I). n: a multiple of 128.
void m_grouped_gemm_nt(const MGroupedGemmArgs& args, cudaStream_t stream);

// Where m_grouped_gemm_nt_to_peers sends its rows: row r of C goes to rank
// row_dest[r] / slots_per_rank, as row row_dest[r] % slots_per_rank of the bf16 [slots, n]
// array at rows_offset in that rank's buffer, and that slot's uint32 counter at done_offset
// then grows by the columns stored (n once every N-tile is stored); rows with a negative
// row_dest are not stored. Nothing is stored when *skip is nonzero.
struct PeerRowsOut {
  static constexpr int kMaxRanks = 8;
  char* buffers[kMaxRanks] = {};  // every rank's buffer, as the calling rank sees it
  size_t rows_offset = 0;
  size_t done_offset = 0;
  const int32_t* row_dest = nullptr;  // device, by sorted row (C's rows)
  const int32_t* skip = nullptr;      // device [1]
  int64_t slots_per_rank = 0;
};

// The checks every _to_peers GEMM makes of its destination, n and A (materialised): an
// invalid-argument error naming `name`.
void check_peer_rows_out(const PeerRowsOut& out, int64_t n, bool gathered, const char* name);

// m_grouped_gemm_nt with every output row sent to its slot on another rank (or this one)
// instead of stored in C (the expert-parallel forward's L2, its epilogue combine; args.c is
// not used). A materialised (not gathered), n a multiple of 128. The same bits per row as
// m_grouped_gemm_nt.
void m_grouped_gemm_nt_to_peers(const MGroupedGemmArgs& args, const PeerRowsOut& out,
                                cudaStream_t stream);

// C[r, :n] = A_r . B_e, b = [E * k, n] (e.g. the dgrad of L1: w_gate_up [E, 2I, H] read with
// k = 2I, n = H). n: a multiple of 128.
void m_grouped_gemm_nn(const MGroupedGemmArgs& args, cudaStream_t stream,
                       MnMajorStrides strides = {});
// m_grouped_gemm_nn with every output row sent as m_grouped_gemm_nt_to_peers sends them (the
// expert-parallel backward's L1 dgrad with the epilogue combine: the dx rows). A materialised
// (padded or sorted: row_dest is indexed by the sorted row), n a multiple of 128. The same
// bits per row as m_grouped_gemm_nn.
void m_grouped_gemm_nn_to_peers(const MGroupedGemmArgs& args, const PeerRowsOut& out,
                                cudaStream_t stream);

// Where L1 writes h's rows when they are not C's: row r of expert e's tiles goes to row
// r + (r < split[e] ? lo[e] : hi[e]) of h (device arrays over the plan's experts; split null:
// lo for every row). The overlapped EP forward runs L1 on two plans, its own rows first,
// while the backward reads h in the default layout (comm/ep_plan.cu says where each row
// goes). lo null: h's rows are C's.
struct HRowShift {
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  const int32_t* split = nullptr;
};

// L1: C[r, :n] = silu(A_r . gate_e) * (A_r . up_e), b = w_gate_up [E * 2n, k] (expert e's n
// gate rows, then its n up rows; n = I, a multiple of 64). h, optional: also writes
// h = [gate | up] ([c.rows, 2n]; C's rows, or as h_shift moves them) for a backward that
// skips the L1 recompute.
void m_grouped_gemm_nt_swiglu(const MGroupedGemmArgs& args, __nv_bfloat16* h,
                              cudaStream_t stream, HRowShift h_shift = {});

// The SwiGLU backward's operands besides the GEMM's (see m_grouped_gemm_nn_swiglu_backward).
struct SwiGLUGradArgs {
  const __nv_bfloat16* h = nullptr;     // [groups.rows, 2I] sorted: L1's [gate | up]
  const float* slot_weights = nullptr;  // [T*k] fp32 router weights, by slot
  const int32_t* row_slot = nullptr;    // [groups.rows] slot of each sorted row
  float* dp_partial = nullptr;          // [groups.rows, swiglu_backward_dp_columns(I)]
  __nv_bfloat16* a_out = nullptr;       // optional [c.rows, I] (C's layout): a = silu(g) u
};

// Backward of L2 and SwiGLU (dgrad): z_r = dy_r . w_down_e for each sorted row r (A = dy
// rows, usually gathered; b = w_down [E, H, I] read N-major: k = H, n = I, a multiple of
// 128), fused with da = p z, dh = [da u silu'(g), da silu(g)] from h = [g | u], written to
// C = dh ([c.rows, 2I], ld = 2I; pad rows zero in the padded layout), and per-(row, N-tile)
// partials of dp = <z, silu(g) u>.
void m_grouped_gemm_nn_swiglu_backward(const MGroupedGemmArgs& args,
                                       const SwiGLUGradArgs& grads, cudaStream_t stream);
// Columns of dp_partial for I = n.
int64_t swiglu_backward_dp_columns(int64_t n);

// Weight gradient, K-grouped over the experts' padded rows r (zeros in pad rows):
//   C[e * m + i, j] = sum_r a[r, i] * b[r, j]     (a [rows, m], b [rows, n], both row-major)
// e.g. dW_down = (p dy)^T a and dW_gate_up = dh^T x. An expert without rows gets zeros.
struct KGroupedGemmArgs {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  int64_t padded_rows = 0;              // rows allocated in a and b (>= tile_offsets[E] * 128)
  int64_t m = 0, n = 0;                 // multiples of 128
  int64_t num_experts = 0;
  const int32_t* tile_offsets = nullptr;  // device [E+1]
  __nv_bfloat16* c = nullptr;           // [num_experts * m, n], written
  float* c_accumulate = nullptr;        // or [num_experts * m, n] fp32: C += the gradient
};
void k_grouped_gemm_tn(const KGroupedGemmArgs& args, cudaStream_t stream);

}  // namespace megamoe::sm90
