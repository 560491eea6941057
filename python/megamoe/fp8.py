"""Blockwise FP8 (e4m3) quantization: the recipe, defined once, as a plain PyTorch reference.

Every FP8 path of megamoe (the CUDA quantizers of `csrc/kernels/common/quantize_fp8.cu`,
and the fused FP8 GEMMs' epilogues to come) must produce exactly the bits these functions
produce; the tests compare them bit for bit. docs/fp8.md explains the choices.

The recipe, for one block of values x (bf16 or any float; computed in fp32):

    amax  = max |x| over the block (exact in fp32)
    a     = max(amax, AMAX_FLOOR)                  AMAX_FLOOR = 2**-100
    scale = a / 448                                fp32 division, round to nearest even
    r     = 448 / a                                fp32 division, round to nearest even
    q     = e4m3(x * r)                            fp32 product, then round to nearest even,
                                                   saturating to +-448
    x ~= q * scale                                 (the dequantization; scales are fp32)

- A block that holds a NaN or an infinity is all NaN: every q is 0x7F (e4m3 NaN) and its
  scale is NaN (0x7FC00000). A non-finite input is an upstream bug; this keeps it visible
  in every product the block enters instead of scaling it into finite garbage.
- An all-zero block (or one whose amax is below AMAX_FLOOR) gets scale AMAX_FLOOR / 448:
  finite and nonzero, so no 0 * inf or 0 / 0 appears downstream; zeros stay zeros.
- The sign of zero is kept: -0.0, or a negative value too small for e4m3, gives 0x80.
- Scales are not rounded to powers of two: amax maps onto 448 exactly (up to the one
  rounding of r), using e4m3's whole range in every block, as the DeepSeek-V3 recipe does.

Blocks and layouts (outputs are contiguous; the sizes along the contraction dimension K must be multiples of 128;
H and I of every model we run are):

- `quantize_1x128(x)`: activations and activation gradients, x [..., K]. One block per
  row and 128 consecutive columns: q [..., K] e4m3, scales [..., K/128] fp32 with
  scales[..., j] for columns [128 j, 128 j + 128).
- `quantize_128x128(w)`: weights, w [..., N, K]. One block per 128 x 128 tile: q
  [..., N, K], scales [..., N/128, K/128]. A tile's scale is the same for W and W^T, so
  W^T's quantized copy is q.transpose(-2, -1) with scales.transpose(-2, -1), bit for bit.
- `quantize_cols_128(x)`: the weight-gradient operands, x [R, C] whose rows are tokens.
  The wgrad GEMM C = A^T B contracts over tokens, and Hopper's FP8 MMA reads both operands
  K-major, so the copy is written transposed and token-contiguous: q_t [C, Rp] with
  Rp = R rounded up to a multiple of 128, scales [C, Rp/128]: one block per column and 128
  consecutive rows. Rows R..Rp-1 are padding and quantize to zeros. It equals
  quantize_1x128 of the zero-padded x^T.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 2.0 ** -100
# e4m3fn has no infinities; 0x7F (and 0xFF) are its NaN codes. Non-finite blocks use 0x7F.
E4M3_NAN_BITS = 0x7F
# The scale of a non-finite block: the canonical quiet NaN.
SCALE_NAN_BITS = 0x7FC00000


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype == E4M3:
        raise ValueError(f"{name}: expected a floating tensor (bf16, fp16, fp32, fp64), got {x.dtype}")


def _check_multiple(name: str, x: torch.Tensor, dim: int, what: str) -> None:
    size = x.shape[dim]
    if size % BLOCK:
        raise ValueError(f"{name}: {what} (dimension {dim} of shape {list(x.shape)}) must be a "
                         f"multiple of {BLOCK}, got {size}")


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values to e4m3: round to nearest even, saturating to +-448; NaN stays NaN.

    torch's own cast rounds to nearest even but turns values beyond 464 into NaN, so the
    values are clamped first (a clamp then a rounding equals a saturating rounding: every
    value the clamp moves would have rounded to +-448 or overflowed)."""
    return torch.clamp(v.float(), -E4M3_MAX, E4M3_MAX).to(E4M3)


