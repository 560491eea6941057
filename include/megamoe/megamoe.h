/*
 * megamoe: fused Mixture-of-Experts layer for NVIDIA Hopper. Public C ABI.
 *
 * This header is the only interface other languages link against. It knows nothing of
 * Python or PyTorch: callers pass raw pointers, shapes, strides (in elements), a dtype enum
 * and, for device work, a CUDA stream.
 *
 * Errors: every function returns a megamoe_status. On failure, megamoe_last_error() returns
 * a message for the calling thread that names the offending argument and what was
 * expected. No function aborts the process on bad input.
 *
 * Layer math (docs/design.md, "The layer"), for token t with top-k experts e_j and weights p_j:
 *   h_j = w_gate_up[e_j] @ x_t ; a_j = silu(h_j[:I]) * h_j[I:] ; o_j = w_down[e_j] @ a_j
 *   y_t = sum_j p_j * o_j      (a slot with expert id -1 contributes nothing, dp_j = 0)
 * Shapes: x [T, H]; topk_ids [T, k]; topk_weights [T, k]; w_gate_up [E, 2I, H] (rows
 * 0..I-1 gate, I..2I-1 up); w_down [E, H, I]; y [T, H].
 */
#ifndef MEGAMOE_MEGAMOE_H
#define MEGAMOE_MEGAMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MEGAMOE_API __declspec(dllexport)
#else
#define MEGAMOE_API __attribute__((visibility("default")))
#endif

#define MEGAMOE_VERSION_MAJOR 0
#define MEGAMOE_VERSION_MINOR 1
#define MEGAMOE_VERSION_PATCH 0

/* Largest tensor rank a descriptor carries. */
#define MEGAMOE_MAX_DIMS 4

typedef enum megamoe_status {
  MEGAMOE_SUCCESS = 0,
  MEGAMOE_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, stride, pointer or value */
  MEGAMOE_ERROR_UNSUPPORTED = 2,      /* valid input this build or GPU cannot run */
  MEGAMOE_ERROR_CUDA = 3,             /* a CUDA runtime call failed */
  MEGAMOE_ERROR_OUT_OF_MEMORY = 4,
  MEGAMOE_ERROR_CAPACITY = 5,         /* a call would exceed a buffer's capacity */
  MEGAMOE_ERROR_TIMEOUT = 6,          /* a peer never arrived */
  MEGAMOE_ERROR_INTERNAL = 7
} megamoe_status;

typedef enum megamoe_dtype {
  MEGAMOE_DTYPE_FLOAT32 = 0,
  MEGAMOE_DTYPE_FLOAT64 = 1,
  MEGAMOE_DTYPE_BFLOAT16 = 2,
  MEGAMOE_DTYPE_FLOAT16 = 3,
  MEGAMOE_DTYPE_INT32 = 4,
  MEGAMOE_DTYPE_INT64 = 5,
  MEGAMOE_DTYPE_FLOAT8_E4M3 = 6
} megamoe_dtype;

/* A strided view of memory. Strides are in elements, not bytes. `data` is const for
 * inputs; outputs are written through the same struct (the library casts). */
typedef struct megamoe_tensor {
  void* data;
  megamoe_dtype dtype;
  int32_t ndim;
  int64_t shape[MEGAMOE_MAX_DIMS];
  int64_t strides[MEGAMOE_MAX_DIMS];
} megamoe_tensor;

/* Version string "MAJOR.MINOR.PATCH" and the number MAJOR*10000 + MINOR*100 + PATCH. */
MEGAMOE_API const char* megamoe_version(void);
MEGAMOE_API int32_t megamoe_version_number(void);

/* Message of the last failed call on this thread ("" if none). Valid until the next
 * megamoe call on the same thread. */
MEGAMOE_API const char* megamoe_last_error(void);
/* Clears this thread's last error. */
MEGAMOE_API void megamoe_clear_error(void);
/* Short constant name of a status code, e.g. "MEGAMOE_ERROR_INVALID_ARGUMENT". */
MEGAMOE_API const char* megamoe_status_name(megamoe_status status);
/* Size in bytes of one element of `dtype` (0 for an unknown value). */
MEGAMOE_API size_t megamoe_dtype_size(megamoe_dtype dtype);

