"""Throughput of sustained work against its first milliseconds, with the SM clock and board
power sampled beside it: is a workload power-capped, and what is the GEMM peak it can hold?

    python tools/power_probe.py --seconds 3 --out clocks.csv

Each workload runs after an idle pause (the clock settles back to boost) for --seconds of
back-to-back calls, each timed with CUDA events. Printed per workload: the median of the
first 5 calls, the median of the last half, and the SM clock, power and power-cap flag that
nvidia-smi reported during the last half. The bench's "% of peak" uses a short matmul run
(10 calls, about 15 ms), which the power cap does not reach; the sustained matmul here is the
roofline a long layer run actually has.

    python tools/power_probe.py --training --seconds 3 --out clocks.csv

With --training the workloads are the fused layer's training calls (forward and backward,
saved mode) at bf16, fp8_bwd and fp8 on both presets, each timed per phase: the same bf16
forward kernels then show what the backward run between them does to the clock they get.
"""

import argparse
import statistics
import sys
import time

import torch

import megamoe
from megamoe._clocks import ClockSampler, gpu_selector, window_means
from megamoe.presets import get_preset

from layer_inputs import layer_inputs

def clock_columns(sampler, windows) -> list[tuple[float, float, float]]:
    """Stops the sampler; the mean SM MHz, watts and power-capped share over each (start,
    end) window, nan where no sample fell."""
    time.sleep(0.3)  # the last samples
    samples = sampler.close()
    nan = (float("nan"),) * 3
    return [window_means(samples, start, end) or nan for start, end in windows]


def run_for(fn, seconds: float) -> tuple[list[float], float, float]:
    """Calls fn back to back for `seconds`; returns per-call ms and the wall window of the
    last half (unix times)."""
    marks = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        marks.append((start, end))
        if len(marks) % 8 == 0:
            marks[-8][1].synchronize()  # keep the CPU at most a few calls ahead
    torch.cuda.synchronize()
    t1 = time.time()
    return [s.elapsed_time(e) for s, e in marks], t0 + (t1 - t0) / 2, t1


def run_training_for(forward, backward, seconds: float):
    """Training calls back to back for `seconds`; returns per-call forward and backward ms
    and the wall window of the last half (unix times)."""
    marks = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        y = forward()
        mid.record()
        backward(y)
        end.record()
        marks.append((start, mid, end))
        if len(marks) % 4 == 0:
            marks[-4][2].synchronize()  # keep the CPU at most a few calls ahead
    torch.cuda.synchronize()
    t1 = time.time()
    return ([s.elapsed_time(m) for s, m, _ in marks], [m.elapsed_time(e) for _, m, e in marks],
            t0 + (t1 - t0) / 2, t1)


def training_workloads(tokens: int):
    """(name, forward, backward) of the fused layer's training calls, saved mode."""
    workloads = []
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        x, ids, w, wgu, wd, dy = layer_inputs(get_preset(model), tokens)
        for precision in ("bf16", "fp8_bwd", "fp8"):
            def forward(x=x, ids=ids, w=w, wgu=wgu, wd=wd, precision=precision):
                return megamoe.moe(x, ids, w, wgu, wd, backend="fused", precision=precision,
                                   backward_mode="saved", check_ids=False)

            def backward(y, dy=dy, params=(x, w, wgu, wd)):
                y.backward(dy)
                for t in params:
                    t.grad = None
            workloads.append((f"{model} {precision} training", forward, backward))
    return workloads


def after_pause(name: str, warm_call, timed_run, pause: float):
    """Warms a workload up (3 calls), idles `pause` s so that the clock goes back to boost,
    then returns what timed_run() returns (per-call times first)."""
    for _ in range(3):
        warm_call()
    torch.cuda.synchronize()
    time.sleep(pause)
    result = timed_run()
    print(f"[power_probe] {name}: {len(result[0])} calls", file=sys.stderr, flush=True)
    return result


def probe_training(args, sampler) -> int:
    results = []
    for name, forward, backward in training_workloads(args.tokens):
        fwd, bwd, half_start, end = after_pause(
            name, lambda: backward(forward()),
            lambda: run_training_for(forward, backward, args.seconds), args.pause)
        results.append((name, fwd, bwd, half_start, end))
    clocks = clock_columns(sampler, [r[3:] for r in results])
    print(f"{'workload':36s} {'first fwd':>9s} {'sust. fwd':>9s} {'first bwd':>9s} "
          f"{'sust. bwd':>9s} {'SM MHz':>7s} {'W':>5s} {'pwr cap':>8s}   (ms)")
    for (name, fwd, bwd, _, _), (mhz, watts, capped) in zip(results, clocks):
        half = len(fwd) // 2
        print(f"{name:36s} {statistics.median(fwd[:5]):9.3f} {statistics.median(fwd[half:]):9.3f} "
              f"{statistics.median(bwd[:5]):9.3f} {statistics.median(bwd[half:]):9.3f} "
              f"{mhz:7.0f} {watts:5.0f} {capped:8.0%}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds before each workload")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default="power_probe_clocks.csv")
    parser.add_argument("--training", action="store_true",
                        help="the fused layer's training calls (bf16, fp8_bwd, fp8; saved mode) "
                             "instead of forwards and the matmul")
    args = parser.parse_args()
    sampler = ClockSampler(gpu_selector(torch.cuda.current_device()), 50, args.out)
    if not sampler.available:
        print("power_probe: nvidia-smi not found; no clock or power samples", file=sys.stderr)
    if args.training:
        return probe_training(args, sampler)

    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    workloads = [("bf16 matmul 8192^3", 2 * size**3, lambda: torch.matmul(a, b, out=c))]
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        shape = get_preset(model)
        x, ids, w, wgu, wd, dy = layer_inputs(shape, args.tokens, requires_grad=False)
        flops = shape.forward_flops(args.tokens)
        for backend in ("fused", "torch"):
            def forward(x=x, ids=ids, w=w, wgu=wgu, wd=wd, backend=backend):
                with torch.no_grad():
                    megamoe.moe(x, ids, w, wgu, wd, backend=backend, check_ids=False)
            workloads.append((f"{model} {backend} forward", flops, forward))

    results = []
    for name, flops, fn in workloads:
        times, half_start, end = after_pause(name, fn, lambda: run_for(fn, args.seconds),
                                             args.pause)
        results.append((name, flops, times, half_start, end))
    clocks = clock_columns(sampler, [r[3:] for r in results])

    print(f"{'workload':34s} {'first 5 ms':>10s} {'sustained ms':>12s} {'first TFLOP/s':>13s} "
          f"{'sust. TFLOP/s':>13s} {'SM MHz':>7s} {'W':>5s} {'pwr cap':>8s}")
    for (name, flops, times, _, _), (mhz, watts, capped) in zip(results, clocks):
        first = statistics.median(times[:5])
        sustained = statistics.median(times[len(times) // 2:])
        print(f"{name:34s} {first:10.3f} {sustained:12.3f} {flops / first / 1e9:13.1f} "
              f"{flops / sustained / 1e9:13.1f} {mhz:7.0f} {watts:5.0f} {capped:8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
