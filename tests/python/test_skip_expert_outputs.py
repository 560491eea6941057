"""megamoe.skip_expert_outputs(): inside it the fused experts compute only what their
backward keeps (L1 and h in the saved mode, nothing in the recompute mode) and return a NaN
y. Checked the way megamoe-train uses it, as the recompute context of a non-reentrant
activation checkpoint: the block's output and every gradient bitwise equal to the same
checkpoint without it, at every precision and backward mode; h from the L1-only call bitwise
the full forward's; a block that does keep the MoE output shows NaN gradients, not wrong
ones. GPU only (the fused backend runs on sm_90a)."""

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megamoe
from megamoe._fused_op import fused_moe_forward, fused_moe_fp8_forward, _fp8_copy
from moe_testing import make_problem, needs_cuda

pytestmark = [needs_cuda, pytest.mark.gpu]

PRECISIONS = ("bf16", "fp8", "fp8_bwd")
MODES = ("recompute", "saved")


def _contexts(skip: bool):
    return contextlib.nullcontext(), (megamoe.skip_expert_outputs() if skip
                                      else contextlib.nullcontext())


def _block(x, topk_ids, topk_weights, w_gate_up, w_down, *, precision, mode, keep_output):
    """A decoder layer's shape: a residual add of the MoE output (nothing kept), or, with
    keep_output, an op that keeps it for its backward (the misuse)."""
    y = megamoe.moe(x * 0.5, topk_ids, topk_weights, w_gate_up, w_down, precision=precision,
                    backward_mode=mode, check_ids=False)
    return x + (y * y if keep_output else y)


def _run(p, skip, precision, mode, keep_output=False):
    leaves = {n: p[n].detach().clone().requires_grad_(True)
              for n in ("x", "topk_weights", "w_gate_up", "w_down")}
    out = checkpoint(functools.partial(_block, precision=precision, mode=mode,
                                       keep_output=keep_output),
                     leaves["x"], p["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
                     leaves["w_down"], use_reentrant=False,
                     context_fn=functools.partial(_contexts, skip))
    out.backward(p["dy"])
    return out.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpointed_block_bitwise_equal(precision, mode):
    # Awkward sizes: tokens not a multiple of 128, dropped slots, an expert without tokens.
    p = make_problem(777, 256, 256, 8, 3, dtype=torch.bfloat16, device="cuda", seed=31,
                     invalid_fraction=0.05, skip_experts=(2,))
    out_ref, grads_ref = _run(p, False, precision, mode)
    out, grads = _run(p, True, precision, mode)
    assert torch.equal(out, out_ref)  # the forward itself is not skipped
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert torch.equal(g, grads_ref[name]), name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_l1_only_call_gives_the_same_h(precision):
    p = make_problem(300, 256, 384, 16, 8, dtype=torch.bfloat16, device="cuda", seed=5,
                     invalid_fraction=0.05)
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    if precision == "bf16":
        run = functools.partial(fused_moe_forward, *args, True, None, None)
    else:
        gate_up, down = _fp8_copy(p["w_gate_up"]), _fp8_copy(p["w_down"])
        run = functools.partial(fused_moe_fp8_forward, *args, gate_up.values, gate_up.values_t,
                                gate_up.scales, down.values, down.values_t, down.scales,
                                precision == "fp8", True, None, None)
    y_full, h_full = run(True)
    y, h = run(False)
    # The rows of dropped slots (-1 ids), last in the sorted order, are never written.
    used = int((p["topk_ids"] >= 0).sum())
    assert torch.equal(h[:used], h_full[:used])
    assert torch.isnan(y).all() and torch.isfinite(y_full).all()
    with megamoe.skip_expert_outputs():  # nothing at all in the recompute mode
        y_none = megamoe.moe(*args, precision=precision, check_ids=False)
    assert torch.isnan(y_none).all()
    # Outside the context, and after it, the layer computes y again.
    y_after = megamoe.moe(*args, precision=precision, check_ids=False)
    assert torch.isfinite(y_after).all()


def test_kept_output_shows_as_nan_gradients():
    p = make_problem(256, 256, 256, 8, 2, dtype=torch.bfloat16, device="cuda", seed=8)
    _, grads = _run(p, True, "bf16", "saved", keep_output=True)
    assert not torch.isfinite(grads["x"]).all()
    _, grads = _run(p, False, "bf16", "saved", keep_output=True)
    assert torch.isfinite(grads["x"]).all()
