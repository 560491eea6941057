"""Where each of the FP8 layer bars (docs/fp8.md) stands, part by part, from one run.

For each preset it takes the fused layer's per-kernel GPU time (torch.profiler) of the
forward and the backward, saved mode, in bf16, fp8 and fp8_bwd, from one loop of training
calls (each forward followed by its backward, as megamoe-bench times them) after a settling
run at the power cap's clocks, and measures the sustained bf16 and FP8 matmul peaks
(megamoe.bench's yardsticks) in the same process. Each part's kernels are split into the
grouped GEMMs and the passes (every other kernel: the routing plan, the quantizers, the
gathers and the combines). For each bar it prints:

  - the ratio the kernels give (sums of kernel time per call; the bench's wall-clock ratios
    also count the launch gaps, 1-2 us a kernel, and its longer runs' clocks);
  - the ratio if the FP8 side's passes cost what the bf16 side's do (what FP8's own passes,
    the quantizers, cost the bar);
  - the FP8 GEMM rate the bar needs with the FP8 passes as measured, and with them at the
    bf16 passes' cost, as a share of the sustained FP8 peak, beside the rate the FP8 GEMMs
    reach and the bf16 GEMMs' share of the sustained bf16 peak.

    python tools/fp8_bar_budget.py                       # both presets, 16384 tokens
    python tools/fp8_bar_budget.py --models qwen3-30b-a3b --json budget.json
    python tools/fp8_bar_budget.py --forward-alone       # also a loop of forwards alone

With --forward-alone it also profiles, after each precision's training calls, a loop of
forwards alone (autograd on and saved mode as in the training calls, no backward; settled
the same way) and prints and records that forward's kernel time beside the forward inside
the training calls: a loop of FP8 forwards alone once ran about 11% slower than the same
forward inside training calls, compared across two runs (performance log, seventh session
of 2026-12-05). The bars do not use it.

GEMM FLOPs per call: forward 6 T k H I, backward 12 T k H I (the bench's forward count,
doubled for the two dgrads and two weight gradients).
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.bench import git_commit, measure_gemm_peak_tflops
from megamoe.presets import get_preset

from layer_inputs import layer_inputs
from profile_layer import short_name

PRECISIONS = ("bf16", "fp8", "fp8_bwd")
# (bar name, FP8 precision, phase, bar): phase "fwd", "fwd_bwd" or "bwd" (fwd_bwd - fwd).
BARS = (("fp8 forward", "fp8", "fwd", 1.5),
        ("fp8 forward + backward", "fp8", "fwd_bwd", 1.35),
        ("fp8_bwd backward", "fp8_bwd", "bwd", 1.35))
PEAK_SHARE_BAR = 0.65  # the fp8 forward's share of the sustained FP8 peak


def gpu_kernels(prof) -> list:
    """The profile's kernels (and other GPU work) in the order they started."""
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.device_time_total > 0), key=lambda e: e.time_range.start)


def bucket(kernel_name: str) -> str:
    """Which sum a kernel's time goes to: the grouped GEMMs' or the passes'."""
    return "gemm_us" if "grouped_gemm_kernel" in kernel_name else "passes_us"


def split_kernel_times(forward, backward, iters: int) -> dict:
    """GPU time per call (us) of the grouped GEMMs and of the other kernels, for the forward
    and the backward of `iters` training calls, as megamoe-bench times them: each forward
    followed by its backward. A call's first kernels are its forward's: as many as one
    forward alone launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    forward_kernels = len(gpu_kernels(prof))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            backward(forward())
        torch.cuda.synchronize()
    kernels = gpu_kernels(prof)
    per_call = len(kernels) // iters
    if len(kernels) % iters or per_call <= forward_kernels:
        raise RuntimeError(f"{len(kernels)} kernels in {iters} training calls, {forward_kernels} "
                           "in a forward: not one forward and one backward a call")
    out = {phase: {"gemm_us": 0.0, "passes_us": 0.0, "kernels": {}} for phase in ("fwd", "bwd")}
    for i, e in enumerate(kernels):
        part = out["fwd" if i % per_call < forward_kernels else "bwd"]
        us = e.time_range.elapsed_us() / iters
        part[bucket(e.name)] += us
        name = short_name(e.name)
        part["kernels"][name] = part["kernels"].get(name, 0.0) + us
    for part in out.values():
        part["total_us"] = part["gemm_us"] + part["passes_us"]
    out["fwd_bwd"] = {key: out["fwd"][key] + out["bwd"][key]
                      for key in ("gemm_us", "passes_us", "total_us")}
    return out


def forward_alone_times(forward, iters: int) -> dict:
    """GPU time per call (us) of the grouped GEMMs and of the other kernels over `iters`
    forwards run back to back with no backward between them."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            forward()
        torch.cuda.synchronize()
    out = {"gemm_us": 0.0, "passes_us": 0.0}
    for e in gpu_kernels(prof):
        us = e.time_range.elapsed_us() / iters
        out[bucket(e.name)] += us
    out["total_us"] = out["gemm_us"] + out["passes_us"]
    return out


