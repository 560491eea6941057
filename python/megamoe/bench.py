"""megamoe-bench: time MoE backends side by side and record the results.

    megamoe-bench --backends torch,fused --model qwen3-30b-a3b --tokens 16384
    torchrun --nproc-per-node 8 -m megamoe.bench --ep 8

For every model preset x tokens-per-rank x backend it times the forward (with autograd
recording, as in training) and the backward separately with CUDA events, after a warm-up
and --settle-seconds of untimed calls (so that the timed calls run at the clock the power
cap holds through a long run), takes medians over several rotated input sets, and reports
fwd, bwd, fwd+bwd (sum of the two medians), the full layer under activation checkpointing
(2*fwd + bwd), forward TFLOP/s against the bf16 GEMM peak measured in the same run, and the
speedup over the torch baseline.
Rank 0 prints a table and writes <out-dir>/<name>.json (+ a PNG plot).

Two GEMM peaks are measured: the short one (10 matmuls, ~15 ms, run at boost clock) that
"% peak" uses, and a sustained one (--sustained-peak-seconds of back-to-back matmuls, the
median of the second half) that "% sust." uses. An H200 running GEMMs for more than a few
tens of milliseconds reaches its 700 W power cap and lowers its SM clock (about 1.98 ->
1.45 GHz); the timed layers run that long, so the sustained peak is the roofline they
actually have (bench/results/PERFLOG.md, "power cap"). Each row also records the mean SM
clock and board power nvidia-smi reported during its timed iterations: under the cap the
clock depends on what runs, so rows of different precisions run at different clocks.

Without a GPU (or with --cpu) it runs the C++ CPU reference at the "tiny" preset: a smoke
test of the pipeline, not a benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import megamoe
from megamoe._clocks import ClockSampler, gpu_selector, window_means
from megamoe._validate import PRECISIONS
from megamoe._fused_op import BACKWARD_MODES as FUSED_BACKWARD_MODES
from megamoe.presets import PRESETS, MoEShape, get_preset
from megamoe.routing import ROUTING_MODES, make_routing

KNOWN_BACKENDS = ("torch", "fused", "reference")
# How each backend produces its backward, recorded with every row so that numbers from
# different backward strategies are not compared unawares. The fused backend has two
# (--fused-backward-modes): "recompute" (L1 recomputed) and "saved" (L1 output kept).
BACKWARD_MODE = {"torch": "autograd", "reference": "recompute"}
# Backends that can run on CPU tensors; the others are reported as skipped in a CPU run.
CPU_BACKENDS = ("reference",)
# Backends that take an expert-parallel group; the others are skipped when --ep > 1.
EP_BACKENDS = ("torch", "fused")

GPU_DEFAULTS = {"backends": "torch,fused", "models": ["qwen3-30b-a3b", "qwen3-235b-a22b"],
                "tokens": [16384]}
CPU_DEFAULTS = {"backends": "reference", "models": ["tiny"], "tokens": [256]}

GEMM_PEAK_SIZE = 8192
SUSTAINED_PEAK_SECONDS = 2.0
GPU_SETTLE_SECONDS = 2.0
SETTLE_CHUNK = 4  # calls between the settling loop's clock checks
CPU_RUN_NOTICE = (
    "NOTE: no CUDA GPU in use: this is a CPU run of the C++ reference backend ({models}),\n"
    "a smoke test of the benchmark pipeline, NOT a GPU benchmark."
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    resolve_defaults(args, use_cuda)
    validate_args(parser, args)
    run = setup_run(parser, args, use_cuda)
    try:
        results = run_benchmark(args, run, argv)
    finally:
        if run.group is not None:
            torch.distributed.destroy_process_group()
    if run.rank == 0:
        print(format_table(results["rows"]))
        write_outputs(results, args)
    return 0


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megamoe-bench",
        description="Benchmark megamoe backends (forward, backward, full layer) on model presets.",
    )
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated, from {', '.join(KNOWN_BACKENDS)} "
                             f"(default {GPU_DEFAULTS['backends']}; CPU run: reference)")
    parser.add_argument("--model", action="append", default=None,
                        help=f"preset name, repeatable or comma-separated: {', '.join(PRESETS)} "
                             "(default qwen3-30b-a3b and qwen3-235b-a22b; CPU run: tiny)")
    parser.add_argument("--tokens", action="append", default=None,
                        help="tokens per rank, repeatable or comma-separated (default 16384; CPU run: 256)")
    parser.add_argument("--routing", choices=ROUTING_MODES, default="random")
    parser.add_argument("--fused-backward-modes", default=",".join(FUSED_BACKWARD_MODES),
                        help="backward modes of the fused backend, one row each, from "
                             f"{', '.join(FUSED_BACKWARD_MODES)} (default both)")
    parser.add_argument("--precision", default="bf16",
                        help="comma list passed to megamoe.moe, one row per backend and precision "
                             "(default bf16); an FP8 precision also measures the FP8 matmul peaks")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks; >1 must run under torchrun --nproc-per-node N")
    parser.add_argument("--num-comm-sms", type=int, default=None,
                        help="fused backend with --ep > 1: the Buffer's num_comm_sms, SMs of the "
                             "kernels that move rows between ranks (default: the library's)")
    parser.add_argument("--sustained-peak-seconds", type=float, default=SUSTAINED_PEAK_SECONDS,
                        help="seconds of back-to-back matmuls for the sustained (power-capped) "
                             f"GEMM peak; 0 skips it (default {SUSTAINED_PEAK_SECONDS:g})")
    parser.add_argument("--settle-seconds", type=float, default=None,
                        help="seconds of untimed calls before each row's timed iterations, so that "
                             "the row is timed at the clock the power cap holds through a long run "
                             f"rather than in the first second's swing (default {GPU_SETTLE_SECONDS:g} "
                             "on a GPU, 0 on the CPU)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("--input-sets", type=int, default=3,
                        help="input sets (x, routing, dy) rotated over the iterations (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="base seed; rank r uses seed + r")
    parser.add_argument("--name", default=None, help="results file stem (default from the settings)")
    parser.add_argument("--out-dir", default="bench/results", help="default bench/results")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    parser.add_argument("--cpu", action="store_true",
                        help="do the CPU reference run even when a GPU is present")
    return parser


def _split_commas(values: list[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def resolve_defaults(args: argparse.Namespace, is_cuda: bool) -> None:
    """Fills unset list options with the GPU or CPU defaults and splits comma lists."""
    defaults = GPU_DEFAULTS if is_cuda else CPU_DEFAULTS
    # dict.fromkeys drops repeats and keeps the order given.
    args.backends = list(dict.fromkeys(_split_commas([args.backends or defaults["backends"]])))
    args.model = list(dict.fromkeys(_split_commas(args.model) if args.model else defaults["models"]))
    args.tokens = list(dict.fromkeys(_split_commas(args.tokens) if args.tokens
                                     else [str(t) for t in defaults["tokens"]]))
    args.precisions = list(dict.fromkeys(_split_commas([args.precision])))
    if args.settle_seconds is None:
        args.settle_seconds = GPU_SETTLE_SECONDS if is_cuda else 0.0


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [b for b in args.backends if b not in KNOWN_BACKENDS]
    if unknown or not args.backends:
        parser.error(f"unknown backend(s) {', '.join(unknown) or '(none given)'}; "
                     f"valid backends: {', '.join(KNOWN_BACKENDS)}")
    args.fused_backward_modes = list(dict.fromkeys(_split_commas([args.fused_backward_modes])))
    bad_modes = [m for m in args.fused_backward_modes if m not in FUSED_BACKWARD_MODES]
    if bad_modes or not args.fused_backward_modes:
        parser.error(f"--fused-backward-modes: unknown mode(s) {', '.join(bad_modes) or '(none given)'}; "
                     f"valid: {', '.join(FUSED_BACKWARD_MODES)}")
    bad_precisions = [p for p in args.precisions if p not in PRECISIONS]
    if bad_precisions or not args.precisions:
        parser.error(f"--precision: unknown precision(s) {', '.join(bad_precisions) or '(none given)'}; "
                     f"valid: {', '.join(PRECISIONS)}")
    try:
        args.shapes = [get_preset(name) for name in args.model]
    except ValueError as error:
        parser.error(str(error))
    try:
        args.tokens = [int(t) for t in args.tokens]
    except ValueError:
        parser.error(f"--tokens takes integers, got {','.join(args.tokens)}")
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be >= 1")
    for option, value, minimum in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                   ("--input-sets", args.input_sets, 1), ("--ep", args.ep, 1),
                                   ("--sustained-peak-seconds", args.sustained_peak_seconds, 0),
                                   ("--settle-seconds", args.settle_seconds, 0)):
        if value < minimum:
            parser.error(f"{option} must be >= {minimum}, got {value}")
    if args.num_comm_sms is not None and args.num_comm_sms < 1:
        parser.error(f"--num-comm-sms must be >= 1, got {args.num_comm_sms}")
    for shape in args.shapes:
        if shape.E % args.ep:
            parser.error(f"--ep {args.ep}: model {shape.name} has E={shape.E} experts, "
                         f"not divisible by {args.ep}")


# ---------------------------------------------------------------- devices and ranks


@dataclass
class RunContext:
    device: torch.device
    is_cuda: bool
    rank: int = 0
    world_size: int = 1
    group: object = None  # the EP process group when world_size > 1
    launcher: str | None = None  # e.g. "torchrun --nproc-per-node 8"


def setup_run(parser: argparse.ArgumentParser, args: argparse.Namespace, use_cuda: bool) -> RunContext:
    env_world_size = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = _torchrun_launcher()
    if args.ep > 1 and not use_cuda:
        reason = "--cpu was given" if args.cpu else "this machine has no CUDA GPU"
        parser.error(f"--ep {args.ep} needs {args.ep} CUDA GPUs under torchrun, but {reason}")
    if env_world_size != args.ep:
        parser.error(f"--ep {args.ep} needs exactly {args.ep} processes, found WORLD_SIZE={env_world_size}: "
                     f"run `torchrun --nproc-per-node {args.ep} -m megamoe.bench --ep {args.ep} ...`")
    if not use_cuda:
        return RunContext(device=torch.device("cpu"), is_cuda=False, launcher=launcher)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if args.ep == 1:
        return RunContext(device=device, is_cuda=True, launcher=launcher)

    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=device)
    return RunContext(device=device, is_cuda=True, rank=dist.get_rank(),
                      world_size=dist.get_world_size(), group=dist.group.WORLD, launcher=launcher)


def _torchrun_launcher() -> str | None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"


def progress(run: RunContext, message: str) -> None:
    if run.rank == 0:
        print(f"[megamoe-bench] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- timing


class CudaClock:
    """Marks are CUDA events on the current stream: they time the GPU work between them,
    even while the host runs ahead."""

    name = "cuda events"

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def wait(self) -> None:
        torch.cuda.synchronize()


class CpuClock:
    name = "time.perf_counter"

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return (end - start) * 1e3

    def wait(self) -> None:
        pass


def measure_gemm_peak_tflops(device: torch.device, size: int = GEMM_PEAK_SIZE,
                             warmup: int = 3, iters: int = 10, seconds: float = 0.0,
                             fp8: bool = False) -> float:
    """Median bf16 matmul throughput of this GPU: the yardstick for "% of peak". With
    `seconds` > 0 the matmuls run back to back for that long instead of `iters` calls and
    the median is over the second half: the throughput under the power cap that a long run
    settles at (the sustained peak). fp8: an e4m3 x e4m3 torch._scaled_mm (per-tensor
    scales, bf16 out) instead, the FP8 tensor cores' yardstick."""
    generator = torch.Generator(device=device).manual_seed(1234)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    c = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    if fp8:
        a = a.to(torch.float8_e4m3fn)
        b = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)

        def matmul():
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, out=c)
    else:
        def matmul():
            torch.matmul(a, b, out=c)
    clock = CudaClock()
    for _ in range(warmup):
        matmul()
    marks = []
    began = time.perf_counter()
    while (time.perf_counter() - began < seconds) if seconds > 0 else len(marks) < iters:
        start = clock.mark()
        matmul()
        marks.append((start, clock.mark()))
        if len(marks) % 16 == 0:
            marks[-16][1].synchronize()  # the CPU stays a few calls ahead, so time is GPU time
    clock.wait()
    timed = marks[len(marks) // 2:] if seconds > 0 else marks
    median_ms = statistics.median(clock.elapsed_ms(s, e) for s, e in timed)
    del a, b, c
    return 2 * size**3 / (median_ms * 1e-3) / 1e12


# ---------------------------------------------------------------- inputs


@dataclass
class InputSet:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    dy: torch.Tensor


def build_weights(shape: MoEShape, experts_local: int, dtype, device, generator) -> list[torch.Tensor]:
    """[w_gate_up, w_down], scaled by 1/sqrt(fan_in) so activations stay O(1)."""
    w_gate_up = torch.randn(experts_local, 2 * shape.I, shape.H, dtype=dtype, device=device,
                            generator=generator) * shape.H**-0.5
    w_down = torch.randn(experts_local, shape.H, shape.I, dtype=dtype, device=device,
                         generator=generator) * shape.I**-0.5
    return [w_gate_up.requires_grad_(), w_down.requires_grad_()]


def build_input_sets(shape: MoEShape, num_tokens: int, routing: str, count: int,
                     dtype, device, generator) -> list[InputSet]:
    sets = []
    for _ in range(count):
        x = torch.randn(num_tokens, shape.H, dtype=dtype, device=device, generator=generator)
        # Every rank routes its tokens over all E experts, local and remote.
        topk_ids, topk_weights = make_routing(num_tokens, shape.E, shape.k, routing,
                                              device=device, generator=generator)
        dy = torch.randn(num_tokens, shape.H, dtype=dtype, device=device, generator=generator)
        sets.append(InputSet(x.requires_grad_(), topk_ids, topk_weights.requires_grad_(), dy))
    return sets


# ---------------------------------------------------------------- one backend


def time_forward_backward(call, weights, input_sets, iterations: int, clock) -> tuple[list, list]:
    """Per-iteration forward and backward times (ms), rotating over the input sets."""
    marks = []
    for i in range(iterations):
        inputs = input_sets[i % len(input_sets)]
        # A fresh gradient each step, as after optimizer.zero_grad(set_to_none=True).
        for tensor in (*weights, inputs.x, inputs.topk_weights):
            tensor.grad = None
        start = clock.mark()
        y = call(inputs)
        forward_done = clock.mark()
        y.backward(inputs.dy)
        backward_done = clock.mark()
        marks.append((start, forward_done, backward_done))
        del y
    clock.wait()
    forward_ms = [clock.elapsed_ms(s, f) for s, f, _ in marks]
    backward_ms = [clock.elapsed_ms(f, b) for _, f, b in marks]
    return forward_ms, backward_ms


def time_forward(call, weights, input_sets, iterations: int, clock) -> tuple[list, list]:
    """Per-iteration forward times (ms) without autograd, and no backward times."""
    marks = []
    with torch.no_grad():
        for i in range(iterations):
            start = clock.mark()
            call(input_sets[i % len(input_sets)])
            marks.append((start, clock.mark()))
    clock.wait()
    return [clock.elapsed_ms(s, e) for s, e in marks], []


def benchmark_backend(backend: str, weights, input_sets, args, run: RunContext, clock,
                      forward_only: bool = False, backward_mode: str | None = None,
                      precision: str = "bf16", window: list | None = None):
    """(fwd median ms, bwd median ms) over args.iters timed iterations; with EP, the max
    over ranks of each rank's medians (the slowest rank sets the step time). With
    forward_only, the forward runs under torch.no_grad() and bwd is None. backward_mode:
    the fused backend's (passed to megamoe.moe). window: gets the timed iterations' wall
    times (unix start, end) appended, for the clock samples."""
    w_gate_up, w_down = weights
    extra = {} if backward_mode is None else {"backward_mode": backward_mode}
    buffer = None
    if backend == "fused" and run.group is not None:
        # The fused expert-parallel layer runs over the group's communication buffer.
        T = input_sets[0].x.shape[0]
        buffer = megamoe.Buffer(run.group, T, w_gate_up.shape[2], w_gate_up.shape[1] // 2,
                                w_gate_up.shape[0] * run.world_size, input_sets[0].topk_ids.shape[1],
                                num_comm_sms=args.num_comm_sms)
        extra["buffer"] = buffer

    def call(inputs: InputSet):
        # The ids are valid by construction; check_ids=False leaves out the range check's
        # host sync, which would otherwise stall every backend's forward alike.
        return megamoe.moe(inputs.x, inputs.topk_ids, inputs.topk_weights, w_gate_up, w_down,
                           group=run.group, precision=precision, backend=backend,
                           check_ids=False, **extra)

    timer = time_forward if forward_only else time_forward_backward
    try:
        timer(call, weights, input_sets, args.warmup, clock)
        if args.settle_seconds > 0:
            settle(lambda: timer(call, weights, input_sets, SETTLE_CHUNK, clock),
                   args.settle_seconds, run)
        if run.group is not None:
            torch.distributed.barrier()
        began = time.time()
        forward_ms, backward_ms = timer(call, weights, input_sets, args.iters, clock)
        if window is not None:
            window.append((began, time.time()))
        if buffer is not None:
            buffer.check()
    finally:
        if buffer is not None:
            buffer.close()
    medians = [statistics.median(forward_ms), statistics.median(backward_ms or [0.0])]
    if run.group is not None:
        medians = _max_over_ranks(medians, run)
    return medians[0], (None if forward_only else medians[1])


def settle(run_chunk, seconds: float, run: RunContext) -> None:
    """Runs untimed chunks of calls back to back for `seconds` of wall time. Under EP the
    ranks agree after each chunk on whether to go on (the slowest rank's clock), so that
    every rank runs the same calls and no collective is left waiting."""
    began = time.perf_counter()
    while True:
        run_chunk()  # ends with the clock's wait: the chunk's GPU work is done
        elapsed = [time.perf_counter() - began]
        if run.group is not None:
            elapsed = _max_over_ranks(elapsed, run)
        if elapsed[0] >= seconds:
            return


def _max_over_ranks(values: list[float], run: RunContext) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=run.device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=run.group)
    return tensor.tolist()


