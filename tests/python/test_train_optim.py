"""The LR schedule and the global gradient-norm clipping."""

import math

import pytest
import torch

from megamoe.train.optim import clip_and_step, clip_grad_norm, warmup_decay
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


def _adamw_steps(implementation, max_norm, clip_in_step, steps=3):
    """Parameters after `steps` AdamW steps on fixed gradients, clipped either by
    clip_and_step or by clip_grad_norm followed by a plain step; and the grad_scale values
    the optimizer saw in its steps."""
    generator = torch.Generator().manual_seed(BASE_SEED + 5)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator))
              for shape in [(40, 30), (7,), (3, 5, 2)]]
    grads = [torch.randn(p.shape, generator=generator) * 2 for p in params]
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}}[implementation]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags)
    seen, step = [], optimizer.step

    def recording_step(*args, **kwargs):
        seen.append(getattr(optimizer, "grad_scale", None))
        return step(*args, **kwargs)

    optimizer.step = recording_step
    norms = []
    for i in range(steps):
        for p, g in zip(params, grads):
            p.grad = g * (i + 1)
        if clip_in_step:
            norms.append(clip_and_step(optimizer, params, max_norm))
        else:
            norms.append(clip_grad_norm(params, max_norm))
            optimizer.step()
    assert getattr(optimizer, "grad_scale", None) is None  # nothing left for a later step
    return [p.detach() for p in params], norms, seen


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
@pytest.mark.parametrize("max_norm", [1.0, 1e6, 0.0], ids=["clipping", "below-max", "off"])
def test_clip_and_step_equals_clip_then_step(implementation, max_norm):
    got, got_norms, seen = _adamw_steps(implementation, max_norm, clip_in_step=True)
    want, want_norms, _ = _adamw_steps(implementation, max_norm, clip_in_step=False)
    assert [n.item() for n in got_norms] == [n.item() for n in want_norms]
    folded = implementation == "fused" and max_norm > 0
    # The fused kernel got the clip as grad_scale = 1 / coefficient; the others a plain step.
    assert all((s is not None) == folded for s in seen)
    if folded and max_norm == 1.0:
        assert [s.item() for s in seen] == pytest.approx([n.item() + 1e-6 for n in want_norms])
        # Dividing by the reciprocal instead of multiplying: equal to fp32 rounding.
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    else:  # no clipping happens (or a coefficient of exactly 1): bitwise
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # The clip matters at max_norm = 1 (the norms are ~20), so the check above can fail.
    unclipped, _, _ = _adamw_steps(implementation, 0.0, clip_in_step=False)
    differs = any(not torch.allclose(a, b, rtol=1e-4) for a, b in zip(got, unclipped))
    assert differs == (max_norm == 1.0)
