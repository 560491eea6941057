"""Runs the fused layer (forward and backward) several times on the same inputs and compares
every output bit for bit with the first run, with the caching allocator's free memory
filled with NaN between runs: a difference is a race or a read of memory that no kernel
wrote. Prints the largest relative difference of each output that differs.

    MEGAMOE_LIBRARY=build/libmegamoe.so python3 tools/repeat_check.py [--preset 235b --tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from moe_testing import make_problem, run_with_grads  # noqa: E402

import megamoe  # noqa: E402

PRESETS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}


def poison_free_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    block = torch.empty(int(free * 0.8) // 2, dtype=torch.bfloat16, device="cuda")
    block.fill_(float("nan"))
    del block  # back to the caching allocator, NaN-filled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="235b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--mode", default="recompute", choices=("recompute", "saved"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    H, I, E, k = PRESETS[args.preset]
    problem = make_problem(args.tokens, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=1)
    first = None
    differ = 0
    for run in range(args.runs):
        if run:
            poison_free_memory()
        y, grads = run_with_grads(megamoe.moe, problem, backend="fused", backward_mode=args.mode)
        outs = {"y": y, **{f"d{n}": g for n, g in grads.items()}}
        if first is None:
            first = {n: t.clone() for n, t in outs.items()}
            continue
        for name, t in outs.items():
            if not torch.equal(t, first[name]):
                differ += 1
                ref = first[name].float()
                rel = ((t.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                nan = bool(torch.isnan(t).any())
                print(f"run {run}: {name} differs, max |diff| / max |ref| = {rel:.2e}"
                      f"{', has NaN' if nan else ''}")
    print(f"{args.preset} T={args.tokens} {args.mode}: {args.runs} runs, "
          f"{'all bitwise equal' if not differ else f'{differ} outputs differ'}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
