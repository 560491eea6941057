"""GPU checks (skipped without CUDA): the torch baseline against the float64 reference at the
benchmark presets, and the library's device routing counts."""

import ctypes

import pytest
import torch

import megamoe
from megamoe import _lib, reference
from moe_testing import dp_error_and_bound, make_problem, needs_cuda, rel_err, run_with_grads

pytestmark = [needs_cuda, pytest.mark.gpu]

PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-235b-a22b": (4096, 1536, 128, 8)}
NAMES = ("x", "topk_weights", "w_gate_up", "w_down")


def _errors_against_float64(p, backend, tol=1e-2):
    """(error, bound) of y and every gradient: relative Frobenius errors against `tol`; in
    bf16, d topk_weights by moe_testing.dp_error_and_bound (its bound follows the bf16 noise
    of problems with few slots)."""
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    y, grads = run_with_grads(megamoe.moe, p, backend=backend)
    errors = {"y": (rel_err(y, reference.forward(*args)), tol)}
    refs = reference.backward(p["dy"], *args)
    errors.update({name: (rel_err(grads[name], ref), tol) for name, ref in zip(NAMES, refs)})
    if p["x"].dtype == torch.bfloat16:
        errors["topk_weights"] = dp_error_and_bound(grads["topk_weights"], refs[1], p)
    return errors


def _check(errors):
    for name, (err, bound) in errors.items():
        assert err < bound, (name, err, bound)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("tokens", [4096])
def test_torch_backend_matches_float64_reference(preset, tokens):
    H, I, E, k = PRESETS[preset]
    p = make_problem(tokens, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=tokens,
                     invalid_fraction=0.02, skip_experts=(5,))
    errors = _errors_against_float64(p, "torch")
    print(preset, tokens, {n: f"{e:.2e}" for n, (e, _) in errors.items()})
    _check(errors)


@pytest.mark.parametrize("T,k,one_expert", [(1, 1, None), (7, 2, None), (4097, 8, None), (300, 4, 17)])
def test_torch_backend_awkward_shapes(T, k, one_expert):
    p = make_problem(T, 256, 128, 64, k, dtype=torch.bfloat16, device="cuda", seed=T,
                     invalid_fraction=0.1 if one_expert is None else 0.0, one_expert=one_expert)
    _check(_errors_against_float64(p, "torch"))


def test_reference_backend_on_cuda_is_float32_accurate():
    p = make_problem(257, 128, 64, 16, 4, device="cuda", seed=3, invalid_fraction=0.1)
    _check(_errors_against_float64(p, "reference", 1e-5))


def test_routing_counts_on_device():
    T, k, E = 5000, 8, 128
    ids = torch.randint(-1, E, (T, k), device="cuda", dtype=torch.int32)
    ids[0, 0], ids[1, 1], ids[2, 2] = -5, E, E + 40
    counts = torch.full((E,), -7, dtype=torch.int32, device="cuda")
    invalid = torch.full((1,), -7, dtype=torch.int32, device="cuda")
    descs = [_lib.describe(t) for t in (ids, counts, invalid)]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _lib.call("megamoe_routing_counts", _lib.ref(descs[0]), E, _lib.ref(descs[1]),
              _lib.ref(descs[2]), stream)
    flat = ids.long().flatten()
    expected = torch.bincount(flat[(flat >= 0) & (flat < E)], minlength=E)
    assert torch.equal(counts.long(), expected)
    assert invalid.item() == 3


def test_torch_backend_on_cuda_refuses_what_grouped_mm_cannot_take():
    p = make_problem(8, 64, 32, 8, 2, device="cuda", seed=4)
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    with pytest.raises(megamoe.MegaMoEError, match="torch.bfloat16, got torch.float32"):
        megamoe.moe(*args, backend="torch")
    p = make_problem(8, 60, 32, 8, 2, dtype=torch.bfloat16, device="cuda", seed=4)
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    with pytest.raises(megamoe.MegaMoEError, match="multiples of 8"):
        megamoe.moe(*args, backend="torch")
