"""Speed of the FP8 quantizers against memory bandwidth: bytes moved (bf16 read, e4m3 and
fp32 scales written) over CUDA-event time, for the operands of one layer call.

    python tools/bench_fp8_quantize.py --model qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384

Rows: the library's kernels (megamoe_quantize_fp8_*: x and the SwiGLU output a per 1x128,
both weights per 128x128 with and without the W^T copy, the wgrad copies of x and a per 128
tokens) and, with --torch-casts, the compiled casts of the torch backend's fp8 baseline on
the same tensors. "% of ref" is against --reference-tbps (default 4.0 TB/s, about what a
copy kernel sustains on an H200; its HBM3e peak is 4.8 TB/s).
"""

from __future__ import annotations

import argparse
import sys

import torch

from megamoe import _fp8_kernels as kernels
from megamoe import torch_fp8
from megamoe.fp8 import padded_rows
from megamoe.presets import get_preset


def time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rows_1x128(M, K):
    return M * K * 2 + M * K + M * (K // 128) * 4


def cols_128(R, C):
    Rp = padded_rows(R)
    return R * C * 2 + C * Rp + C * (Rp // 128) * 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reference-tbps", type=float, default=4.0)
    parser.add_argument("--torch-casts", action="store_true",
                        help="also time the torch backend's compiled fp8 casts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_quantize: needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"{'model':16} {'what':34} {'shape':22} {'MB':>9} {'us':>9} {'TB/s':>6} {'% of ref':>8}")
    for name in args.model.split(","):
        shape = get_preset(name)
        H, I, E, k, T = shape.H, shape.I, shape.E, shape.k, args.tokens
        rows = T * k
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        a = torch.randn(rows, I, device="cuda").to(torch.bfloat16)
        xr = torch.randn(rows, H, device="cuda").to(torch.bfloat16)
        w1 = torch.randn(E, 2 * I, H, device="cuda").to(torch.bfloat16)
        w2 = torch.randn(E, H, I, device="cuda").to(torch.bfloat16)
        tiles = lambda w: w.shape[0] * (w.shape[1] // 128) * (w.shape[2] // 128) * 4
        cases = [
            ("1x128 x", list(x.shape), lambda: kernels.quantize_1x128(x), rows_1x128(T, H)),
            ("1x128 a (SwiGLU out)", list(a.shape), lambda: kernels.quantize_1x128(a), rows_1x128(rows, I)),
            ("128x128 w_gate_up", list(w1.shape), lambda: kernels.quantize_128x128(w1),
             w1.numel() * 3 + tiles(w1)),
            ("128x128 w_gate_up + W^T", list(w1.shape),
             lambda: kernels.quantize_128x128(w1, transposed=True), w1.numel() * 4 + tiles(w1)),
            ("128x128 w_down + W^T", list(w2.shape),
             lambda: kernels.quantize_128x128(w2, transposed=True), w2.numel() * 4 + tiles(w2)),
            ("cols_128 x rows (wgrad L1)", list(xr.shape), lambda: kernels.quantize_cols_128(xr),
             cols_128(rows, H)),
            ("cols_128 a (wgrad L2)", list(a.shape), lambda: kernels.quantize_cols_128(a),
             cols_128(rows, I)),
        ]
        if args.torch_casts:
            counts = torch.full((E,), rows // E, device="cuda")
            counts[0] += rows - int(counts.sum())
            _, _, group, cap = torch_fp8._padded_layout(counts, rows)
            xp = torch.randn(cap, H, device="cuda").to(torch.bfloat16)
            cases += [
                ("torch fp8: rowwise x rows", list(xp.shape), lambda: torch_fp8._rowwise(xp),
                 xp.numel() * 3 + cap * 4),
                ("torch fp8: rowwise w_gate_up^T", list(w1.shape),
                 lambda: torch_fp8._rowwise(w1.transpose(-2, -1)), w1.numel() * 3),
                ("torch fp8: per-expert cols x rows", list(xp.shape),
                 lambda: torch_fp8._colwise_by_group(xp, group, E), xp.numel() * 3),
            ]
        for what, dims, fn, nbytes in cases:
            us = time_ms(fn, args.iters) * 1e3
            tbps = nbytes / us / 1e6
            print(f"{name:16} {what:34} {str(dims):22} {nbytes / 1e6:9.1f} {us:9.1f} {tbps:6.2f} "
                  f"{100 * tbps / args.reference_tbps:7.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
