"""Where a layer call's wall time goes beyond its kernels: event-timed forward and backward
(as megamoe-bench times them), the same with the CPU put far ahead of the GPU first (a
sleep kernel), and from a torch.profiler trace the kernels' busy time, their span and the
largest idle gaps between consecutive kernels (with the kernels on either side).

    python tools/layer_gaps.py --model qwen3-30b-a3b --tokens 16384 --backward-mode saved
    python tools/layer_gaps.py --model qwen3-30b-a3b --precision fp8
"""

import argparse
import json
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.presets import get_preset

from layer_inputs import layer_inputs


def step(args, tensors, marks=None):
    x, ids, p, w1, w2, dy = tensors
    for t in (x, p, w1, w2):
        t.grad = None
    start = torch.cuda.Event(enable_timing=True)
    mid = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    y = megamoe.moe(x, ids, p, w1, w2, backend=args.backend, check_ids=False,
                    precision=args.precision,
                    **({"backward_mode": args.backward_mode} if args.backend == "fused" else {}))
    mid.record()
    y.backward(dy)
    end.record()
    if marks is not None:
        marks.append((start, mid, end))


def timed(args, tensors, ahead: bool):
    marks = []
    torch.cuda.synchronize()
    if ahead:
        torch.cuda._sleep(int(args.sleep_cycles))  # the CPU enqueues every step meanwhile
    for _ in range(args.iters):
        step(args, tensors, marks)
    torch.cuda.synchronize()
    fwd = statistics.median(s.elapsed_time(m) for s, m, _ in marks)
    bwd = statistics.median(m.elapsed_time(e) for _, m, e in marks)
    return fwd, bwd


def kernel_gaps(args, tensors):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step(args, tensors)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    by_pair = {}  # (kernel, next kernel) -> the idle times between them
    for a, b in zip(kernels, kernels[1:]):
        by_pair.setdefault((a["name"][:70], b["name"][:70]), []).append(
            b["ts"] - (a["ts"] + a["dur"]))
    return busy / args.iters, span / args.iters, len(kernels) // args.iters, by_pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backward-mode", default="saved")
    parser.add_argument("--precision", default="bf16", help="bf16, fp8 or fp8_bwd")
    parser.add_argument("--sleep-cycles", type=float, default=4e9,
                        help="length of the sleep kernel that puts the CPU ahead (cycles)")
    args = parser.parse_args()
    tensors = layer_inputs(get_preset(args.model), args.tokens)
    for _ in range(3):
        step(args, tensors)
    fwd, bwd = timed(args, tensors, ahead=False)
    fwd_a, bwd_a = timed(args, tensors, ahead=True)
    busy, span, n, by_pair = kernel_gaps(args, tensors)
    print(f"{args.backend} {args.precision} ({args.backward_mode}) {args.model} T={args.tokens}: medians of "
          f"{args.iters} steps")
    print(f"  events, as the bench:      fwd {fwd:.3f} ms  bwd {bwd:.3f} ms  sum {fwd + bwd:.3f}")
    print(f"  events, CPU put ahead:     fwd {fwd_a:.3f} ms  bwd {bwd_a:.3f} ms  "
          f"sum {fwd_a + bwd_a:.3f}")
    print(f"  profiler, per step:        {n} kernels, busy {busy / 1e3:.3f} ms, span "
          f"{span / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms")
    print("  idle between kernel pairs (us per step, total over the pair's occurrences):")
    rows = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))
    for (a, b), gaps in rows[:12]:
        print(f"    {sum(gaps) / args.iters:8.1f}  x{len(gaps) / args.iters:<4.1f} {a}  ->  {b}")


if __name__ == "__main__":
    main()
