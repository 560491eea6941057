"""Test helpers: fresh random problems and error measures (DESIGN.md section 6)."""

from __future__ import annotations

import os
import random

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


# Below this many slots, d topk_weights is checked slot by slot against the size of its
# terms (see dp_term_norms) instead of by its Frobenius norm.
FEW_SLOTS = 64


def dp_term_norms(p):
    """Per slot, ||z * a|| with z = w_down^T dy and a = silu(g) u in float64: the scale of
    the terms that d topk_weights = sum_i z_i a_i adds up. With bf16 h (as in every bf16
    implementation, the torch baseline included) the error of that sum is ~3e-3 of this
    scale, while the sum itself can cancel to far less: for a single slot the Frobenius
    relative error then exceeds 1e-2 in about a quarter of random draws (measured, see
    PERFLOG), which says nothing about the kernels."""
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


def dp_error_by_term_scale(dp, ref_dp, p) -> float:
    """The largest per-slot error of d topk_weights, relative to that slot's term scale."""
    return ((dp.double() - ref_dp.double()).abs() / dp_term_norms(p).clamp_min(1e-30)).max().item()


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