# ---------------------------------------------------------------- rows


def make_row(shape: MoEShape, num_tokens: int, backend: str, args, dtype,
             backward_mode: str, precision: str = "bf16") -> dict:
    return {
        "model": shape.name, "H": shape.H, "I": shape.I, "E": shape.E, "k": shape.k,
        "tokens_per_rank": num_tokens, "ep": args.ep, "backend": backend,
        "precision": precision, "dtype": str(dtype).removeprefix("torch."),
        "routing": args.routing, "backward_mode": backward_mode,
        "fwd_ms": None, "bwd_ms": None, "fwd_bwd_ms": None, "full_layer_ms": None,
        "fwd_tflops": None, "pct_of_peak": None, "pct_of_sustained_peak": None,
        "speedup_fwd_vs_torch": None, "speedup_full_vs_torch": None,
        "speedup_fwd_vs_bf16": None, "speedup_bwd_vs_bf16": None, "speedup_fwd_bwd_vs_bf16": None,
        "sm_mhz": None, "power_w": None, "status": "ok", "note": None,
    }


def fill_timings(row: dict, shape: MoEShape, fwd_ms: float, bwd_ms: float | None,
                 peak_tflops) -> None:
    """bwd_ms None: a backend with a forward only (its backward figures stay None)."""
    row["fwd_ms"] = fwd_ms
    row["fwd_tflops"] = shape.forward_flops(row["tokens_per_rank"]) / (fwd_ms * 1e-3) / 1e12
    if peak_tflops:
        row["pct_of_peak"] = 100 * row["fwd_tflops"] / peak_tflops
    if bwd_ms is None:
        return
    row["bwd_ms"] = bwd_ms
    row["fwd_bwd_ms"] = fwd_ms + bwd_ms
    # Activation checkpointing re-runs the forward during the backward pass.
    row["full_layer_ms"] = 2 * fwd_ms + bwd_ms