/* ---------------------------------------------------------------------------------------
 * CPU reference of the whole layer, on host memory: the oracle for every kernel.
 * Floating tensors are all FLOAT32 or all FLOAT64 (one storage type per call); sums are
 * accumulated in float64. topk_ids is INT32 or INT64 with values in [-1, E).
 * Any strides are accepted; outputs must not alias inputs.
 * ------------------------------------------------------------------------------------- */

/* y[T, H] = layer(x, topk_ids, topk_weights, w_gate_up, w_down). */
MEGAMOE_API megamoe_status megamoe_reference_forward(const megamoe_tensor* x,
                                                     const megamoe_tensor* topk_ids,
                                                     const megamoe_tensor* topk_weights,
                                                     const megamoe_tensor* w_gate_up,
                                                     const megamoe_tensor* w_down,
                                                     megamoe_tensor* y);

/* Gradients of <dy, y> with respect to every input. Each of dx [T, H], d_topk_weights
 * [T, k], d_w_gate_up [E, 2I, H], d_w_down [E, H, I] may be NULL to skip it; the
 * gradients are overwritten (not accumulated). */
MEGAMOE_API megamoe_status megamoe_reference_backward(const megamoe_tensor* dy,
                                                      const megamoe_tensor* x,
                                                      const megamoe_tensor* topk_ids,
                                                      const megamoe_tensor* topk_weights,
                                                      const megamoe_tensor* w_gate_up,
                                                      const megamoe_tensor* w_down,
                                                      megamoe_tensor* dx,
                                                      megamoe_tensor* d_topk_weights,
                                                      megamoe_tensor* d_w_gate_up,
                                                      megamoe_tensor* d_w_down);

/* ---------------------------------------------------------------------------------------
 * Device routing metadata (CUDA, sm_90a). Asynchronous on `stream`; no host sync.
 * ------------------------------------------------------------------------------------- */

/* Number of CUDA devices visible to the library (0 on a machine without a GPU; that is
 * not an error). */
MEGAMOE_API megamoe_status megamoe_cuda_device_count(int32_t* count);

/* For device tensors topk_ids [T, k] (INT32 or INT64, contiguous), writes
 * expert_counts[e] = number of slots routed to expert e in [0, num_experts) and
 * invalid_count[0] = number of slots whose id is < -1 or >= num_experts. Both outputs are
 * INT32 device tensors ([num_experts] and [1], contiguous) and are overwritten. */
MEGAMOE_API megamoe_status megamoe_routing_counts(const megamoe_tensor* topk_ids,
                                                  int64_t num_experts,
                                                  megamoe_tensor* expert_counts,
                                                  megamoe_tensor* invalid_count,
                                                  void* cuda_stream);

/* ---------------------------------------------------------------------------------------
 * Blockwise FP8 quantization (CUDA, sm_90a): bf16 in, e4m3 values (FLOAT8_E4M3, e4m3fn:
 * max 448, no infinities) and FLOAT32 scales out, with x ~= q * scale per block. Per block:
 *   a = max(amax, 2^-100); scale = a / 448; q = e4m3(x * (448 / a))
 * with both divisions in fp32 rounded to nearest even, and q rounded to nearest even,
 * saturating to +-448. A block holding a NaN or an infinity is all NaN (every q = 0x7F,
 * scale = NaN 0x7FC00000); an all-zero block gets scale 2^-100 / 448 and zeros. The bits
 * are those of the reference quantizer python/megamoe/fp8.py (docs/fp8.md).
 * Layouts: bf16 inputs and e4m3 outputs have unit stride in the last dimension, other
 * strides multiples of 16 bytes (those of size-1 dimensions are not used and may be
 * anything), data 16-byte aligned; scales take any strides (e.g.
 * [M, K/128] stored M-major, as a GEMM's TMA wants it). Outputs are overwritten, must not
 * overlap the input or each other, and no element is written twice. Asynchronous on
 * `cuda_stream`; no host sync; capturable in a CUDA graph; bitwise reproducible.
 * ------------------------------------------------------------------------------------- */

