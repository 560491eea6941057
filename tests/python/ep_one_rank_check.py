"""The fused EP ops through Python on one GPU: a group of one rank (torchrun
--nproc-per-node 1), a megamoe.Buffer, and the layer called through the EP op directly
(megamoe.moe runs a one-rank group without a buffer), at each precision and backward mode,
against the one-GPU fused layer at the same precision: d topk_weights and the weight
gradients bit for bit, y and dx within one bf16 rounding of the owner's partial sum.

    torchrun --nproc-per-node 1 tests/python/ep_one_rank_check.py

Prints one line per case and "EP one-rank check: PASSED" or "FAILED".
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megamoe  # noqa: E402
from megamoe._ep_op import fused_ep_moe  # noqa: E402
from moe_testing import make_problem, rel_err, run_with_grads  # noqa: E402

TOLERANCE = 5e-3  # y and dx: the owner's bf16 partial sum


def main() -> int:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    ok = True
    T, H, I, E, k = 300, 256, 256, 8, 4
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device=device, seed=7,
                     invalid_fraction=0.05)
    buf = megamoe.Buffer(group, T, H, I, E, k)
    for precision in ("bf16", "fp8", "fp8_bwd"):
        for mode in ("recompute", "saved"):
            y1, g1 = run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                                    backward_mode=mode)
            y, g = run_with_grads(lambda *a, **kw: fused_ep_moe(*a[:5], buf, mode, None,
                                                                 precision), p)
            torch.cuda.synchronize()
            buf.check()
            errs = {"y": rel_err(y, y1), "x": rel_err(g["x"], g1["x"])}
            same = {n: bool(torch.equal(g[n], g1[n]))
                    for n in ("topk_weights", "w_gate_up", "w_down")}
            case_ok = all(e < TOLERANCE for e in errs.values()) and all(same.values())
            ok = ok and case_ok
            print(f"{precision:8s} {mode:9s} y {errs['y']:.2e} dx {errs['x']:.2e} "
                  f"bitwise {same} {'ok' if case_ok else 'FAILED'}", flush=True)
    buf.close()
    dist.destroy_process_group()
    print("EP one-rank check:", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
