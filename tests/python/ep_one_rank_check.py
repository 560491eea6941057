"""The fused EP ops through Python on one GPU: a group of one rank (torchrun
--nproc-per-node 1), a megamoe.Buffer, and the layer called through the EP op directly
(megamoe.moe runs a one-rank group without a buffer), at each precision and backward mode,
against the one-GPU fused layer at the same precision: d topk_weights and the weight
gradients bit for bit, y and dx within one bf16 rounding of the owner's partial sum. At
each precision also: the saved mode with fp32 weight-gradient accumulators (added to zeros,
they round to the one-GPU layer's bf16 gradients; the weights get no .grad), and the EP op
under torch.compile(fullgraph=True) bit for bit the eager EP op.

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


def _accumulators_case(p, buf, precision) -> bool:
    """Saved mode with zeroed fp32 accumulators: each rounds once to the one-GPU layer's bf16
    weight gradient, the weights get no .grad, and dx and d topk_weights are unchanged."""
    _, g1 = run_with_grads(megamoe.moe, p, backend="fused", precision=precision)
    accs = tuple(torch.zeros(p[n].shape, dtype=torch.float32, device=p[n].device)
                 for n in ("w_gate_up", "w_down"))
    _, ga = run_with_grads(lambda *a: fused_ep_moe(*a[:5], buf, "saved", accs, precision), p)
    torch.cuda.synchronize()
    buf.check()
    _, ge = run_with_grads(lambda *a: fused_ep_moe(*a[:5], buf, "recompute", None, precision), p)
    torch.cuda.synchronize()
    checks = {
        "no .grad": ga["w_gate_up"] is None and ga["w_down"] is None,
        "fp32 rounds to one GPU": all(torch.equal(acc.to(torch.bfloat16), g1[n])
                                      for acc, n in zip(accs, ("w_gate_up", "w_down"))),
        "dx, dp as recompute": all(torch.equal(ga[n], ge[n]) for n in ("x", "topk_weights")),
    }
    case_ok = all(checks.values())
    print(f"{precision:8s} saved + fp32 accumulators {checks} {'ok' if case_ok else 'FAILED'}",
          flush=True)
    return case_ok


def _compile_case(p, buf, precision) -> bool:
    """The EP op compiled with fullgraph=True: y and every gradient bit for bit the eager
    op's (the compiled graph quantizes the weights afresh, with the cache's bits)."""
    def layer(*a):
        return fused_ep_moe(*a[:5], buf, "recompute", None, precision)

    y0, g0 = run_with_grads(layer, p)
    try:
        y, g = run_with_grads(torch.compile(layer, fullgraph=True), p)
        torch.cuda.synchronize()
        buf.check()
        same = {"y": bool(torch.equal(y, y0))}
        same.update({n: bool(torch.equal(g[n], g0[n])) for n in g0})
    except Exception as e:  # reported as this case's failure, with the others still run
        print(f"{precision:8s} torch.compile FAILED: {type(e).__name__}: {e}", flush=True)
        return False
    case_ok = all(same.values())
    print(f"{precision:8s} torch.compile bitwise {same} {'ok' if case_ok else 'FAILED'}",
          flush=True)
    return case_ok


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
        ok = _accumulators_case(p, buf, precision) and ok
        ok = _compile_case(p, buf, precision) and ok
    buf.close()
    dist.destroy_process_group()
    print("EP one-rank check:", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