/* Activations and activation gradients: one block per row and 128 columns.
 * x [M, K] BFLOAT16, K a positive multiple of 128 (M may be 0); q [M, K]; scales [M, K/128]
 * with scales[m, j] for x[m, 128 j : 128 j + 128]. */
MEGAMOE_API megamoe_status megamoe_quantize_fp8_1x128(const megamoe_tensor* x, megamoe_tensor* q,
                                                      megamoe_tensor* scales, void* cuda_stream);

/* Weights: one block per 128 x 128 tile, for all experts in one launch. w [E, N, K]
 * BFLOAT16, N and K positive multiples of 128; q [E, N, K] and/or q_t [E, K, N] (W^T with
 * the same blocks: q_t[e] = q[e]^T bit for bit; either may be NULL, not both); scales
 * [E, N/128, K/128], the scale of tile (i, j) of W[e], which is tile (j, i) of W[e]^T. */
MEGAMOE_API megamoe_status megamoe_quantize_fp8_128x128(const megamoe_tensor* w, megamoe_tensor* q,
                                                        megamoe_tensor* q_t,
                                                        megamoe_tensor* scales,
                                                        void* cuda_stream);

/* Weight-gradient operands: one block per column and 128 rows (tokens), written transposed
 * so that the token dimension, which a weight-gradient GEMM contracts, is contiguous.
 * x [R, C] BFLOAT16, C a positive multiple of 128; with Rp = R rounded up to a multiple of
 * 128: q_t [C, Rp] (q_t[c, r] quantizes x[r, c]; columns R..Rp-1 are zeros, as if x were
 * padded with zero rows) and scales [C, Rp/128] (scales[c, j] for x[128 j : 128 j + 128, c]).
 * Blocks follow rows 128 j .. 128 j + 127 whatever they hold: a caller that needs blocks
 * within one expert's rows lays them out padded to 128 per expert first. */
MEGAMOE_API megamoe_status megamoe_quantize_fp8_cols_128(const megamoe_tensor* x,
                                                         megamoe_tensor* q_t,
                                                         megamoe_tensor* scales,
                                                         void* cuda_stream);

/* ---------------------------------------------------------------------------------------
 * Fused layer on one GPU (sm_90a): forward and backward.
 * Device tensors, contiguous: x [T, H] BFLOAT16; topk_ids [T, k] INT32/INT64 with ids in
 * [-1, E) (other ids are counted as invalid and contribute nothing: check them before the
 * call); topk_weights [T, k] FLOAT32 or BFLOAT16 (the backward takes FLOAT32 only);
 * w_gate_up [E, 2I, H] and w_down [E, H, I] BFLOAT16; y, dy, dx [T, H] BFLOAT16. H and I
 * must be multiples of 128; 1 <= k <= 16; 1 <= E <= 1024. `workspace` is device memory of
 * at least the size query's bytes, aligned to 256 bytes; its contents need no
 * initialisation and do not outlive the call. No host sync; capturable in a CUDA graph;
 * every output is bitwise reproducible run to run.
 * ------------------------------------------------------------------------------------- */

MEGAMOE_API megamoe_status megamoe_fused_workspace_size(int64_t tokens, int64_t topk,
                                                        int64_t hidden, int64_t intermediate,
                                                        int64_t num_experts, size_t* bytes);

/* y = sum_j p_j FFN_{e_j}(x). saved_h: NULL, or a BFLOAT16 [T*k, 2I] tensor that receives
 * the L1 output [gate | up] of every (token, expert) row, in the layer's internal
 * expert-sorted order; pass it to megamoe_fused_backward with the same topk_ids to skip
 * the backward's recompute of L1 (the "saved" mode). y may be NULL when saved_h is not:
 * the call then computes saved_h alone (the same bits; no L2, no combine), for a forward
 * run again only for what its backward keeps, as in the recompute of an
 * activation-checkpointed region, whose output is discarded. */
MEGAMOE_API megamoe_status megamoe_fused_forward(const megamoe_tensor* x,
                                                 const megamoe_tensor* topk_ids,
                                                 const megamoe_tensor* topk_weights,
                                                 const megamoe_tensor* w_gate_up,
                                                 const megamoe_tensor* w_down,
                                                 megamoe_tensor* y, megamoe_tensor* saved_h,
                                                 void* workspace, size_t workspace_bytes,
                                                 void* cuda_stream);

