"""Per-kernel GPU time of one layer call, from torch.profiler (CUDA activity): the forward,
or with --backward the forward and backward of a training step.

    python tools/profile_layer.py --backend fused --model qwen3-30b-a3b --tokens 16384
    python tools/profile_layer.py --backward --backward-mode saved
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.presets import get_preset
from megamoe.routing import make_routing


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--backward-mode", default="recompute", help="the fused backend's")
    args = parser.parse_args()
    shape = get_preset(args.model)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, shape.H, device="cuda", dtype=torch.bfloat16, generator=g)
    w_gate_up = torch.randn(shape.E, 2 * shape.I, shape.H, device="cuda", dtype=torch.bfloat16,
                            generator=g) * shape.H ** -0.5
    w_down = torch.randn(shape.E, shape.H, shape.I, device="cuda", dtype=torch.bfloat16,
                         generator=g) * shape.I ** -0.5
    ids, weights = make_routing(args.tokens, shape.E, shape.k, "random", device="cuda", generator=g)

    extra = {"backward_mode": args.backward_mode} if args.backend == "fused" else {}
    dy = torch.randn_like(x)
    if args.backward:
        for t in (x, weights, w_gate_up, w_down):
            t.requires_grad_(True)

    def forward():
        with torch.set_grad_enabled(args.backward):
            y = megamoe.moe(x, ids, weights, w_gate_up, w_down, backend=args.backend,
                            check_ids=False, **extra)
        if args.backward:
            y.backward(dy)
            for t in (x, weights, w_gate_up, w_down):
                t.grad = None

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            forward()
        torch.cuda.synchronize()
    what = f"forward + backward ({args.backward_mode})" if args.backward else "forward"
    print(f"{args.backend} {args.model} T={args.tokens}: per-kernel time per {what} (us)")
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = 0.0
    for e in rows:
        if e.device_time_total <= 0:
            continue
        per_call = e.device_time_total / args.iters
        total += per_call
        print(f"  {per_call:9.1f}  x{e.count // args.iters:<3} {e.key[:110]}")
    print(f"  {total:9.1f}  total")


if __name__ == "__main__":
    main()