def add_speedups(rows: list[dict]) -> None:
    """Speedup of each row over the torch row of the same model, tokens, ep and routing."""
    def config(row):
        return (row["model"], row["tokens_per_rank"], row["ep"], row["routing"], row["precision"])

    torch_rows = {config(r): r for r in rows if r["backend"] == "torch" and r["status"] == "ok"}
    for row in rows:
        baseline = torch_rows.get(config(row))
        if baseline is None or row["fwd_ms"] is None:
            continue
        row["speedup_fwd_vs_torch"] = baseline["fwd_ms"] / row["fwd_ms"]
        if row["full_layer_ms"] is not None:
            row["speedup_full_vs_torch"] = baseline["full_layer_ms"] / row["full_layer_ms"]
    # Each precision's speedup over the bf16 row of the same backend and backward mode.
    def variant(row):
        return (row["model"], row["tokens_per_rank"], row["ep"], row["routing"], row["backend"],
                row.get("backward_mode"))

    bf16_rows = {variant(r): r for r in rows if r["precision"] == "bf16" and r["status"] == "ok"}
    for row in rows:
        baseline = bf16_rows.get(variant(row))
        if baseline is None or row["precision"] == "bf16" or row["fwd_ms"] is None:
            continue
        row["speedup_fwd_vs_bf16"] = baseline["fwd_ms"] / row["fwd_ms"]
        if row.get("bwd_ms") is not None and baseline.get("bwd_ms") is not None:
            row["speedup_bwd_vs_bf16"] = baseline["bwd_ms"] / row["bwd_ms"]
            row["speedup_fwd_bwd_vs_bf16"] = baseline["fwd_bwd_ms"] / row["fwd_bwd_ms"]


