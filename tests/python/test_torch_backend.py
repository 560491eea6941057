"""The TorchTitan-style baseline against the reference math, on the CPU (float32)."""

import pytest
import torch

import megamoe
from megamoe import reference
from moe_testing import make_problem, rel_err, run_with_grads

NAMES = ("x", "topk_weights", "w_gate_up", "w_down")


def _check_against_reference(p, tol):
    y, grads = run_with_grads(megamoe.moe, p, backend="torch")
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    y_ref = reference.forward(*args)
    refs = dict(zip(NAMES, reference.backward(p["dy"], *args)))
    assert rel_err(y, y_ref) < tol
    for name in NAMES:
        assert rel_err(grads[name], refs[name]) < tol, name
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