/* h_saved: nonzero when the backward will be given saved_h (it then needs less). */
MEGAMOE_API megamoe_status megamoe_fused_backward_workspace_size(int64_t tokens, int64_t topk,
                                                                 int64_t hidden,
                                                                 int64_t intermediate,
                                                                 int64_t num_experts,
                                                                 int32_t h_saved, size_t* bytes);

/* Gradients of <dy, y>. saved_h: NULL (L1 is recomputed from x) or what
 * megamoe_fused_forward wrote for the same inputs. Outputs, each NULL to skip it:
 * dx [T, H] BFLOAT16 and d_topk_weights [T, k] FLOAT32 (0 for an id of -1) are written;
 * d_w_gate_up [E, 2I, H] and d_w_down [E, H, I] are written when BFLOAT16 (zeros for an
 * expert without tokens) and added into when FLOAT32 (a gradient-accumulation buffer). */
MEGAMOE_API megamoe_status megamoe_fused_backward(
    const megamoe_tensor* dy, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* saved_h, megamoe_tensor* dx,
    megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up, megamoe_tensor* d_w_down,
    void* workspace, size_t workspace_bytes, void* cuda_stream);

/* ---------------------------------------------------------------------------------------
 * Fused layer on one GPU in blockwise FP8 (sm_90a; docs/fp8.md): the same layer, inputs,
 * outputs and contracts as megamoe_fused_*, with the expert GEMMs in e4m3 with fp32 scales
 * (activations and their gradients per 1x128 block, quantized inside the call; weights per
 * 128 x 128 block; the weight gradients' operands per 128 tokens). The bf16 weights give
 * the shapes; the GEMMs read the weights' FP8 copies, as megamoe_quantize_fp8_128x128
 * writes them:
 *   w_gate_up_q [E, 2I, H], w_gate_up_q_t [E, H, 2I] FLOAT8_E4M3, w_gate_up_scales
 *   [E, 2I/128, H/128] FLOAT32; w_down_q [E, H, I], w_down_q_t [E, I, H], w_down_scales
 *   [E, H/128, I/128].
 * The forward reads q and scales, the backward q_t and scales (and w_gate_up_q, to
 * recompute L1 in FP8). The results are bitwise reproducible run to run; no host sync; capturable.
 * Workspace: besides the bf16 layer's buffers, the e4m3 copies and scales of the GEMMs'
 * A operands. x and dy are quantized into the T*k expert-sorted rows (T*k*H bytes and
 * H/128 * ceil4(T*k) fp32 scales, with T * H/128 fp32 scratch for the scales by token), in
 * the bytes of a bf16 row buffer that the call writes only after reading them (docs/fp8.md,
 * "Workspace"). The environment variable
 * MEGAMOE_FP8_GATHER_A=1, read on every call, makes the GEMMs gather x's and dy's rows from
 * token-matrix copies instead (a diagnostic for the GPU; the same bits but for d_topk_weights,
 * which may differ by fp32 rounding; the same workspace).
 * ------------------------------------------------------------------------------------- */

MEGAMOE_API megamoe_status megamoe_fused_fp8_workspace_size(int64_t tokens, int64_t topk,
                                                            int64_t hidden,
                                                            int64_t intermediate,
                                                            int64_t num_experts, size_t* bytes);

/* precision "fp8": the forward's two GEMMs in FP8. y and saved_h as in megamoe_fused_forward. */
MEGAMOE_API megamoe_status megamoe_fused_fp8_forward(
    const megamoe_tensor* x, const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* w_gate_up_q, const megamoe_tensor* w_gate_up_scales,
    const megamoe_tensor* w_down_q, const megamoe_tensor* w_down_scales, megamoe_tensor* y,
    megamoe_tensor* saved_h, void* workspace, size_t workspace_bytes, void* cuda_stream);

/* forward_fp8: nonzero when the forward ran in FP8 (precision "fp8": L1 is recomputed in
 * FP8, as the forward computed it); zero for "fp8_bwd" (bf16 forward and recompute). */