def benchmark_config(shape: MoEShape, num_tokens: int, args, run: RunContext, clock,
                     peak_tflops, windows: list | None = None) -> list[dict]:
    """One row per backend; the backends share the weights and input sets. windows: gets
    (row, unix start, end) of each row's timed iterations appended."""
    dtype = torch.bfloat16 if run.is_cuda else torch.float32
    generator = torch.Generator(device=run.device).manual_seed(args.seed + run.rank)
    experts_local = shape.E // run.world_size
    weights = build_weights(shape, experts_local, dtype, run.device, generator)
    input_sets = build_input_sets(shape, num_tokens, args.routing, args.input_sets, dtype,
                                  run.device, generator)
    rows = []
    for backend, mode, precision in backend_variants(args):
        row = make_row(shape, num_tokens, backend, args, dtype, mode, precision)
        fused_mode = mode if backend == "fused" else None
        label = f"{shape.name} T={num_tokens}/rank ep={args.ep} {backend}" + (
            f" {precision}" if precision != "bf16" else "") + (f" ({mode})" if fused_mode else "")
        if not run.is_cuda and backend not in CPU_BACKENDS:
            row["status"] = f"skipped: backend {backend!r} needs a CUDA GPU (this is a CPU run)"
        elif run.world_size > 1 and backend not in EP_BACKENDS:
            row["status"] = f"skipped: backend {backend!r} takes no expert-parallel group"
        else:
            window = []
            try:
                fwd_ms, bwd_ms = benchmark_backend(backend, weights, input_sets, args, run, clock,
                                                   backward_mode=fused_mode, precision=precision,
                                                   window=window)
                fill_timings(row, shape, fwd_ms, bwd_ms, peak_tflops)
            except NotImplementedError as error:  # megamoe.NotBuiltError included
                # A backend whose backward is not built yet still has a forward to time.
                try:
                    fwd_ms = benchmark_backend(backend, weights, input_sets, args, run, clock,
                                               forward_only=True, backward_mode=fused_mode,
                                               precision=precision, window=window)[0]
                    fill_timings(row, shape, fwd_ms, None, peak_tflops)
                    row["status"] = "forward only"
                    row["backward_mode"] = None
                    row["note"] = f"{type(error).__name__}: {error}"
                except NotImplementedError as forward_error:
                    row["status"] = f"skipped: {type(forward_error).__name__}: {forward_error}"
            except megamoe.MegaMoEError as error:
                # A shape or dtype this backend does not take (e.g. fused at the tiny preset).
                row["status"] = f"skipped: {error}"
            if windows is not None and window:  # a timed run completed
                windows.append((row, *window[-1]))
        progress(run, f"{label}: " + (
            row["status"] if row["fwd_ms"] is None else
            f"fwd {row['fwd_ms']:.3f} ms" + ("" if row["bwd_ms"] is None else f", bwd {row['bwd_ms']:.3f} ms")))
        rows.append(row)
        _free_gradients(weights, input_sets)
    del weights, input_sets
    if run.is_cuda:
        torch.cuda.empty_cache()
    return rows