def settle(call, seconds: float) -> None:
    """Runs `call` back to back for `seconds`, so that the profile sees the clocks a long run
    settles at under the power cap rather than a cold GPU's boost."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(4):
            call()
        torch.cuda.synchronize()


def measure_preset(model: str, tokens: int, iters: int, settle_seconds: float,
                   forward_alone: bool = False) -> dict:
    shape = get_preset(model)
    x, ids, weights, w_gate_up, w_down, dy = layer_inputs(shape, tokens)
    out = {}
    for precision in PRECISIONS:
        def forward():
            return megamoe.moe(x, ids, weights, w_gate_up, w_down, backend="fused",
                               precision=precision, backward_mode="saved", check_ids=False)

        def backward(y):
            y.backward(dy)
            for t in (x, weights, w_gate_up, w_down):
                t.grad = None

        settle(lambda: backward(forward()), settle_seconds)
        times = split_kernel_times(forward, backward, iters)
        out[precision] = times
        fwd, both = times["fwd"], times["fwd_bwd"]
        print(f"  {model} {precision}: fwd {fwd['total_us']:.1f} us (GEMMs {fwd['gemm_us']:.1f}), "
              f"fwd+bwd {both['total_us']:.1f} us (GEMMs {both['gemm_us']:.1f})", flush=True)
        for phase in ("fwd", "bwd"):
            for name, us in sorted(times[phase]["kernels"].items(), key=lambda kv: -kv[1]):
                print(f"    {phase} {us:9.1f}  {name[:100]}")
        if forward_alone:
            settle(forward, settle_seconds)
            alone = forward_alone_times(forward, iters)
            times["fwd_alone"] = alone
            print(f"  {model} {precision}: fwd alone {alone['total_us']:.1f} us (GEMMs "
                  f"{alone['gemm_us']:.1f}) against {fwd['total_us']:.1f} in training calls "
                  f"({alone['total_us'] / fwd['total_us'] - 1:+.1%})", flush=True)
    return {"shape": {"H": shape.H, "I": shape.I, "E": shape.E, "k": shape.k},
            "tokens": tokens, "kernels": out}


def budget(preset: dict, peak_bf16: float, peak_fp8: float) -> list[dict]:
    """One row per bar: the ratios and the FP8 GEMM rates described in the module doc."""
    s, tokens = preset["shape"], preset["tokens"]
    flops_fwd = 6 * tokens * s["k"] * s["H"] * s["I"]
    flops = {"fwd": flops_fwd, "bwd": 2 * flops_fwd, "fwd_bwd": 3 * flops_fwd}
    k = preset["kernels"]

    def tflops(phase: str, us: float) -> float:
        return flops[phase] / (us * 1e-6) / 1e12

    rows = []
    for name, precision, phase, bar in BARS:
        base, fp8 = k["bf16"][phase], k[precision][phase]
        target = base["total_us"] / bar  # the FP8 side's kernel time the bar allows
        # fp8_bwd's forward is bf16's, so its GEMM rate is that of its FP8 backward only.
        need = target - fp8["passes_us"]
        need_bf16_passes = target - base["passes_us"]
        rows.append({
            "bar": name, "phase": phase, "bar_ratio": bar,
            "bf16_us": base["total_us"], "fp8_us": fp8["total_us"],
            "bf16_gemm_us": base["gemm_us"], "bf16_passes_us": base["passes_us"],
            "fp8_gemm_us": fp8["gemm_us"], "fp8_passes_us": fp8["passes_us"],
            "ratio": base["total_us"] / fp8["total_us"],
            "ratio_fp8_passes_at_bf16_cost": base["total_us"] / (fp8["gemm_us"] + base["passes_us"]),
            "bf16_gemm_share_of_bf16_peak": tflops(phase, base["gemm_us"]) / peak_bf16,
            "fp8_gemm_share_of_fp8_peak": tflops(phase, fp8["gemm_us"]) / peak_fp8,
            "fp8_gemm_share_needed": tflops(phase, need) / peak_fp8 if need > 0 else None,
            "fp8_gemm_share_needed_bf16_passes":
                tflops(phase, need_bf16_passes) / peak_fp8 if need_bf16_passes > 0 else None,
        })
    # The peak bar: the fp8 forward at PEAK_SHARE_BAR of the FP8 peak may take allowed_us.
    fwd = k["fp8"]["fwd"]
    allowed_us = flops_fwd / (PEAK_SHARE_BAR * peak_fp8 * 1e12) * 1e6
    need = allowed_us - fwd["passes_us"]
    rows.append({
        "bar": "fp8 forward, share of the FP8 peak", "phase": "fwd", "bar_ratio": PEAK_SHARE_BAR,
        "fp8_us": fwd["total_us"], "fp8_gemm_us": fwd["gemm_us"], "fp8_passes_us": fwd["passes_us"],
        "ratio": tflops("fwd", fwd["total_us"]) / peak_fp8,
        "fp8_gemm_share_of_fp8_peak": tflops("fwd", fwd["gemm_us"]) / peak_fp8,
        "fp8_gemm_share_needed": tflops("fwd", need) / peak_fp8 if need > 0 else None,
    })
    return rows


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_budget(model: str, rows: list[dict]) -> None:
    print(f"\n{model}: kernel time per call (us), GEMMs + passes; rates as shares of the sustained peaks")
    print("| bar | bf16 | fp8 side | ratio (bar) | fp8 passes at bf16's cost | fp8 GEMMs at | "
          "needed | needed, passes at bf16's | bf16 GEMMs at |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["phase"] == "fwd" and "bf16_us" not in r:
            print(f"| {r['bar']} | - | {r['fp8_us']:.0f} ({r['fp8_gemm_us']:.0f} + "
                  f"{r['fp8_passes_us']:.0f}) | {pct(r['ratio'])} ({pct(r['bar_ratio'])}) | - | "
                  f"{pct(r['fp8_gemm_share_of_fp8_peak'])} | {pct(r['fp8_gemm_share_needed'])} | - | - |")
            continue
        print(f"| {r['bar']} | {r['bf16_us']:.0f} ({r['bf16_gemm_us']:.0f} + "
              f"{r['bf16_passes_us']:.0f}) | {r['fp8_us']:.0f} ({r['fp8_gemm_us']:.0f} + "
              f"{r['fp8_passes_us']:.0f}) | {r['ratio']:.3f}x ({r['bar_ratio']}x) | "
              f"{r['ratio_fp8_passes_at_bf16_cost']:.3f}x | {pct(r['fp8_gemm_share_of_fp8_peak'])} | "
              f"{pct(r['fp8_gemm_share_needed'])} | {pct(r['fp8_gemm_share_needed_bf16_passes'])} | "
              f"{pct(r['bf16_gemm_share_of_bf16_peak'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b",
                        help="comma-separated presets")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10, help="profiled calls per measurement")
    parser.add_argument("--settle-seconds", type=float, default=2.0,
                        help="back-to-back calls before each precision's profiles")
    parser.add_argument("--peak-seconds", type=float, default=5.0,
                        help="back-to-back matmuls of each sustained peak (megamoe-bench's)")
    parser.add_argument("--json", help="write the measurements and the budget here")
    parser.add_argument("--forward-alone", action="store_true",
                        help="also time a loop of forwards alone beside the training calls' "
                             "forward (not used by the bars)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_bar_budget.py: needs a CUDA GPU")
    if args.tokens <= 0 or args.iters <= 0:
        sys.exit("fp8_bar_budget.py: --tokens and --iters must be positive")
    models = [m for m in args.models.split(",") if m]
    for model in models:
        get_preset(model)  # an unknown preset fails here, before any GPU time is spent
    device = torch.device("cuda")
    print(f"measuring the sustained bf16 and FP8 matmul peaks ({args.peak_seconds:g} s each)",
          flush=True)
    peak_bf16 = measure_gemm_peak_tflops(device, seconds=args.peak_seconds)
    peak_fp8 = measure_gemm_peak_tflops(device, seconds=args.peak_seconds, fp8=True)
    print(f"  sustained peaks: bf16 {peak_bf16:.1f} TFLOP/s, FP8 {peak_fp8:.1f} TFLOP/s", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "commit": git_commit(),
              "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
              "tokens": args.tokens, "iters": args.iters, "settle_seconds": args.settle_seconds,
              "peak_seconds": args.peak_seconds,
              "sustained_peak_tflops": {"bf16": peak_bf16, "fp8": peak_fp8}, "presets": {}}
    for model in models:
        print(f"profiling {model} ({', '.join(PRECISIONS)}; training calls, the forward and "
              "the backward apart)", flush=True)
        preset = measure_preset(model, args.tokens, args.iters, args.settle_seconds,
                                args.forward_alone)
        preset["budget"] = budget(preset, peak_bf16, peak_fp8)
        result["presets"][model] = preset
        torch.cuda.empty_cache()
    for model in models:
        print_budget(model, result["presets"][model]["budget"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
