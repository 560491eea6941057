"""Test helpers: fresh random problems and error measures (docs/design.md, "Correctness")."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

# Fresh inputs on every run; set MEGAMOE_TEST_SEED to replay a failure.
BASE_SEED = int(os.environ.get("MEGAMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# Shapes that break kernels, for the fused forward and backward tests (T, H, I, E, k, and
# make_problem's routing arguments).
FUSED_CASES = [  # T, H, I, E, k, extra
    (1, 256, 128, 8, 1, {}),
    (7, 256, 128, 8, 2, dict(invalid_fraction=0.2)),
    (128, 512, 256, 64, 8, {}),
    (4097, 256, 128, 128, 8, dict(invalid_fraction=0.05, skip_experts=(3, 9))),
    (16384, 256, 128, 64, 2, {}),
    (300, 384, 256, 16, 4, dict(one_expert=5)),  # all tokens on one expert
    (1000, 256, 384, 8, 1, dict(skip_experts=(0, 1, 2, 3, 4, 5))),  # skewed, I = 3 * 128
    (257, 128, 128, 512, 16, dict(invalid_fraction=0.1)),  # the limits: k = 16, E = 512
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64; NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


# Below this many slots, d topk_weights is checked against the scale of its terms (see
# dp_error_and_bound) instead of by its own Frobenius norm.
FEW_SLOTS = 64

# d topk_weights_j = <dy_t, o_j> = sum_i z_i a_i (z = w_down^T dy, a = silu(gate) * up) is
# one dot product per slot, so it can cancel to far below its terms, while the error that
# bf16 rounding leaves in it does not cancel: every rounding on the way (gate and up of h,
# silu, a, o in the torch baseline) adds noise of about BF16_RMS_ROUNDING * ||z * a||.
# BF16_RMS_ROUNDING is the RMS relative error of rounding to 8 significant bits, for
# significands m spread log-uniformly over [1, 2): 2^-7 / sqrt(12) * sqrt(E[1/m^2]).
BF16_RMS_ROUNDING = 2.0 ** -7 / 12 ** 0.5 * (0.375 / math.log(2)) ** 0.5  # 1.66e-3
# The standard deviation of (dp_j - ref_j) / ||z * a|| for a bf16 implementation: five
# roundings, whose variances weigh 1 each except the gate's (times (silu' g / silu)^2, about
# 1.4) and o's (times ||dy * o||^2 / ||z * a||^2, about 1.3), give BF16_RMS_ROUNDING *
# sqrt(5.6) = 3.9e-3 at the median slot and about 4.5e-3 at the 99th percentile; this is
# the latter (tools/dp_noise.py measures both). The fused kernels round fewer times.
DP_NOISE = 4.5e-3
# The chance that bf16 noise alone fails one few-slot d topk_weights check.
DP_FALSE_FAILURE = 1e-6


def dp_term_norms(p):
    """Per slot, ||z * a|| with z = w_down^T dy and a = silu(g) u in float64: the scale of
    the terms that d topk_weights = sum_i z_i a_i adds up, and of its bf16 rounding error."""
    x, ids, w1, w2, dy = (p[n].double() if p[n].is_floating_point() else p[n]
                          for n in ("x", "topk_ids", "w_gate_up", "w_down", "dy"))
    I = w2.shape[2]
    norms = torch.zeros(ids.shape, dtype=torch.float64, device=x.device)
    for t, j in (ids >= 0).nonzero().tolist():
        e = int(ids[t, j])
        h = w1[e] @ x[t]
        a = torch.nn.functional.silu(h[:I]) * h[I:]
        norms[t, j] = ((dy[t] @ w2[e]) * a).norm()
    return norms


def chi2_upper_quantile(dof: int, tail: float) -> float:
    """x with P(chi^2_dof > x) = tail, by bisection on the regularized upper gamma."""
    half_dof = torch.tensor(dof / 2, dtype=torch.float64)
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(half_dof, torch.tensor(mid / 2, dtype=torch.float64)) > tail:
            lo = mid
        else:
            hi = mid
    return hi


def dp_noise_bound(slots: int) -> float:
    """The bound of dp_error_and_bound's error over `slots` valid slots: the usual 1e-2, or
    the level that the RMS of `slots` Gaussian draws of standard deviation DP_NOISE exceeds
    with probability DP_FALSE_FAILURE, whichever is larger (a handful of slots average out
    little of the noise: 2.2e-2 for one slot, 1e-2 from about ten)."""
    return max(1e-2, DP_NOISE * (chi2_upper_quantile(slots, DP_FALSE_FAILURE) / slots) ** 0.5)


def dp_error_and_bound(dp, ref_dp, p) -> tuple[float, float]:
    """The error of d topk_weights and the bound it must stay under.

    Many slots: the Frobenius relative error, bound 1e-2. Fewer than FEW_SLOTS: the RMS over
    the valid slots of (dp_j - ref_j) / ||z * a||_j (dp_term_norms: what |ref_j| is in
    expectation, but it cannot cancel), against dp_noise_bound; a -1 slot must be exactly 0.
    A wrong slot shows as an error of at least about 1 / sqrt(slots), bf16 noise as about
    DP_NOISE."""
    if p["topk_ids"].numel() >= FEW_SLOTS:
        return rel_err(dp, ref_dp), 1e-2
    valid = p["topk_ids"] >= 0
    err = dp.double() - ref_dp.double()
    if not torch.isfinite(err).all() or bool((err[~valid] != 0).any()):
        return float("inf"), 1e-2
    slots = int(valid.sum())
    if slots == 0:
        return 0.0, 1e-2
    scaled = err[valid] / dp_term_norms(p)[valid].clamp_min(1e-30)
    return (scaled.square().mean().sqrt().item()), dp_noise_bound(slots)


def make_problem(T, H, I, E, k, *, dtype=torch.float32, device="cpu", seed=0,
                 invalid_fraction=0.0, skip_experts=(), one_expert=None, ids_dtype=torch.int64):
    """Random inputs with distinct experts per token; some slots -1; some experts unused.

    Drawn on `device` from one seeded generator, so every rank of a multi-GPU test can draw
    the same global problem."""
    g = torch.Generator(device=device).manual_seed(BASE_SEED + seed)
    rand = dict(generator=g, device=device)
    allowed = torch.tensor([e for e in range(E) if e not in set(skip_experts)], device=device)
    if one_expert is not None:
        ids = torch.full((T, k), -1, dtype=torch.int64, device=device)
        ids[:, 0] = one_expert
    else:
        ids = allowed[torch.topk(torch.rand(T, len(allowed), **rand), k, dim=1).indices]
    if invalid_fraction > 0:
        ids[torch.rand(T, k, **rand) < invalid_fraction] = -1
    weights = torch.softmax(torch.randn(T, k, **rand), dim=1)
    w_gate_up = torch.randn(E, 2 * I, H, **rand) / H ** 0.5
    w_down = torch.randn(E, H, I, **rand) / I ** 0.5
    return dict(x=torch.randn(T, H, **rand).to(dtype), topk_ids=ids.to(ids_dtype),
                topk_weights=weights, w_gate_up=w_gate_up.to(dtype), w_down=w_down.to(dtype),
                dy=torch.randn(T, H, **rand).to(dtype))


def run_with_grads(fn, problem, **kwargs):
    """y and the gradients of <dy, y> for x, topk_weights, w_gate_up, w_down."""
    leaves = {name: problem[name].detach().clone().requires_grad_(True)
              for name in ("x", "topk_weights", "w_gate_up", "w_down")}
    y = fn(leaves["x"], problem["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
           leaves["w_down"], **kwargs)
    y.backward(problem["dy"])
    return y.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def leave(passed: bool) -> None:
    """Ends a torchrun check's process now, exit code 0 if `passed`, with nothing but its
    output flushed: the interpreter's teardown can abort after every case has passed (gloo's
    worker threads freeing the tensors they hold) or wait on a process group with a dead
    member."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if passed else 1)