def backend_variants(args) -> list[tuple[str, str, str]]:
    """(backend, backward mode, precision) of each row: the fused backend once per requested
    mode, every backend once per requested precision."""
    variants = []
    for backend in args.backends:
        modes = args.fused_backward_modes if backend == "fused" else [BACKWARD_MODE[backend]]
        variants += [(backend, mode, precision) for mode in modes
                     for precision in getattr(args, "precisions", [args.precision])]
    return variants


def _free_gradients(weights, input_sets) -> None:
    for tensor in (*weights, *(t for s in input_sets for t in (s.x, s.topk_weights))):
        tensor.grad = None


# ---------------------------------------------------------------- the run


def run_benchmark(args, run: RunContext, argv: list[str]) -> dict:
    if not run.is_cuda and run.rank == 0:
        print(CPU_RUN_NOTICE.format(models=", ".join(args.model)), flush=True)
    clock = CudaClock() if run.is_cuda else CpuClock()
    peak_tflops = sustained_tflops = None
    fp8_peaks = {"fp8_peak_tflops": None, "fp8_peak_sustained_tflops": None}
    if run.is_cuda:
        progress(run, f"measuring the bf16 GEMM peak ({GEMM_PEAK_SIZE}^3 matmul)")
        peak_tflops = measure_gemm_peak_tflops(run.device)
        if run.group is not None:
            # The slowest GPU, as the timings below take the slowest rank.
            peak_tflops = -_max_over_ranks([-peak_tflops], run)[0]
        progress(run, f"bf16 GEMM peak: {peak_tflops:.1f} TFLOP/s")
        if args.sustained_peak_seconds > 0:
            progress(run, f"measuring the sustained bf16 GEMM peak ({args.sustained_peak_seconds:g} s "
                          "of matmuls)")
            sustained_tflops = measure_gemm_peak_tflops(run.device,
                                                        seconds=args.sustained_peak_seconds)
            if run.group is not None:
                sustained_tflops = -_max_over_ranks([-sustained_tflops], run)[0]
            progress(run, f"sustained bf16 GEMM peak: {sustained_tflops:.1f} TFLOP/s")
        if any(p in ("fp8", "fp8_bwd") for p in args.precisions):
            fp8_peaks["fp8_peak_tflops"] = measure_gemm_peak_tflops(run.device, fp8=True)
            progress(run, f"FP8 GEMM peak: {fp8_peaks['fp8_peak_tflops']:.1f} TFLOP/s")
            if args.sustained_peak_seconds > 0:
                fp8_peaks["fp8_peak_sustained_tflops"] = measure_gemm_peak_tflops(
                    run.device, seconds=args.sustained_peak_seconds, fp8=True)
                progress(run, "sustained FP8 GEMM peak: "
                              f"{fp8_peaks['fp8_peak_sustained_tflops']:.1f} TFLOP/s")
            if run.group is not None:
                for key in fp8_peaks:
                    if fp8_peaks[key] is not None:
                        fp8_peaks[key] = -_max_over_ranks([-fp8_peaks[key]], run)[0]
        torch.cuda.empty_cache()

    rows, windows = [], []
    # Each row's mean SM clock and power over its timed iterations (this rank's GPU).
    sampler = ClockSampler(gpu_selector(run.device)) if run.is_cuda else None
    try:
        for shape in args.shapes:
            for num_tokens in args.tokens:
                rows += benchmark_config(shape, num_tokens, args, run, clock, peak_tflops, windows)
    finally:
        samples = sampler.close() if sampler is not None else []
    for row, began, ended in windows:
        means = window_means(samples, began, ended)
        if means is not None:
            row["sm_mhz"], row["power_w"] = round(means[0]), round(means[1], 1)
    for row in rows:
        # A forward in FP8 is measured against the FP8 ceiling; fp8_bwd's forward is bf16.
        fp8_forward = row["precision"] == "fp8"
        short = fp8_peaks["fp8_peak_tflops"] if fp8_forward else peak_tflops
        sustained = fp8_peaks["fp8_peak_sustained_tflops"] if fp8_forward else sustained_tflops
        if row["fwd_tflops"]:
            row["pct_of_peak"] = 100 * row["fwd_tflops"] / short if short else None
            row["pct_of_sustained_peak"] = 100 * row["fwd_tflops"] / sustained if sustained else None
    add_speedups(rows)
    return {**describe_run(args, run, argv, peak_tflops, sustained_tflops), **fp8_peaks,
            "rows": rows}


