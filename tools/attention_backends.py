"""Times PyTorch's scaled_dot_product_attention backends on a training step's attention:
causal, bf16, GQA as transformers' "sdpa" calls it (enable_gqa=True, no mask), forward and
forward + backward, so that the trainer's attention can run on the fastest one.

    python3 tools/attention_backends.py [--tokens 16384 --heads 32 --kv-heads 4 --head-dim 128]

Prints one line per backend: median ms of forward and of forward + backward, the TFLOP/s of
the latter (causal attention: 2 * 2 * T^2 * heads * head_dim / 2 forward, 2.5x that
backward), and whether the backend gives the same output as the flash backend. With
--repeat-check, each backend's forward and backward also run three times on the same inputs,
with and without torch.use_deterministic_algorithms(True), and the line says whether the
output and the gradients (dq, dk, dv) repeat bit for bit.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _time(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _repeats(forward, inputs, dout, deterministic: bool) -> str:
    """Whether three forward + backward runs give bitwise-equal outputs and gradients."""
    previous = torch.are_deterministic_algorithms_enabled()
    # Not warn_only: PyTorch's flash and cuDNN backwards take their deterministic algorithm
    # only when nondeterminism would be an error (with warn_only they warn and stay atomic).
    torch.use_deterministic_algorithms(deterministic)
    try:
        runs = []
        for _ in range(3):
            out = forward()
            grads = torch.autograd.grad(out, inputs, dout)
            runs.append((out.detach(), *grads))
    except RuntimeError as error:
        return f"deterministic={deterministic}: failed: {str(error).splitlines()[0][:100]}"
    finally:
        torch.use_deterministic_algorithms(previous)
    names = ("out", "dq", "dk", "dv")
    same = [all(torch.equal(r[i], runs[0][i]) for r in runs[1:]) for i in range(4)]
    return f"deterministic={deterministic}: repeats bitwise: " + ", ".join(
        f"{n} {'yes' if s else 'NO'}" for n, s in zip(names, same))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat-check", action="store_true")
    args = parser.parse_args()
    T, Hq, Hkv, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd_flops = 2 * 2 * T * T * Hq * D / 2
    reference = None
    print(f"causal attention, T={T}, heads {Hq} (kv {Hkv}), head_dim {D}, bf16, enable_gqa")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        def forward():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def forward_backward():
            out = forward()
            out.backward(dout)
            q.grad = k.grad = v.grad = None

        try:
            out = forward().detach()
            fwd = _time(forward, args.iters, args.warmup)
            both = _time(forward_backward, args.iters, args.warmup)
        except RuntimeError as error:
            print(f"{backend.name:22s} not available: {str(error).splitlines()[0][:120]}")
            continue
        if reference is None:
            reference = out
        diff = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        print(f"{backend.name:22s} fwd {fwd:7.2f} ms  fwd+bwd {both:7.2f} ms  "
              f"{3.5 * fwd_flops / both / 1e9:6.0f} TFLOP/s  rel. diff to first {diff:.1e}")
        if args.repeat_check:
            for deterministic in (False, True):
                print(f"{'':22s} {_repeats(forward, (q, k, v), dout, deterministic)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
