"""The fused custom ops' autograd wiring on meta tensors (no GPU needed): forward and
backward through the fake kernels in both backward modes, with and without fp32 weight
gradient accumulators. Catches schema mistakes the GPU tests would only see on a GPU (a
defaulted mutable argument makes torch 2.11's ADInplaceOrView step index past the
arguments it was given)."""

import pytest
import torch

from megamoe._fused_op import fused_moe

T, H, I, E, K = 8, 128, 128, 4, 2


def _leaf(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)


@pytest.mark.parametrize("mode", ["recompute", "saved"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_fused_autograd_on_meta(mode, accumulate):
    x, weights = _leaf(T, H), _leaf(T, K, dtype=torch.float32)
    w_gate_up, w_down = _leaf(E, 2 * I, H), _leaf(E, H, I)
    ids = torch.empty(T, K, dtype=torch.int32, device="meta")
    accs = (torch.empty(E, 2 * I, H, device="meta"), torch.empty(E, H, I, device="meta"))
    y = fused_moe(x, ids, weights, w_gate_up, w_down, backward_mode=mode,
                  weight_grad_accumulators=accs if accumulate else None)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and weights.grad.shape == weights.shape
    if accumulate:  # the gradients went into the accumulators, autograd gets none
        assert w_gate_up.grad is None and w_down.grad is None
    else:
        assert w_gate_up.grad.shape == w_gate_up.shape and w_down.grad.shape == w_down.shape
