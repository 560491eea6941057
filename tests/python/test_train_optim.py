"""The LR schedule and the global gradient-norm clipping."""

import math

import pytest
import torch

from megamoe.train.optim import clip_grad_norm, warmup_decay
from moe_testing import BASE_SEED


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_then_decay(decay):
    f = [warmup_decay(s, warmup=4, total=12, decay=decay, min_ratio=0.1) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    if decay == "constant":
        assert f[4:] == [1.0] * 10
        return
    assert all(a >= b for a, b in zip(f[3:], f[4:]))  # never rises after warm-up
    assert f[11] == pytest.approx(0.1) and f[13] == pytest.approx(0.1)  # ends at min_ratio
    middle = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * 4 / 8)) if decay == "cosine" else 0.5)
    assert f[7] == pytest.approx(middle)


def test_clip_grad_norm_matches_torch():
    generator = torch.Generator().manual_seed(BASE_SEED)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=generator)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 3
    expected = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1.0)
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
    for copy, g in zip(copies, expected):
        copy.grad = g.clone()
    reference = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert norm.item() == pytest.approx(reference.item(), rel=1e-6)
    total = torch.cat([p.grad.flatten() for p in params]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-5)
    # max_norm = 0 measures and leaves the gradients alone.
    before = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, 0.0).item() == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
