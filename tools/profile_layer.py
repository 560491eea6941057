"""Per-kernel GPU time of one layer call, from torch.profiler (CUDA activity): the forward,
or with --backward the forward and backward of a training step.

    python tools/profile_layer.py --backend fused --model qwen3-30b-a3b --tokens 16384
    python tools/profile_layer.py --backward --backward-mode saved
    python tools/profile_layer.py --precision fp8 --model qwen3-235b-a22b
    ncu --profile-from-start off --set full python tools/profile_layer.py --ncu ...  # one call
    python tools/profile_layer.py --precision fp8 --backward --timeline   # kernels in order
    torchrun --nproc-per-node 2 tools/profile_layer.py --ep 2 --backward   # rank 0's kernels
"""

import argparse
import os
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.presets import get_preset

from layer_inputs import layer_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--backward-mode", default="recompute", help="the fused backend's")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--ncu", action="store_true",
                        help="after the warm-up, one call between cudaProfilerStart and Stop "
                             "(for ncu --profile-from-start off) instead of torch.profiler")
    parser.add_argument("--timeline", action="store_true",
                        help="also print the last call's kernels in the order they ran, with "
                             "the idle time before each, and the host time per call")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks (run under torchrun --nproc-per-node EP)")
    parser.add_argument("--num-comm-sms", type=int, default=None,
                        help="with --ep: the Buffer's num_comm_sms (SMs of the copy kernels)")
    args = parser.parse_args()
    shape = get_preset(args.model)
    extra = {"backward_mode": args.backward_mode} if args.backend == "fused" else {}
    rank, experts = 0, shape.E
    if args.ep > 1:
        import torch.distributed as dist

        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        rank, experts = dist.get_rank(), shape.E // args.ep
        extra["group"] = dist.group.WORLD
        if args.backend == "fused":
            extra["buffer"] = megamoe.Buffer(dist.group.WORLD, args.tokens, shape.H, shape.I,
                                             shape.E, shape.k, num_comm_sms=args.num_comm_sms)
    x, ids, weights, w_gate_up, w_down, dy = layer_inputs(shape, args.tokens, experts, seed=rank,
                                                          requires_grad=args.backward)

    def forward():
        with torch.set_grad_enabled(args.backward):
            y = megamoe.moe(x, ids, weights, w_gate_up, w_down, backend=args.backend,
                            precision=args.precision, check_ids=False, **extra)
        if args.backward:
            y.backward(dy)
            for t in (x, weights, w_gate_up, w_down):
                t.grad = None

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    if args.ncu:
        torch.cuda.profiler.start()
        forward()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(args.iters):
            forward()
        host_ms = (time.perf_counter() - began) * 1e3 / args.iters
        torch.cuda.synchronize()
    if rank != 0:
        return
    what = f"forward + backward ({args.backward_mode})" if args.backward else "forward"
    print(f"{args.backend} {args.precision} {args.model} T={args.tokens} ep={args.ep} (rank 0): per-kernel time "
          f"per {what} (us)")
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = 0.0
    for e in rows:
        if e.device_time_total <= 0:
            continue
        per_call = e.device_time_total / args.iters
        total += per_call
        print(f"  {per_call:9.1f}  x{e.count // args.iters:<3} {short_name(e.key)[:110]}")
    print(f"  {total:9.1f}  total")
    if args.timeline:
        print_timeline(prof, args.iters, host_ms)


def short_name(name: str) -> str:
    """A kernel's name without namespaces, and a grouped GEMM's as its grouping (M or K),
    mainloop, A loader, epilogue (an epilogue inside another after a slash) and tile width:
    their full names are too long to tell the GEMMs apart in a line."""
    name = re.sub(r"megamoe::|sm90::|\(anonymous namespace\)::|^void ", "", name)
    if name.startswith("grouped_gemm_kernel<"):
        grouping = re.search(r"\(Grouping\)(\d)", name)
        mainloop = re.search(r"(Mainloop\w+)[<,]", name)  # a template, or a plain struct
        loader = re.search(r"(A(?:Tma|Gathered\w*))<", name)
        # An epilogue's type appears again in its Params: each name once, in order.
        epilogues = list(dict.fromkeys(re.findall(r"(\w+Epilogue)<", name)))
        width = re.search(r"Epilogue<(\d+)", name)
        parts = ["grouped_gemm", "M" if grouping and grouping.group(1) == "0" else "K",
                 mainloop.group(1) if mainloop else "?", loader.group(1) if loader else "?",
                 ("/".join(epilogues) or "?") + (f"<{width.group(1)}>" if width else "")]
        return " ".join(parts)
    return name


def print_timeline(prof, iters: int, host_ms: float):
    """The last call's kernels in start order: start (us from the call's first kernel),
    duration, and the idle GPU time since the previous kernel ended. Where the host takes
    longer per call than the GPU, the GPU waits for launches; the host time printed is that
    of the profiled loop, without a synchronization per call."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time_total > 0), key=lambda e: e.time_range.start)
    per_call = len(kernels) // iters
    last = kernels[-per_call:]
    t0 = last[0].time_range.start
    print(f"last call: {per_call} kernels, GPU span {(last[-1].time_range.end - t0):.1f} us, "
          f"busy {sum(e.time_range.elapsed_us() for e in last):.1f} us; host "
          f"{host_ms * 1e3:.1f} us per call")
    print("   start us      us   idle us  kernel")
    end = t0
    for e in last:
        idle = e.time_range.start - end
        print(f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():7.1f} {idle:8.1f}  "
              f"{short_name(e.name)[:90]}")
        end = max(end, e.time_range.end)


if __name__ == "__main__":
    main()