MEGAMOE_API megamoe_status megamoe_fused_fp8_backward_workspace_size(
    int64_t tokens, int64_t topk, int64_t hidden, int64_t intermediate, int64_t num_experts,
    int32_t h_saved, int32_t forward_fp8, size_t* bytes);

/* The backward's GEMMs in FP8 (precisions "fp8" and "fp8_bwd"); arguments and outputs as
 * in megamoe_fused_backward. MEGAMOE_FP8_WGRAD_TILES=1 in the environment (read on every
 * call; a CUDA graph keeps the path it was captured with), an opt-in coarser than the
 * recipe: the weight gradients' activation operands (x, the SwiGLU output) are quantized in
 * 128 x 128 tiles instead of per channel and 128 tokens, which changes d_w_gate_up's and
 * d_w_down's bits and nothing else (docs/fp8.md, "Opt-in"). The same for the EP backward. */
MEGAMOE_API megamoe_status megamoe_fused_fp8_backward(
    const megamoe_tensor* dy, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* w_gate_up_q,
    const megamoe_tensor* w_gate_up_q_t, const megamoe_tensor* w_gate_up_scales,
    const megamoe_tensor* w_down_q_t, const megamoe_tensor* w_down_scales, int32_t forward_fp8,
    const megamoe_tensor* saved_h,
    megamoe_tensor* dx, megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
    megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes, void* cuda_stream);

/* ---------------------------------------------------------------------------------------
 * Fused layer with expert parallelism over the GPUs of one node (sm_90a, NVLink). Rank r of world_size W owns global experts [r*E/W, (r+1)*E/W).
 * Every rank holds one buffer of at least megamoe_ep_buffer_size() bytes, zeroed once at
 * creation and mapped into every rank's address space (torch symmetric memory);
 * `buffers[s]` is rank s's buffer as this process sees it. Calls are collective: every
 * rank makes them in the same order with the same group sizes.
 * ------------------------------------------------------------------------------------- */

#define MEGAMOE_EP_MAX_RANKS 8

typedef struct megamoe_ep_group {
  int32_t rank;
  int32_t world_size;
  void* buffers[MEGAMOE_EP_MAX_RANKS];
  uint64_t buffer_bytes;        /* each buffer's size */
  int64_t num_experts;          /* E, global; a multiple of world_size */
  int64_t max_tokens_per_rank;  /* T of any call on any rank */
  int64_t topk;
  int64_t hidden;
  int64_t max_recv_rows;        /* (token, expert) rows one rank can receive per call */
  int64_t timeout_ns;           /* how long a rank waits for a peer before failing */
  int32_t num_comm_sms;         /* SMs of the kernels that move rows between ranks; 0: all
                                   (16 where they run beside a GEMM: the MEGAMOE_EP_OVERLAP_*
                                   switches, docs/expert-parallel.md) */
} megamoe_ep_group;

/* Bytes of each rank's buffer (the buffers may be NULL for this query). */
MEGAMOE_API megamoe_status megamoe_ep_buffer_size(const megamoe_ep_group* group, size_t* bytes);

/* Bytes of device workspace of one megamoe_ep_forward (megamoe_ep_backward) call with
 * `tokens` tokens. */
MEGAMOE_API megamoe_status megamoe_ep_workspace_size(const megamoe_ep_group* group,
                                                     int64_t tokens, int64_t intermediate,
                                                     size_t* bytes);
MEGAMOE_API megamoe_status megamoe_ep_backward_workspace_size(const megamoe_ep_group* group,
                                                              int64_t tokens,
                                                              int64_t intermediate,
                                                              int32_t h_saved, size_t* bytes);

