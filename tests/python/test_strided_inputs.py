"""megamoe.moe takes strided inputs (transposed storage, slices, permuted and expanded
weights, misaligned views) like any PyTorch op: the same output and gradients as from the
same values stored densely."""

import pytest
import torch

import megamoe
from moe_testing import make_problem, needs_cuda, rel_err

ARGS = ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")
DIFFERENTIABLE = ("x", "topk_weights", "w_gate_up", "w_down")


def _transposed(t):
    """A non-contiguous view with t's values: storage with the last two dimensions swapped."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _column_slice(t, offset=1):
    """A non-contiguous view with t's values, starting `offset` columns into a wider tensor
    (so on the GPU also not 16-byte aligned)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    wide[..., offset:offset + t.shape[-1]] = t
    return wide[..., offset:offset + t.shape[-1]]


def _permuted(t):
    """A non-contiguous view with t's values: the first dimension stored last."""
    return t.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def _misaligned_contiguous(t):
    """A contiguous view with t's values whose data starts one element into its storage."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    flat[1:] = t.reshape(-1)
    return flat[1:].view(t.shape)


LAYOUTS = {
    "x": _column_slice, "topk_ids": _transposed, "topk_weights": _transposed,
    "w_gate_up": _transposed, "w_down": _permuted,
}


def _run(p, inputs, backend, **kwargs):
    """y and the gradients of <dy, y> for the differentiable inputs."""
    leaves = {n: inputs[n] for n in DIFFERENTIABLE}
    y = megamoe.moe(*(inputs[n] for n in ARGS), backend=backend, **kwargs)
    y.backward(p["dy"])
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _dense_leaves(p):
    return {n: (p[n].detach().clone().requires_grad_(n in DIFFERENTIABLE)) for n in ARGS}


def _strided_leaves(p, layouts):
    """p's values in the layouts that `layouts` builds (leaves that are strided views of
    buffers that need no gradient; their .grad comes in their own layout)."""
    inputs = {}
    for n in ARGS:
        t = p[n].detach().clone()
        if n in layouts:
            t = layouts[n](t)
            assert not t.is_contiguous() or layouts[n] is _misaligned_contiguous, n
        if n in DIFFERENTIABLE:
            t.requires_grad_(True)
        inputs[n] = t
    return inputs


def check_strided_matches_dense(p, backend, layouts=LAYOUTS, tol=0.0, **kwargs):
    y_dense, g_dense = _run(p, _dense_leaves(p), backend, **kwargs)
    y, grads = _run(p, _strided_leaves(p, layouts), backend, **kwargs)
    assert rel_err(y, y_dense) <= tol
    for n in DIFFERENTIABLE:
        assert grads[n] is not None, n
        assert rel_err(grads[n], g_dense[n]) <= tol, (n, rel_err(grads[n], g_dense[n]))


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float32), ("reference", torch.float64),
                                           ("torch", torch.float32)])
def test_strided_inputs_cpu(backend, dtype):
    p = make_problem(37, 32, 16, 8, 2, dtype=dtype, seed=501, invalid_fraction=0.1)
    # The reference copies strided inputs into the same dense buffers: bitwise equal.
    check_strided_matches_dense(p, backend, tol=0.0 if backend == "reference" else 1e-6)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_expanded_weights_get_summed_gradients(backend):
    """A weight expanded along the experts (stride 0, one expert's weights shared by all):
    the gradient of its base is the sum over the experts of the dense gradient."""
    p = make_problem(20, 16, 8, 4, 2, seed=502)
    p["w_down"] = p["w_down"][:1].expand(4, 16, 8).clone()
    dense = _dense_leaves(p)
    y_dense, g_dense = _run(p, dense, backend)
    base = p["w_down"][:1].clone().requires_grad_(True)
    inputs = _dense_leaves(p)
    inputs["w_down"] = base.expand(4, 16, 8)
    y = megamoe.moe(*(inputs[n] for n in ARGS), backend=backend)
    y.backward(p["dy"])
    assert rel_err(y.detach(), y_dense) <= 1e-6
    assert rel_err(base.grad, g_dense["w_down"].sum(0, keepdim=True)) < 1e-6
    assert rel_err(inputs["x"].grad, g_dense["x"]) <= 1e-6


def test_weight_grad_accumulators_must_stay_contiguous():
    """The accumulators are written in place, so a strided one is still refused."""
    p = make_problem(4, 128, 128, 4, 2, seed=503)
    acc = torch.zeros(4, 128, 128).transpose(1, 2)
    with pytest.raises(megamoe.MegaMoEError, match="acc_down must be contiguous"):
        megamoe.moe(*(p[n] for n in ARGS), backend="fused", weight_grad_accumulators=(None, acc))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "torch", "reference"])
@pytest.mark.parametrize("layout", ["strided", "misaligned"])
def test_strided_inputs_gpu(backend, layout):
    p = make_problem(300, 256, 128, 16, 4, dtype=torch.bfloat16, device="cuda", seed=504,
                     invalid_fraction=0.05)
    layouts = LAYOUTS if layout == "strided" else {
        n: _misaligned_contiguous for n in ("x", "w_gate_up", "w_down")}
    # fused is bitwise reproducible and gets the same dense copies: bitwise equal. The CUDA
    # reference (float32 matmuls) reads a misaligned view as it is, where cuBLAS may pick
    # other kernels; the torch baseline's scatter-adds use atomics.
    tol = {"fused": 0.0, "reference": 1e-6, "torch": 1e-2}[backend]
    check_strided_matches_dense(p, backend, layouts, tol=tol)
    if backend == "fused":
        check_strided_matches_dense(p, backend, layouts, tol=0.0, backward_mode="saved")
