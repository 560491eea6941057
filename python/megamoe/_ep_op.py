"""backend="fused" with an expert-parallel group: forward and backward (recompute mode) as
torch custom ops over a megamoe.Buffer."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import _lib
from . import buffer as _buffer


def _workspace(name: str, buf, T: int, I: int, device) -> tuple[Tensor, int]:
    size = ctypes.c_size_t()
    _lib.call(name, ctypes.byref(buf._struct), T, I, ctypes.byref(size))
    return torch.empty(size.value, dtype=torch.uint8, device=device), size.value


def _stream(device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


@torch.library.custom_op("megamoe::fused_ep_forward", mutates_args=())
def fused_ep_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                     w_down: Tensor, buffer_id: int) -> Tensor:
    buf = _buffer.get(buffer_id)
    y = torch.empty_like(x)
    weights = topk_weights.float().contiguous()
    with torch.cuda.device(x.device):
        workspace, nbytes = _workspace("megamoe_ep_workspace_size", buf, x.shape[0],
                                       w_gate_up.shape[1] // 2, x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, weights, w_gate_up, w_down, y)]
        _lib.call("megamoe_ep_forward", ctypes.byref(buf._struct), *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _stream(x.device))
    return y


@fused_ep_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::fused_ep_backward", mutates_args=())
def fused_ep_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                      w_gate_up: Tensor, w_down: Tensor, buffer_id: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, d topk_weights (fp32), d w_gate_up, d w_down (this rank's experts); collective."""
    buf = _buffer.get(buffer_id)
    T, k = topk_ids.shape
    grads = (torch.empty_like(x), torch.empty((T, k), dtype=torch.float32, device=x.device),
             torch.empty_like(w_gate_up), torch.empty_like(w_down))
    with torch.cuda.device(x.device):
        workspace, nbytes = _workspace("megamoe_ep_backward_workspace_size", buf, T,
                                       w_gate_up.shape[1] // 2, x.device)
        d = [_lib.describe(t) for t in (dy, x, topk_ids, topk_weights, w_gate_up, w_down, *grads)]
        _lib.call("megamoe_ep_backward", ctypes.byref(buf._struct), *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _stream(x.device))
    return grads


@fused_ep_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id):
    T, k = topk_ids.shape
    return (torch.empty_like(x), x.new_empty((T, k), dtype=torch.float32),
            torch.empty_like(w_gate_up), torch.empty_like(w_down))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id = inputs
    ctx.buffer_id = buffer_id
    ctx.weights_dtype = topk_weights.dtype
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w_gate_up, w_down = ctx.saved_tensors
    # Collective: every rank runs it, whatever its own inputs need.
    dx, dp, dw1, dw2 = fused_ep_backward(dy.to(x.dtype).contiguous(), x, topk_ids,
                                         topk_weights.float().contiguous(), w_gate_up, w_down,
                                         ctx.buffer_id)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, None, dp.to(ctx.weights_dtype) if needs[2] else None,
            dw1 if needs[3] else None, dw2 if needs[4] else None, None)


fused_ep_forward.register_autograd(_backward, setup_context=_setup_context)
