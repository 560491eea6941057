"""The library's blockwise FP8 quantizers for CUDA tensors (megamoe_quantize_fp8_* of
megamoe.h): the recipe of megamoe.fp8, bit for bit, in one read of the bf16 values.

Each function allocates contiguous outputs unless given them (`q`, `q_t`, `scales`: any
tensors of the documented shape and dtype; scales may have any strides, e.g. a transposed
view for an M-major layout). Asynchronous on the current stream of x's device.
"""

from __future__ import annotations

import torch

from . import _lib
from .errors import MegaMoEError
from .fp8 import BLOCK, E4M3, padded_rows


def _check_input(name: str, x: torch.Tensor, ndim: int, dims: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
        raise MegaMoEError(f"{name}: the CUDA quantizers take CUDA tensors, got {where}; "
                           "megamoe.fp8 has the same recipe for CPU tensors")
    if x.dtype != torch.bfloat16:
        raise MegaMoEError(f"{name}: expected torch.bfloat16, got {x.dtype}")
    if x.dim() != ndim:
        raise MegaMoEError(f"{name}: expected {ndim} dimensions {dims}, got shape {list(x.shape)}")


def _run(function: str, x: torch.Tensor, *outputs) -> None:
    descs = [_lib.describe(x)] + [None if t is None else _lib.describe(t) for t in outputs]
    with torch.cuda.device(x.device):
        _lib.call(function, *(_lib.ref(d) for d in descs), _lib.stream(x.device))


def _blocks(size: int) -> int:
    return size // BLOCK if size % BLOCK == 0 else -1  # -1: the library names the error


def quantize_1x128(x: torch.Tensor, q: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (q [M, K] e4m3, scales [M, K/128] fp32)."""
    _check_input("x", x, 2, "[M, K]")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device) if q is None else q
    if scales is None:
        scales = torch.empty(M, max(_blocks(K), 0), dtype=torch.float32, device=x.device)
    _run("megamoe_quantize_fp8_1x128", x, q, scales)
    return q, scales


def quantize_128x128(w: torch.Tensor, *, direct: bool = True, transposed: bool = False,
                     q: torch.Tensor | None = None, q_t: torch.Tensor | None = None,
                     scales: torch.Tensor | None = None):
    """w [E, N, K] bf16 -> (q [E, N, K] or None, q_t [E, K, N] or None, scales
    [E, N/128, K/128]): the direct copy when `direct`, W^T's copy when `transposed`."""
    _check_input("w", w, 3, "[E, N, K]")
    E, N, K = w.shape
    if not direct and not transposed:
        raise MegaMoEError("quantize_128x128: direct=False and transposed=False ask for nothing")
    if direct and q is None:
        q = torch.empty(E, N, K, dtype=E4M3, device=w.device)
    if transposed and q_t is None:
        q_t = torch.empty(E, K, N, dtype=E4M3, device=w.device)
    if scales is None:
        scales = torch.empty(E, max(_blocks(N), 0), max(_blocks(K), 0), dtype=torch.float32,
                             device=w.device)
    _run("megamoe_quantize_fp8_128x128", w, q if direct else None, q_t if transposed else None,
         scales)
    return (q if direct else None), (q_t if transposed else None), scales


def quantize_cols_128(x: torch.Tensor, q_t: torch.Tensor | None = None,
                      scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] bf16 -> (q_t [C, Rp] e4m3, scales [C, Rp/128] fp32), Rp = R rounded up to 128."""
    _check_input("x", x, 2, "[R, C]")
    R, C = x.shape
    Rp = padded_rows(R)
    q_t = torch.empty(C, Rp, dtype=E4M3, device=x.device) if q_t is None else q_t
    if scales is None:
        scales = torch.empty(C, Rp // BLOCK, dtype=torch.float32, device=x.device)
    _run("megamoe_quantize_fp8_cols_128", x, q_t, scales)
    return q_t, scales
