"""How often the d topk_weights of a one-token, one-slot problem misses a 1e-2 relative
error against the float64 reference, for the torch and fused backends (40 draws each).
A single slot's gradient is one bf16-input dot product that can cancel; see PERFLOG.

    MEGAMOE_TEST_SEED=0 python tools/measure_single_slot_dp.py
"""
import sys

import torch

import megamoe
from megamoe import reference

sys.path.insert(0, "tests/python")
from moe_testing import make_problem, rel_err, run_with_grads  # noqa: E402
for backend in ("torch", "fused"):
    errs = []
    for seed in range(40):
        p = make_problem(1, 256, 128, 8, 1, dtype=torch.bfloat16, device="cuda",
                         seed=1000 + seed)
        _, g = run_with_grads(megamoe.moe, p, backend=backend)
        ref = reference.backward(p["dy"], p["x"], p["topk_ids"], p["topk_weights"],
                                 p["w_gate_up"], p["w_down"])
        errs.append(rel_err(g["topk_weights"], ref[1]))
    errs.sort()
    print(f"{backend} T=1 k=1 d topk_weights rel err over 40 draws: median {errs[20]:.2e}, "
          f"max {errs[-1]:.2e}, > 1e-2 in {sum(e > 1e-2 for e in errs)}")