def block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, r, nonfinite) of blocks with these fp32 absolute maxima (NaN propagates)."""
    amax = amax.float()
    nonfinite = ~torch.isfinite(amax)
    a = torch.clamp_min(amax, AMAX_FLOOR)
    # Tensor / tensor on purpose: torch may turn a division by a Python scalar into a
    # multiplication by its reciprocal, which rounds differently.
    limit = torch.full_like(a, E4M3_MAX)
    scale = a / limit
    r = limit / a
    nan = torch.full_like(scale, float("nan"))
    return torch.where(nonfinite, nan, scale), r, nonfinite


def _quantize_blocks(blocks: torch.Tensor, reduce_dims: tuple[int, ...]):
    """blocks: a view whose `reduce_dims` run over one block; returns (q, scales)."""
    values = blocks.float()
    amax = values.abs().amax(dim=reduce_dims, keepdim=True)
    scale, r, nonfinite = block_scales(amax)
    q = round_to_e4m3(values * r).view(torch.uint8)
    q = torch.where(nonfinite, torch.full_like(q, E4M3_NAN_BITS), q)
    return q.view(E4M3), scale


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scales [..., K/128] fp32): one block per row and 128
    columns. K must be a multiple of 128."""
    _check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension [..., K]")
    _check_multiple("x", x, -1, "K, the last dimension,")
    K = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], K // BLOCK, BLOCK)
    q, scale = _quantize_blocks(blocks, (-1,))
    return q.reshape(x.shape).contiguous(), scale.squeeze(-1).contiguous()


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scales [..., N/128, K/128] fp32): one block per
    128 x 128 tile. N and K must be multiples of 128."""
    _check_float("w", w)
    if w.dim() < 2:
        raise ValueError(f"w: expected at least two dimensions [..., N, K], got shape {list(w.shape)}")
    _check_multiple("w", w, -2, "N")
    _check_multiple("w", w, -1, "K")
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    blocks = w.reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    q, scale = _quantize_blocks(blocks, (-3, -1))
    return (q.reshape(w.shape).contiguous(),
            scale.reshape(*lead, N // BLOCK, K // BLOCK).contiguous())


def padded_rows(rows: int) -> int:
    """Rows of a per-128-token copy: rows rounded up to a multiple of 128."""
    return -(-rows // BLOCK) * BLOCK


def quantize_cols_128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (rows = tokens) -> (q_t [C, Rp] e4m3, scales [C, Rp/128] fp32) with
    Rp = padded_rows(R): x^T quantized per column and 128 tokens, written token-contiguous
    for the weight-gradient GEMM. Rows R..Rp-1 of x count as zeros."""
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dimensions [R, C], got shape {list(x.shape)}")
    R, C = x.shape
    padded = x.new_zeros(padded_rows(R), C)
    padded[:R] = x
    return quantize_1x128(padded.t().contiguous())


def _expand(scales: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        scales = scales.repeat_interleave(BLOCK, dim=d)
    return scales


def dequantize_1x128(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [..., K] e4m3, scales [..., K/128] -> fp32 [..., K] = q * scale."""
    return q.float() * _expand(scales.float(), (-1,))


def dequantize_128x128(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [..., N, K] e4m3, scales [..., N/128, K/128] -> fp32 [..., N, K] = q * scale."""
    return q.float() * _expand(scales.float(), (-2, -1))


def dequantize_cols_128(q_t: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """q_t [C, Rp], scales [C, Rp/128] -> fp32 [rows, C]: the inverse layout of
    quantize_cols_128 (padding dropped)."""
    return dequantize_1x128(q_t, scales).t()[:rows]