/* Offset in this rank's buffer of its int32 error word: 0 after a call that went well,
 * else a code for megamoe_ep_describe_error (a peer that did not arrive within the timeout,
 * naming rank and phase; a timeout of another rank of the group, which also names the rank
 * that waited; or a receive capacity that would have been exceeded, in which case no row
 * was sent). The int32 after it holds the first such code since it was last zeroed (no
 * call zeroes it; it starts at 0 with the buffer): after many calls, such as a model's
 * layers, it names the first that failed even when later ones went well. After either,
 * the call's outputs on this rank are NaN (y; dx, d_topk_weights and the weight gradients
 * or their fp32 accumulators; a saved h is not), so that a failed call never looks like a
 * result. A rank that times out goes on with what it has and marks every rank's buffer:
 * from then on every call on the group's buffers fails, on every rank, without waiting (a
 * dead peer costs the group one timeout), and a late peer may still store into them. Make
 * new ones, on every rank, before going on. Read the word
 * after the stream has reached the call. */
MEGAMOE_API megamoe_status megamoe_ep_error_offset(const megamoe_ep_group* group, size_t* offset);
MEGAMOE_API megamoe_status megamoe_ep_describe_error(int32_t code, char* message, size_t size);

/* y = the layer for this rank's tokens. x [T, H] BFLOAT16, topk_ids [T, k] INT32/INT64
 * global ids in [-1, E), topk_weights [T, k] FLOAT32, w_gate_up [E/W, 2I, H] and w_down
 * [E/W, H, I] BFLOAT16 (this rank's experts), y [T, H] BFLOAT16; T <= max_tokens_per_rank.
 * Each owner rank sums a token's slots there in fp32 and sends one bf16 row, so y differs
 * from megamoe_fused_forward of the same global problem on one GPU by that rounding; it is
 * bitwise reproducible run to run. MEGAMOE_EP_EPILOGUE_COMBINE=1 in the environment (read
 * when a group is built; every rank must see the same value) sends every slot's row instead
 * (k x H bf16 per token in the buffer, and at EP=2 with k = 8 about 4x the bytes over
 * NVLink), and the token's rank sums them as megamoe_fused_forward does: y is then bitwise
 * megamoe_fused_forward's. saved_h: NULL, or BFLOAT16 [max_recv_rows, 2I] that
 * receives h = [gate | up] of the rows this rank computes, for megamoe_ep_backward in
 * saved mode (same routing). */
MEGAMOE_API megamoe_status megamoe_ep_forward(const megamoe_ep_group* group,
                                              const megamoe_tensor* x,
                                              const megamoe_tensor* topk_ids,
                                              const megamoe_tensor* topk_weights,
                                              const megamoe_tensor* w_gate_up,
                                              const megamoe_tensor* w_down, megamoe_tensor* y,
                                              megamoe_tensor* saved_h, void* workspace,
                                              size_t workspace_bytes, void* cuda_stream);

/* Gradients of <dy, y>: dx [T, H] BFLOAT16 and d_topk_weights [T, k] FLOAT32 (0 for an id
 * of -1) for this rank's tokens, d_w_gate_up [E/W, 2I, H] and d_w_down [E/W, H, I] for this
 * rank's experts: BFLOAT16 is written (zeros for experts without rows), FLOAT32 is added
 * into (fp32 gradient accumulation); all four required. saved_h: NULL to recompute L1 on
 * the experts' ranks, or the forward's saved_h. d_topk_weights and the weight gradients
 * are bitwise equal to megamoe_fused_backward of the same global problem on one GPU; dx
 * differs by the owners' bf16 partial sums, as y does, but with MEGAMOE_EP_EPILOGUE_COMBINE=1,
 * where the L1 dgrad sends every slot's dx row to the token's rank and dx is bitwise
 * megamoe_fused_backward's (no dx send then). MEGAMOE_EP_OVERLAP_BACKWARD=1 in the
 * environment (read when a group is used; every rank must see the same value) moves rows
 * on a second stream beside the GEMMs, on the SMs they leave (num_comm_sms): with saved_h,
 * x's rows travel after dy's, beside the dgrad of L2; the dx rows go back beside the weight
 * gradients. The same bits, and max_recv_rows x hidden bf16 more workspace
 * (megamoe_ep_backward_workspace_size counts it; none with MEGAMOE_EP_EPILOGUE_COMBINE=1),
 * where the dx rows wait apart from the weight gradients' operands. The second stream is made at a rank's first such call, which
 * must not be under CUDA graph capture. */
