"""megamoe.MoE: router semantics and parameters in the Hugging Face layout."""

import pytest
import torch

import megamoe
from megamoe import reference
from moe_testing import BASE_SEED, rel_err


def test_route_matches_qwen3_semantics():
    torch.manual_seed(BASE_SEED)
    logits = torch.randn(10, 8)
    ids, weights = megamoe.route(logits, 3, norm_topk_prob=True)
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.topk(3, dim=-1).indices
    assert torch.equal(ids, expected_ids)
    top = probs.gather(1, expected_ids)
    assert rel_err(weights, top / top.sum(1, keepdim=True)) < 1e-6
    _, raw = megamoe.route(logits, 3, norm_topk_prob=False)
    assert rel_err(raw, top) < 1e-6


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_module_forward_backward(backend):
    torch.manual_seed(BASE_SEED + 1)
    layer = megamoe.MoE(32, 16, num_experts=8, top_k=2, backend=backend)
    assert layer.w_gate_up.shape == (8, 32, 32) and layer.w_down.shape == (8, 32, 16)
    hidden = torch.randn(2, 5, 32, requires_grad=True)
    out = layer(hidden)
    assert out.shape == hidden.shape
    x = hidden.detach().reshape(-1, 32)
    ids, weights = megamoe.route(layer.gate(x), 2, True)
    expected = reference.forward(x, ids, weights.detach(), layer.w_gate_up.detach(), layer.w_down.detach())
    assert rel_err(out.detach().reshape(-1, 32), expected) < 1e-5
    out.square().sum().backward()
    for param in (layer.w_gate_up, layer.w_down, layer.gate.weight):
        assert param.grad is not None and torch.isfinite(param.grad).all()
    assert hidden.grad is not None


def test_module_rejects_bad_configuration():
    with pytest.raises(megamoe.MegaMoEError, match="top_k"):
        megamoe.MoE(32, 16, num_experts=4, top_k=5)
    with pytest.raises(megamoe.MegaMoEError, match="backend"):
        megamoe.MoE(32, 16, num_experts=4, top_k=2, backend="nope")
