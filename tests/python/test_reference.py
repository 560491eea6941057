"""The C++ CPU reference (behind backend="reference") against the PyTorch float64 math and
torch's own gradcheck; the finite-difference bar itself is tested in C++ (tests/cpp)."""

import pytest
import torch

import megamoe
from megamoe import reference
from moe_testing import make_problem, rel_err, run_with_grads

SHAPES = [  # T, H, I, E, k
    (1, 16, 8, 4, 1),
    (7, 24, 12, 6, 2),
    (33, 32, 16, 8, 3),
]


@pytest.mark.parametrize("T,H,I,E,k", SHAPES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_cpu_reference_matches_torch_math(T, H, I, E, k, ids_dtype):
    p = make_problem(T, H, I, E, k, seed=T, invalid_fraction=0.2, skip_experts=(1,),
                     ids_dtype=ids_dtype)
    y, grads = run_with_grads(megamoe.moe, p, backend="reference")
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    y_ref = reference.forward(*args)
    dx, dp, dwgu, dwd = reference.backward(p["dy"], *args)
    assert y.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-6
    assert rel_err(grads["x"], dx) < 1e-6
    assert rel_err(grads["topk_weights"], dp) < 1e-6
    assert rel_err(grads["w_gate_up"], dwgu) < 1e-6
    assert rel_err(grads["w_down"], dwd) < 1e-6
    # An expert with no tokens gets an exactly-zero gradient; a -1 slot gets dp = 0.
    assert torch.all(grads["w_gate_up"][1] == 0) and torch.all(grads["w_down"][1] == 0)
    assert torch.all(grads["topk_weights"][p["topk_ids"] == -1] == 0)


def test_reference_gradcheck_float64():
    p = make_problem(5, 8, 4, 4, 2, dtype=torch.float64, seed=99, invalid_fraction=0.2)
    p["topk_weights"] = p["topk_weights"].double()
    ids = p["topk_ids"]

    def f(x, w, wgu, wd):
        return megamoe.moe(x, ids, w, wgu, wd, backend="reference")

    inputs = [p[n].clone().requires_grad_(True) for n in ("x", "topk_weights", "w_gate_up", "w_down")]
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_all_tokens_on_one_expert_and_all_invalid():
    p = make_problem(9, 16, 8, 4, 2, seed=3, one_expert=2)
    y, grads = run_with_grads(megamoe.moe, p, backend="reference")
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    assert rel_err(y, reference.forward(*args)) < 1e-6
    assert grads["w_gate_up"][[0, 1, 3]].abs().sum() == 0
    p["topk_ids"].fill_(-1)
    y, grads = run_with_grads(megamoe.moe, p, backend="reference")
    assert torch.all(y == 0) and torch.all(grads["x"] == 0) and torch.all(grads["topk_weights"] == 0)


def test_bf16_inputs_come_back_bf16():
    p = make_problem(6, 16, 8, 4, 2, dtype=torch.bfloat16, seed=5)
    y, grads = run_with_grads(megamoe.moe, p, backend="reference")
    assert y.dtype == torch.bfloat16 and grads["x"].dtype == torch.bfloat16
    assert grads["w_down"].dtype == torch.bfloat16 and grads["topk_weights"].dtype == torch.float32


def test_library_version_matches_package():
    from megamoe import _lib
    assert _lib.library_version() == megamoe.__version__