def describe_run(args, run: RunContext, argv: list[str], peak_tflops,
                 sustained_tflops=None) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(run.device) if run.is_cuda else "cpu",
        "num_gpus": run.world_size if run.is_cuda else 0,
        "world_size": run.world_size,
        "commit": git_commit(),
        "command": describe_command(argv, run.launcher),
        "argv": argv,
        "launcher": run.launcher,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "megamoe_version": getattr(megamoe, "__version__", "unknown"),
        "python_version": platform.python_version(),
        "gemm_peak_tflops": peak_tflops,
        "gemm_peak_sustained_tflops": sustained_tflops,
        "device": describe_device(run),
        "cpu_smoke_run": not run.is_cuda,
        "settings": {
            "backends": args.backends, "models": args.model, "tokens_per_rank": args.tokens,
            "routing": args.routing, "precisions": getattr(args, "precisions", [args.precision]),
            "ep": args.ep,
            "num_comm_sms": args.num_comm_sms,
            "fused_backward_modes": args.fused_backward_modes,
            "iters": args.iters, "warmup": args.warmup, "input_sets": args.input_sets,
            "settle_seconds": args.settle_seconds,
            "sustained_peak_seconds": args.sustained_peak_seconds,
            "seed": args.seed, "check_ids": False,
        },
        "method": {
            "timer": CudaClock.name if run.is_cuda else CpuClock.name,
            "fwd_ms": "median over iters of the forward call with autograd recording",
            "bwd_ms": "median over iters of y.backward(dy), dy random",
            "settle": "each row runs settle_seconds of untimed calls after its warm-up, so that "
                      "its timed iterations run at the clock the power cap holds through a long "
                      "run (records without settle_seconds were timed right after the warm-up)",
            "fwd_bwd_ms": "fwd_ms + bwd_ms (sum of the medians; not timed jointly)",
            "full_layer_ms": "2 * fwd_ms + bwd_ms (activation checkpointing re-runs the forward)",
            "fwd_tflops": "6*T*k*H*I / fwd_ms, T = tokens per rank",
            "pct_of_peak": "100 * fwd_tflops / gemm_peak_tflops",
            "gemm_peak": f"median of 10 bf16 torch.matmul {GEMM_PEAK_SIZE}^3 after 3 warm-up calls "
                         "(~15 ms: boost clock; slowest rank under EP)",
            "pct_of_sustained_peak": "100 * fwd_tflops / gemm_peak_sustained_tflops (precision "
                                     "fp8: / fp8_peak_sustained_tflops)",
            "fp8_peak": f"as gemm_peak with e4m3 torch._scaled_mm {GEMM_PEAK_SIZE}^3 (per-tensor "
                        "scales, bf16 out)",
            "gemm_peak_sustained": f"median bf16 torch.matmul {GEMM_PEAK_SIZE}^3 over the second "
                                   "half of sustained_peak_seconds of back-to-back calls (at the "
                                   "power cap; slowest rank under EP)",
            "sm_mhz": "mean SM clock (MHz) nvidia-smi reported every 50 ms during the row's timed "
                      "iterations, with power_w the mean board power (W); rank 0's GPU under EP; "
                      "null without nvidia-smi or for a row shorter than a sample",
            "ep": "each rank times its own events; the max over ranks of each median is reported",
        },
    }


