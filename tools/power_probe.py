"""Throughput of sustained work against its first milliseconds, with the SM clock and board
power sampled beside it: is a workload power-capped, and what is the GEMM peak it can hold?

    python tools/power_probe.py --seconds 3 --out clocks.csv

Each workload runs after an idle pause (the clock settles back to boost) for --seconds of
back-to-back calls, each timed with CUDA events. Printed per workload: the median of the
first 5 calls, the median of the last half, and the SM clock, power and power-cap flag that
nvidia-smi reported during the last half. The bench's "% of peak" uses a short matmul run
(10 calls, about 15 ms), which the power cap does not reach; the sustained matmul here is the
roofline a long layer run actually has.
"""

import argparse
import csv
import statistics
import subprocess
import sys
import time

import torch

import megamoe
from megamoe.presets import get_preset

from layer_inputs import layer_inputs

SMI_FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu",
              "clocks_event_reasons.sw_power_cap", "clocks_event_reasons.hw_slowdown"]


def start_sampler(path: str, period_ms: int, gpu: int):
    query = ",".join(SMI_FIELDS)
    return subprocess.Popen(["nvidia-smi", "-i", str(gpu), f"--query-gpu={query}",
                             "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                            stdout=open(path, "w"), stderr=subprocess.DEVNULL)


def read_samples(path: str) -> list[tuple[float, float, float, str]]:
    """(unix time, SM MHz, watts, sw power cap flag) per sample."""
    samples = []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5:
                continue
            try:
                stamp = time.mktime(time.strptime(row[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
                stamp += float("0." + row[0].strip().split(".")[1]) if "." in row[0] else 0.0
                samples.append((stamp, float(row[1]), float(row[2]), row[4].strip()))
            except ValueError:
                continue
    return samples


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds before each workload")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default="power_probe_clocks.csv")
    args = parser.parse_args()
    gpu = torch.cuda.current_device()
    sampler = start_sampler(args.out, 50, gpu)

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
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        time.sleep(args.pause)
        times, half_start, end = run_for(fn, args.seconds)
        results.append((name, flops, times, half_start, end))
        print(f"[power_probe] {name}: {len(times)} calls", file=sys.stderr, flush=True)
    time.sleep(0.3)
    sampler.terminate()
    sampler.wait()
    samples = read_samples(args.out)

    print(f"{'workload':34s} {'first 5 ms':>10s} {'sustained ms':>12s} {'first TFLOP/s':>13s} "
          f"{'sust. TFLOP/s':>13s} {'SM MHz':>7s} {'W':>5s} {'pwr cap':>8s}")
    for name, flops, times, half_start, end in results:
        first = statistics.median(times[:5])
        sustained = statistics.median(times[len(times) // 2:])
        window = [s for s in samples if half_start <= s[0] <= end]
        mhz = statistics.mean(s[1] for s in window) if window else float("nan")
        watts = statistics.mean(s[2] for s in window) if window else float("nan")
        capped = sum(1 for s in window if "Active" in s[3]) / len(window) if window else float("nan")
        print(f"{name:34s} {first:10.3f} {sustained:12.3f} {flops / first / 1e9:13.1f} "
              f"{flops / sustained / 1e9:13.1f} {mhz:7.0f} {watts:5.0f} {capped:8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
