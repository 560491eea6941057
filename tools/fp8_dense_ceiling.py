"""What blockwise FP8 costs against per-tensor FP8 on dense GEMMs, in one run.

The FP8 yardstick of megamoe-bench ("% of the sustained FP8 peak") is torch._scaled_mm with
one scale per tensor: no promotion inside the K loop. The recipe's blockwise scales (1x128
activations, 128x128 weights) promote the accumulators every 128 of K. This times, for the
same M, N, K, under the power cap:
- the fused layer at one expert and k = 1, whose L1 (SwiGLU, FP8 rows out) and L2 are then
  dense GEMMs [T, H] x [H, 2I] and [T, I] x [I, H] (per-kernel times from torch.profiler);
- torch._scaled_mm per tensor, rowwise (scales applied once, after the K loop) and
  blockwise 1x128 x 128x128 where this torch and cuBLAS take it;
- torch.matmul in bf16, and the fused bf16 layer at the same shape.
With --backward the layers run forward + backward (saved mode) and all six of their GEMMs
are timed (the dgrads and the weight gradients too), and --experts / --topk give the
layer more experts (--experts 128 --topk 8 --hidden 2048 --intermediate 768 is the 30b
preset, whose weight gradients have K = 1024 per expert, against K = T at one expert).
--routing balanced gives every expert the same rows (no partly empty last M-tile), and
--routing first puts every token on expert 0 (dense GEMMs, but the tile scheduler still
searches all the experts at every tile).
Each op runs for --seconds back to back before its timed calls, and the ops take turns for
--rounds rounds, so that each is timed in the power state the others see. --layers-only
skips the torch ops (for A/B runs of two libraries, one process each); --ncu runs one
layer call of --precision between cudaProfilerStart and Stop, for
ncu --profile-from-start off.

    python tools/fp8_dense_ceiling.py --tokens 16384 --hidden 4096 --intermediate 4096
    python tools/fp8_dense_ceiling.py --tokens 131072 --hidden 2048 --intermediate 768 --backward
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.presets import MoEShape

from layer_inputs import layer_inputs


def events_ms(fn, iters: int) -> float:
    marks = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in marks)


# The fused layer's GEMMs in launch order: forward, then backward (saved mode), and a piece
# of each one's kernel name that must match (the check that the order is as assumed).
# The weight gradients' order differs: FP8 runs dW_gate_up first (chain::backward_wgrad).
FORWARD_GEMMS = [("L1", "SwiGLU"), ("L2", "Store")]
BACKWARD_GEMMS = {
    "fp8": [("dgrad L2", "SwiGLUBackward"), ("dgrad L1", "Store"),
            ("dW_gate_up", "Grouping)1"), ("dW_down", "Grouping)1")],
    "bf16": [("dgrad L2", "SwiGLUBackward"), ("dgrad L1", "Store"),
             ("dW_down", "Grouping)1"), ("dW_gate_up", "Grouping)1")],
}


def kernel_ms(fn, iters: int, names) -> dict[str, float]:
    """Median per call of each of the layer's GEMM kernels (ms), named by launch order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gemms = sorted((e for e in events if e.get("cat") == "kernel"
                    and "grouped_gemm_kernel" in e["name"]), key=lambda e: e["ts"])
    if len(gemms) != iters * len(names):
        raise RuntimeError(f"expected {len(names)} GEMM kernels a call, found "
                           f"{len(gemms) / iters:.1f}")
    times = {}
    for i, e in enumerate(gemms):
        name, piece = names[i % len(names)]
        if piece not in e["name"]:
            raise RuntimeError(f"GEMM {i % len(names)} of a call is not {name}: {e['name'][:200]}")
        times.setdefault(name, []).append(e["dur"] / 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def run_for(fn, seconds: float) -> None:
    began = time.perf_counter()
    n = 0
    while time.perf_counter() - began < seconds:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.5, help="warm run before each timing")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--experts", type=int, default=1, help="the layer's experts")
    parser.add_argument("--topk", type=int, default=1, help="the layer's experts per token")
    parser.add_argument("--routing", default="random",
                        help="the layer's routing: a megamoe.routing mode (random, balanced, "
                             "skewed), or first (k = 1: every token on expert 0, the others empty)")
    parser.add_argument("--backward", action="store_true",
                        help="the layers' forward + backward (saved mode), all six GEMMs")
    parser.add_argument("--layers-only", action="store_true",
                        help="time the fused layers only, not the torch GEMMs")
    parser.add_argument("--ncu", action="store_true",
                        help="one layer call of --precision inside cudaProfilerStart/Stop, "
                             "nothing timed (for ncu --profile-from-start off)")
    parser.add_argument("--precision", default="fp8", choices=("fp8", "bf16"),
                        help="the layer's precision under --ncu")
    args = parser.parse_args()
    T, H, I = args.tokens, args.hidden, args.intermediate
    shape = MoEShape("dense", H, I, args.experts, args.topk)
    first = args.routing == "first"
    if first and args.topk != 1:
        parser.error("--routing first needs --topk 1")
    x, ids, p, w1, w2, dy = layer_inputs(shape, T, requires_grad=args.backward,
                                         routing="random" if first else args.routing)
    if first:
        ids.zero_()
    R = T * args.topk  # the layer's rows: its GEMMs' M (or K for the weight gradients)
    flops = {"L1": 2 * R * 2 * I * H, "L2": 2 * R * H * I}
    flops.update({"dgrad L2": flops["L2"], "dgrad L1": flops["L1"], "dW_gate_up": flops["L1"],
                  "dW_down": flops["L2"]})

    # torch operands for the two GEMM shapes: A [M, K] row-major, B [K, N] column-major.
    def operands(M, N, K):
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).t()
        return a, b
    gemms = {"L1": (R, 2 * I, H), "L2": (R, H, I)}
    ops = {}
    for name, (M, N, K) in ({} if args.layers_only or args.ncu else gemms).items():
        a, b = operands(M, N, K)
        one = torch.ones((), device="cuda")
        ops[f"{name} _scaled_mm per-tensor"] = (lambda a=a, b=b, one=one: torch._scaled_mm(
            a, b, one, one, out_dtype=torch.bfloat16), flops[name])
        sa = torch.rand(M, 1, device="cuda") + 0.5
        sb = torch.rand(1, N, device="cuda") + 0.5
        ops[f"{name} _scaled_mm rowwise"] = (lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(
            a, b, sa, sb, out_dtype=torch.bfloat16), flops[name])
        # Blockwise: A's scales [M, K/128] M-major, B's [K/128, N/128] (outer-dim major), as
        # torch's SM90 blockwise path documents them; skipped where this build refuses.
        sa_b = (torch.rand(K // 128, M, device="cuda") + 0.5).t()
        sb_b = (torch.rand(N // 128, K // 128, device="cuda") + 0.5).t()
        ops[f"{name} _scaled_mm blockwise"] = (lambda a=a, b=b, sa=sa_b, sb=sb_b: torch._scaled_mm(
            a, b, sa, sb, out_dtype=torch.bfloat16), flops[name])
        ab = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        bb = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ops[f"{name} torch.matmul bf16"] = (lambda ab=ab, bb=bb: ab @ bb, flops[name])

    def layer(precision):
        def call():
            y = megamoe.moe(x, ids, p, w1, w2, backend="fused", precision=precision,
                            check_ids=False, backward_mode="saved")
            if args.backward:
                for t in (x, p, w1, w2):
                    t.grad = None
                y.backward(dy)
        return call

    if args.ncu:
        fn = layer(args.precision)
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    usable = {}
    for name, (fn, f) in ops.items():
        try:
            fn()
            torch.cuda.synchronize()
            usable[name] = (fn, f)
        except Exception as e:  # noqa: BLE001 -- report what this torch refuses, keep going
            print(f"skipped {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    print(f"T={T} H={H} I={I} E={args.experts} k={args.topk} ({args.routing} routing): "
          f"L1 {R}x{2 * I}x{H}, L2 {R}x{H}x{I} (M x N x K), {args.rounds} rounds, "
          f"{args.seconds} s warm before each timing")
    results = {}
    for r in range(args.rounds):
        for name, (fn, f) in usable.items():
            run_for(fn, args.seconds)
            ms = events_ms(fn, args.iters)
            results.setdefault(name, []).append(f / (ms * 1e-3) / 1e12)
        for precision in ("fp8", "bf16"):
            fn = layer(precision)
            run_for(fn, args.seconds)
            names = FORWARD_GEMMS + (BACKWARD_GEMMS[precision] if args.backward else [])
            for which, ms in kernel_ms(fn, args.iters, names).items():
                label = f"{which} fused layer {precision}"
                results.setdefault(label, []).append(flops[which] / (ms * 1e-3) / 1e12)
        print(f"round {r + 1} done", flush=True)
    for name in sorted(results):
        vals = results[name]
        print(f"  {name:36s} TFLOP/s " + " / ".join(f"{v:7.1f}" for v in vals))


if __name__ == "__main__":
    main()
