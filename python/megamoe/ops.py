"""`megamoe.moe`: the layer call, dispatched to a backend after its arguments are checked."""

from __future__ import annotations

import torch

from . import _validate, torch_backend
from ._ep_op import fused_ep_moe
from ._fused_op import BACKWARD_MODES, fused_moe
from ._reference_op import reference_moe
from .errors import MegaMoEError


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        w_gate_up: torch.Tensor, w_down: torch.Tensor, group=None, buffer=None,
        precision: str = "bf16", backend: str = "fused", *, check_ids: bool | None = None,
        backward_mode: str = "recompute",
        weight_grad_accumulators: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        ) -> torch.Tensor:
    """The expert part of a Mixture-of-Experts layer: y = sum_j p_j * FFN_{e_j}(x).

    Args:
        x: [T, H] token activations.
        topk_ids: [T, k] int32/int64 global expert ids in [-1, E_total); -1 means "no expert"
            (the slot adds nothing and its weight gets gradient 0).
        topk_weights: [T, k] float32 or bfloat16 router weights p.
        w_gate_up: [E_local, 2I, H]; rows [0, I) are the gate, [I, 2I) the up projection.
        w_down: [E_local, H, I].
        group: expert-parallel process group of W ranks; rank r owns global experts
            [r*E_local, (r+1)*E_local). None for one device.
        buffer: backend="fused" with a group of more than one rank: the group's
            megamoe.Buffer.
        precision: "bf16" | "fp8" | "fp8_bwd" | "mxfp8" (matrix precision of fused/torch).
            backend="torch" runs "bf16" and "fp8" (TorchTitan's FP8: torch_fp8.py, sm_90 GPUs).
        backend: "fused" | "torch" (TorchTitan-style baseline) | "reference".
        check_ids: check that ids lie in [-1, E_total) (one host sync). Default: checked,
            except while torch.compile traces or a CUDA graph is captured.
        backward_mode: backend="fused" only. "recompute" (default): the forward keeps only
            its inputs and the backward recomputes L1. "saved": the forward also keeps the
            L1 output (T*k*2I values of x's dtype; with a buffer, the max_recv_rows*2I rows
            this rank computes) and the backward skips that GEMM.
        weight_grad_accumulators: backend="fused" only. (acc_gate_up, acc_down), fp32
            tensors shaped like w_gate_up and w_down (either may be None): the backward adds
            the weight gradients into them in fp32 (gradient accumulation without a bf16
            round trip), and those weights then get no .grad from this call.

    Every tensor may have any strides (views, transposes, expanded tensors): the backends
    get a contiguous copy of an input that is not contiguous (and "fused"/"torch" on CUDA
    of x or a weight that does not start 16-byte aligned), and gradients flow back through
    the copy to the tensor given. The weight gradient accumulators are the exception: they
    are written in place, so they must be contiguous.

    Returns y [T, H] in x's dtype. Gradients flow to x, topk_weights, w_gate_up, w_down.
    """
    _validate.check_backend_and_precision(backend, precision)
    _validate.check_weight_grad_accumulators(weight_grad_accumulators, w_gate_up, w_down, backend)
    problem = _validate.check_call(x, topk_ids, topk_weights, w_gate_up, w_down, group, backend)
    x, topk_ids, topk_weights, w_gate_up, w_down = _validate.dense_inputs(
        x, topk_ids, topk_weights, w_gate_up, w_down, backend)
    if backward_mode not in BACKWARD_MODES:
        raise MegaMoEError(f"backward_mode: expected one of {BACKWARD_MODES}, got {backward_mode!r}")
    _validate.check_ep_buffer(buffer, problem, group, backend, x)
    if _validate.should_check_ids(check_ids):
        _validate.check_ids_range(topk_ids, problem.num_experts)
    if backend == "torch":
        return torch_backend.moe(x, topk_ids, topk_weights, w_gate_up, w_down, group, precision)
    if backend == "reference":
        return reference_moe(x, topk_ids, topk_weights, w_gate_up, w_down)
    if backend == "fused" and buffer is not None:
        return fused_ep_moe(x, topk_ids, topk_weights, w_gate_up, w_down, buffer, backward_mode,
                            weight_grad_accumulators, precision)
    if backend == "fused":
        return fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, backward_mode,
                         weight_grad_accumulators, precision)
    raise MegaMoEError(f"unhandled backend {backend!r}")  # unreachable: validated above