MEGAMOE_API megamoe_status megamoe_ep_backward(
    const megamoe_ep_group* group, const megamoe_tensor* dy, const megamoe_tensor* x,
    const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* saved_h, megamoe_tensor* dx, megamoe_tensor* d_topk_weights,
    megamoe_tensor* d_w_gate_up, megamoe_tensor* d_w_down, void* workspace,
    size_t workspace_bytes, void* cuda_stream);

/* Blockwise FP8 with expert parallelism: the megamoe_ep_* calls with the expert GEMMs of
 * megamoe_fused_fp8_* (docs/fp8.md), the same group, buffer, inputs, outputs and contracts
 * (collective, no host sync, capturable, bitwise reproducible run to run). The FP8 copies
 * are those of this rank's experts, as megamoe_quantize_fp8_128x128 writes them:
 * w_gate_up_q [E/W, 2I, H], w_gate_up_q_t [E/W, H, 2I], w_gate_up_scales
 * [E/W, 2I/128, H/128]; w_down_q [E/W, H, I], w_down_q_t [E/W, I, H], w_down_scales
 * [E/W, H/128, I/128]. The forward quantizes x once on each rank and its dispatch moves the
 * tokens' e4m3 rows and 1x128 scales (half the bytes of bf16); the backward's dispatch
 * moves bf16 rows (its weight gradients quantize their operands per 128 tokens from them),
 * which each owner quantizes once per received token. d_topk_weights and the weight
 * gradients are bitwise equal to megamoe_fused_fp8_backward's on the same global problem; y
 * and dx differ from megamoe_fused_fp8_* by the owners' bf16 partial sums, as in bf16, or
 * with MEGAMOE_EP_EPILOGUE_COMBINE=1 are bitwise theirs, as in bf16. The forward ignores
 * MEGAMOE_EP_OVERLAP_DISPATCH. MEGAMOE_EP_FP8_BF16_DISPATCH=1 in the environment (read
 * when a group is used, the same on every rank) makes the forward move bf16 rows and the
 * owners quantize them, for an A/B: the same bits, a smaller workspace.
 * MEGAMOE_EP_OVERLAP_BACKWARD=1 works as in megamoe_ep_backward, with no more workspace
 * (the FP8 weight gradients read the token matrices in place). */
MEGAMOE_API megamoe_status megamoe_ep_fp8_workspace_size(const megamoe_ep_group* group,
                                                         int64_t tokens, int64_t intermediate,
                                                         size_t* bytes);

/* precision "fp8": the forward's GEMMs in FP8; the rest as megamoe_ep_forward. */
MEGAMOE_API megamoe_status megamoe_ep_fp8_forward(
    const megamoe_ep_group* group, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* w_gate_up_q,
    const megamoe_tensor* w_gate_up_scales, const megamoe_tensor* w_down_q,
    const megamoe_tensor* w_down_scales, megamoe_tensor* y, megamoe_tensor* saved_h,
    void* workspace, size_t workspace_bytes, void* cuda_stream);

/* forward_fp8 as in megamoe_fused_fp8_backward_workspace_size. */
MEGAMOE_API megamoe_status megamoe_ep_fp8_backward_workspace_size(
    const megamoe_ep_group* group, int64_t tokens, int64_t intermediate, int32_t h_saved,
    int32_t forward_fp8, size_t* bytes);

/* The backward's GEMMs in FP8 (precisions "fp8" and "fp8_bwd"; forward_fp8 as in
 * megamoe_fused_fp8_backward: w_gate_up_q is read to recompute L1 in FP8 when it is nonzero
 * and saved_h is NULL); the rest as megamoe_ep_backward. */
MEGAMOE_API megamoe_status megamoe_ep_fp8_backward(
    const megamoe_ep_group* group, const megamoe_tensor* dy, const megamoe_tensor* x,
    const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* w_gate_up_q, const megamoe_tensor* w_gate_up_q_t,
    const megamoe_tensor* w_gate_up_scales, const megamoe_tensor* w_down_q_t,
    const megamoe_tensor* w_down_scales, int32_t forward_fp8, const megamoe_tensor* saved_h,
    megamoe_tensor* dx, megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
    megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes, void* cuda_stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MEGAMOE_MEGAMOE_H */
