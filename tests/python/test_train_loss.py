"""The chunked LM head + cross-entropy against the plain one, in float64."""

import pytest
import torch

from megamoe.train.loss import IGNORE_INDEX, chunked_linear_cross_entropy
from moe_testing import BASE_SEED, rel_err


def _plain(hidden, weight, labels):
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                             reduction="sum")


@pytest.mark.parametrize("tokens, chunk", [(37, 8), (64, 64), (50, 1000), (1, 4)])
def test_chunked_matches_plain_fp64(tokens, chunk):
    generator = torch.Generator().manual_seed(BASE_SEED + tokens)
    H, V = 24, 97
    hidden = torch.randn(tokens, H, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, V, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < 0.2] = IGNORE_INDEX  # some ignored rows
    scale = torch.rand((), dtype=torch.float64, generator=generator) + 0.5

    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    (loss * scale).backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected = _plain(hidden, weight, labels)
    (expected * scale).backward()

    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected.item()) <= 1e-12 * max(1.0, abs(expected.item()))
    assert rel_err(dh, hidden.grad) < 1e-12
    assert rel_err(dw, weight.grad) < 1e-12
    ignored = labels == IGNORE_INDEX
    assert torch.equal(dh[ignored], torch.zeros_like(dh[ignored]))


def test_chunked_bf16_close_to_fp64():
    generator = torch.Generator().manual_seed(BASE_SEED + 1)
    hidden = torch.randn(70, 32, generator=generator)
    weight = torch.randn(300, 32, generator=generator) * 0.2
    labels = torch.randint(0, 300, (70,), generator=generator)
    h16 = hidden.bfloat16().requires_grad_()
    w16 = weight.bfloat16().requires_grad_()
    loss = chunked_linear_cross_entropy(h16, w16, labels, chunk_size=16)
    loss.backward()
    h64 = h16.detach().double().requires_grad_()
    w64 = w16.detach().double().requires_grad_()
    expected = _plain(h64, w64, labels)
    expected.backward()
    assert loss.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    assert abs(loss.item() - expected.item()) < 1e-2 * abs(expected.item())
    assert rel_err(h16.grad, h64.grad) < 2e-2
    assert rel_err(w16.grad, w64.grad) < 2e-2


def test_chunked_checks_shapes():
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 7), torch.zeros(4, dtype=torch.long))
