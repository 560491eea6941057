"""backend="reference" as a torch custom op: the C++ CPU reference for CPU tensors, the
float32 PyTorch path (reference.py) for CUDA tensors, with an explicit backward."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _lib, reference


def _storage_dtype(x: Tensor) -> torch.dtype:
    # The C++ reference stores float32 or float64 and accumulates in float64.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _host_inputs(x, topk_weights, w_gate_up, w_down):
    storage = _storage_dtype(x)
    return [t.to(storage).contiguous() for t in (x, topk_weights, w_gate_up, w_down)]


def _descs(*tensors):
    return [_lib.describe(t) for t in tensors]


def _cpu_forward(x, topk_ids, topk_weights, w_gate_up, w_down):
    xs, ps, wgu, wd = _host_inputs(x, topk_weights, w_gate_up, w_down)
    y = torch.empty_like(xs)
    d = _descs(xs, topk_ids, ps, wgu, wd, y)
    _lib.call("megamoe_reference_forward", *(_lib.ref(v) for v in d))
    return y


def _cpu_backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down):
    xs, ps, wgu, wd = _host_inputs(x, topk_weights, w_gate_up, w_down)
    dys = dy.to(xs.dtype).contiguous()
    grads = [torch.empty_like(t) for t in (xs, ps, wgu, wd)]
    d = _descs(dys, xs, topk_ids, ps, wgu, wd, *grads)
    _lib.call("megamoe_reference_backward", *(_lib.ref(v) for v in d))
    return grads


@torch.library.custom_op("megamoe::reference_moe", mutates_args=())
def reference_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                  w_down: Tensor) -> Tensor:
    if x.is_cuda:
        y = reference.forward(x, topk_ids, topk_weights, w_gate_up, w_down, torch.float32)
    else:
        y = _cpu_forward(x, topk_ids, topk_weights, w_gate_up, w_down)
    return y.to(x.dtype)


@reference_moe.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::reference_moe_backward", mutates_args=())
def reference_moe_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                           w_gate_up: Tensor, w_down: Tensor
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if x.is_cuda:
        grads = reference.backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down, torch.float32)
    else:
        grads = _cpu_backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down)
    like = (x, topk_weights, w_gate_up, w_down)
    return tuple(g.to(t.dtype) for g, t in zip(grads, like))


@reference_moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w_gate_up),
            torch.empty_like(w_down))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w_gate_up, w_down = ctx.saved_tensors
    dx, dp, dwgu, dwd = reference_moe_backward(dy.contiguous(), x, topk_ids, topk_weights,
                                               w_gate_up, w_down)
    return dx, None, dp, dwgu, dwd


reference_moe.register_autograd(_backward, setup_context=_setup_context)
