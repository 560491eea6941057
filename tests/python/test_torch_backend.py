"""The TorchTitan-style baseline against the reference math, on the CPU (float32)."""

import math

import pytest
import torch

import megamoe
from megamoe import reference
from moe_testing import (DP_NOISE, chi2_upper_quantile, dp_error_and_bound, dp_noise_bound,
                         dp_term_norms, make_problem, rel_err, run_with_grads)

NAMES = ("x", "topk_weights", "w_gate_up", "w_down")


def _check_against_reference(p, tol):
    y, grads = run_with_grads(megamoe.moe, p, backend="torch")
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    y_ref = reference.forward(*args)
    refs = dict(zip(NAMES, reference.backward(p["dy"], *args)))
    assert rel_err(y, y_ref) < tol
    for name in ("x", "w_gate_up", "w_down"):
        assert rel_err(grads[name], refs[name]) < tol, name
    # d topk_weights is one dot product per slot, which can cancel (one slot of T = 1 did,
    # to 1.3e-5 relative in fp32): its error is measured against the size of the terms it
    # adds up, ||z * a|| (dp_term_norms), which fp32 rounding scales with.
    # A draw can leave no valid slot at all (T = 1, k = 1 with 15% of slots dropped).
    valid = p["topk_ids"] >= 0
    scale = dp_term_norms(p)[valid]
    err = (grads["topk_weights"].double() - refs["topk_weights"].double())[valid].abs() / scale
    assert err.numel() == 0 or err.max() < tol, ("topk_weights", err.max().item())
    return grads


@pytest.mark.parametrize("T,H,I,E,k", [(1, 16, 8, 4, 1), (7, 32, 16, 8, 2), (130, 64, 32, 8, 4)])
def test_torch_backend_matches_reference(T, H, I, E, k):
    p = make_problem(T, H, I, E, k, seed=T + 1000, invalid_fraction=0.15, skip_experts=(3,))
    grads = _check_against_reference(p, 1e-5)
    assert torch.all(grads["topk_weights"][p["topk_ids"] == -1] == 0)
    assert torch.all(grads["w_down"][3] == 0)


def test_torch_backend_all_tokens_on_one_expert():
    _check_against_reference(make_problem(40, 16, 8, 4, 3, seed=7, one_expert=1), 1e-5)


def test_torch_backend_bf16_cpu():
    p = make_problem(64, 32, 16, 8, 2, dtype=torch.bfloat16, seed=11)
    y, _ = run_with_grads(megamoe.moe, p, backend="torch")
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference.forward(*args)) < 1e-2


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_compiles_fullgraph(backend):
    # torch._grouped_mm's meta kernel (used while tracing) takes bf16 only.
    dtype = torch.bfloat16 if backend == "torch" else torch.float32
    p = make_problem(16, 16, 8, 4, 2, dtype=dtype, seed=21, invalid_fraction=0.1)
    eager_y, eager_grads = run_with_grads(megamoe.moe, p, backend=backend)
    compiled = torch.compile(megamoe.moe, fullgraph=True, backend="aot_eager")
    y, grads = run_with_grads(compiled, p, backend=backend)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert rel_err(y, eager_y) < tol
    for name in NAMES:
        assert rel_err(grads[name], eager_grads[name]) < tol, name


def test_chi2_quantile_and_dp_noise_bound():
    # Two degrees of freedom have the closed form P(chi^2_2 > x) = exp(-x / 2).
    assert chi2_upper_quantile(2, 1e-6) == pytest.approx(-2 * math.log(1e-6), rel=1e-9)
    assert chi2_upper_quantile(1, 1e-6) == pytest.approx(23.928, rel=1e-4)
    bounds = [dp_noise_bound(n) for n in range(1, 64)]
    assert bounds[0] == pytest.approx(DP_NOISE * 23.928 ** 0.5, rel=1e-4)
    assert all(a >= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] == 1e-2


@pytest.mark.parametrize("T,k", [(1, 1), (7, 2)])
def test_few_slot_dp_check_on_bf16_torch_backend(T, k):
    """The GPU tests' few-slot d topk_weights check (test_gpu's awkward shapes) on the torch
    baseline's bf16 math on the CPU, which rounds where CUDA does (fp32-accumulated GEMMs
    rounded once to bf16, each elementwise op rounded once). Every draw passes; the same
    gradient with one slot off by a tenth of its term scale (a bug's size) fails."""
    draws = 16
    for s in range(draws):
        p = make_problem(T, 256, 128, 64, k, dtype=torch.bfloat16, seed=7919 * s + T,
                         invalid_fraction=0.1)
        valid = (p["topk_ids"] >= 0).nonzero().tolist()
        if not valid:
            continue
        args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
        _, grads = run_with_grads(megamoe.moe, p, backend="torch")
        ref = reference.backward(p["dy"], *args)[1]
        dp = grads["topk_weights"]
        err, bound = dp_error_and_bound(dp, ref, p)
        assert err < bound, (s, err, bound)
        t, j = valid[s % len(valid)]
        wrong = dp.clone()
        wrong[t, j] += 0.1 * dp_term_norms(p)[t, j].item()
        err, bound = dp_error_and_bound(wrong, ref, p)
        assert err > bound, (s, err, bound)
        wrong = dp.clone()
        wrong[p["topk_ids"] < 0] = 1e-6  # a -1 slot must get exactly 0
        if bool((p["topk_ids"] < 0).any()):
            assert dp_error_and_bound(wrong, ref, p)[0] == math.inf
