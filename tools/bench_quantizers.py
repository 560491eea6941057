"""Time and effective bandwidth of each instance of the standalone FP8 quantizer kernel
(quantize_fp8_kernel of csrc/kernels/common/quantize_fp8.cu) at the 30b and 235b preset
shapes, for A/B runs of two builds (the library is megamoe's usual one, MEGAMOE_LIBRARY):

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python python3 tools/bench_quantizers.py

Two parts:
- direct: the variants the Python bindings reach (megamoe._fp8_kernels), timed alone with
  CUDA events (warm-up, median of --iters): rows = <kRows1x128, false, false>
  (quantize_1x128), cols = <kColumns128, false, false> (quantize_cols_128), on the layer's
  operands: the SwiGLU output a [T k, I], dh [Rp, 2I], and x-sized rows [Rp, H].
- layer: the two instances that no binding reaches, quantize_fp8_to_rows (<kRows1x128, true,
  false>: x [T, H] into its k sorted rows) and quantize_fp8_columns_gathered (<kColumns128,
  false, true>: the padded rows of x and of p dy gathered from the token matrix), timed
  inside megamoe.moe(precision="fp8") forward + backward with torch.profiler (the mean
  kernel time per call; every call of one instance there has the same shape).

Bytes assumed (compulsory traffic; effective GB/s = bytes / time):
  rows [M, K]:      read 2 M K, write M K + 4 M K/128
  cols [R, C]:      read 2 R C, write C Rp + 4 C Rp/128             (Rp = R rounded up to 128)
  to_rows [T, H]:   read 2 T H, write T k H + 4 T k H/128           (every slot valid)
  gathered [Rp, H]: read 2 T k H (routed rows; padding rows are zeros, not read),
                    write H P + 4 H P/128  (P = the plan's padded rows, tile_offsets[E] 128,
                    read back from the routing of the run: about T k + 64 E)
Random routing (megamoe.routing.make_routing "random"), T = --tokens, k = 8.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from megamoe.fp8 import padded_rows
from megamoe.presets import get_preset

BLOCK = 128


def time_us(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def rows_bytes(M: int, K: int) -> int:
    return 2 * M * K + M * K + 4 * M * (K // BLOCK)


def cols_bytes(R: int, C: int) -> int:
    Rp = padded_rows(R)
    return 2 * R * C + C * Rp + 4 * C * (Rp // BLOCK)


def report(model: str, what: str, shape, nbytes: int, us: float) -> None:
    print(f"{model:16} {what:44} {str(list(shape)):18} {nbytes / 1e6:8.1f} {us:8.1f} "
          f"{nbytes / us / 1e3:7.0f}")


def direct(model: str, shape, T: int, iters: int) -> None:
    from megamoe import _fp8_kernels as kernels

    H, I, E, k = shape.H, shape.I, shape.E, shape.k
    routed = T * k
    Rp = padded_rows(routed + E * (BLOCK - 1))  # the padded rows' bound, as the layer's buffers
    for what, M, K, fn in (("rows <kRows1x128,0,0> a (SwiGLU out)", routed, I, kernels.quantize_1x128),
                           ("rows <kRows1x128,0,0> dh", Rp, 2 * I, kernels.quantize_1x128),
                           ("rows <kRows1x128,0,0> x-sized rows", Rp, H, kernels.quantize_1x128),
                           ("cols <kColumns128,0,0> a", Rp, I, kernels.quantize_cols_128),
                           ("cols <kColumns128,0,0> dh", Rp, 2 * I, kernels.quantize_cols_128),
                           ("cols <kColumns128,0,0> x rows (unfused)", Rp, H,
                            kernels.quantize_cols_128)):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        us = time_us(lambda: fn(x), iters)
        nbytes = rows_bytes(M, K) if "rows" in what.split()[0] else cols_bytes(M, K)
        report(model, what, (M, K), nbytes, us)
        del x


KERNEL = re.compile(r"quantize_fp8_kernel<\(megamoe::Fp8Blocks\)(\d), (true|false), (true|false)>")


def layer(model: str, shape, T: int, iters: int) -> None:
    import megamoe
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from layer_inputs import layer_inputs

    H, E, k = shape.H, shape.E, shape.k
    x, ids, weights, w_gate_up, w_down, dy = layer_inputs(shape, T)

    def step():
        y = megamoe.moe(x, ids, weights, w_gate_up, w_down, backend="fused", precision="fp8",
                        check_ids=False)
        y.backward(dy)
        for t in (x, weights, w_gate_up, w_down):
            t.grad = None

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    P = int(((counts + BLOCK - 1) // BLOCK).sum()) * BLOCK
    found = {}
    for e in prof.key_averages():
        m = KERNEL.search(e.key)
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = e.cuda_time_total
        if m and e.count and total > 0:
            found[m.groups()] = (total / e.count, e.count // iters)
    cases = {
        ("0", "true", "false"): ("to_rows <kRows1x128,1,0> x", (T, H),
                                 2 * T * H + T * k * H + 4 * T * k * (H // BLOCK)),
        ("2", "false", "true"): ("gathered <kColumns128,0,1> x, p dy", (P, H),
                                 2 * T * k * H + H * P + 4 * H * (P // BLOCK)),
    }
    for key, (what, dims, nbytes) in cases.items():
        if key not in found:
            print(f"{model:16} {what:44} not among the layer's kernels")
            continue
        us, calls = found[key]
        report(model, f"{what} (x{calls}/step)", dims, nbytes, us)
    others = sorted(set(found) - set(cases))
    for key in others:
        us, calls = found[key]
        print(f"{model:16} {'layer: <' + ','.join(key) + '>':44} {'':18} {'':8} {us:8.1f}  "
              f"(x{calls}/step, mean over its shapes)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20, help="timed calls (direct part)")
    parser.add_argument("--layer-iters", type=int, default=3, help="profiled layer steps")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer part")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quantizers: needs a CUDA GPU", file=sys.stderr)
        return 1
    began = time.time()
    print(f"{'model':16} {'kernel instance, operand':44} {'shape':18} {'MB':>8} {'us':>8} "
          f"{'GB/s':>7}")
    for name in args.model.split(","):
        shape = get_preset(name)
        direct(name, shape, args.tokens, args.iters)
        if not args.no_layer:
            layer(name, shape, args.tokens, args.layer_iters)
        torch.cuda.empty_cache()
    print(f"({time.time() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