def describe_device(run: RunContext) -> dict:
    if not run.is_cuda:
        return {"type": "cpu", "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(run.device)
    return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1)}


def describe_command(argv: list[str], launcher: str | None) -> str:
    """The command line that reproduces this run. When main() is called from Python (tests)
    the equivalent megamoe-bench command is written."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "bench.py":  # python -m megamoe.bench, torchrun -m megamoe.bench
        program = "-m megamoe.bench" if launcher else "python -m megamoe.bench"
    else:
        program = script if launcher else "megamoe-bench"  # torchrun takes the script's path
    return " ".join(part for part in (launcher, program, shlex.join(argv)) if part)


def git_commit() -> str:
    """HEAD of the git checkout holding this file, "-dirty" if tracked files changed.
    MEGAMOE_BENCH_COMMIT overrides it, for a copied tree without .git."""
    if os.environ.get("MEGAMOE_BENCH_COMMIT"):
        return os.environ["MEGAMOE_BENCH_COMMIT"]
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        changes = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if changes.strip() else "")


# ---------------------------------------------------------------- output


TABLE_COLUMNS = (
    ("model", "model", str), ("tokens/rank", "tokens_per_rank", str), ("ep", "ep", str),
    ("backend", "backend", str), ("bwd mode", "backward_mode", str),
    ("precision", "precision", str), ("routing", "routing", str),
    ("fwd ms", "fwd_ms", "{:.3f}"), ("bwd ms", "bwd_ms", "{:.3f}"),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.3f}"), ("full layer ms", "full_layer_ms", "{:.3f}"),
    ("fwd TFLOP/s", "fwd_tflops", "{:.3g}"), ("% peak", "pct_of_peak", "{:.1f}"),
    ("% sust.", "pct_of_sustained_peak", "{:.1f}"),
    ("fwd x torch", "speedup_fwd_vs_torch", "{:.2f}"),
    ("full x torch", "speedup_full_vs_torch", "{:.2f}"),
    ("fwd x bf16", "speedup_fwd_vs_bf16", "{:.2f}"),
    ("bwd x bf16", "speedup_bwd_vs_bf16", "{:.2f}"),
    ("SM MHz", "sm_mhz", "{:.0f}"),
    ("status", "status", str),
)


def format_table(rows: list[dict]) -> str:
    def cell(row, key, fmt):
        value = row[key]
        if value is None:
            return "-"
        return fmt(value) if callable(fmt) else fmt.format(value)

    header = [title for title, _, _ in TABLE_COLUMNS]
    body = [[cell(row, key, fmt) for _, key, fmt in TABLE_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells):
        # The last column (status) is left unpadded: skip messages can be long.
        padded = [c.rjust(w) if i >= 7 else c.ljust(w) for i, (c, w) in enumerate(zip(cells[:-1], widths))]
        return "  ".join(padded + [cells[-1]])

    rule = "-" * (sum(widths[:-1]) + 2 * (len(widths) - 1) + len("status"))
    return "\n".join([line(header), rule, *(line(cells) for cells in body)])


def default_name(args, is_cuda: bool) -> str:
    tokens = "-".join(str(t) for t in args.tokens)
    name = f"{'_'.join(args.model)}_t{tokens}_ep{args.ep}_{args.routing}"
    return name if is_cuda else f"cpu-{name}"


def write_outputs(results: dict, args) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or default_name(args, not results["cpu_smoke_run"])
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {json_path}", file=sys.stderr)
    if args.no_plot:
        return
    from megamoe._plot import plot_results

    png_path = plot_results(results, out_dir / f"{stem}.png")
    if png_path is not None:
        print(f"wrote {png_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
