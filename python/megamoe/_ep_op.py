"""backend="fused" with an expert-parallel group: forward and backward (recompute or saved
mode, weight gradients written or added into fp32 accumulators; bf16, or blockwise FP8 with
the weights' FP8 copies as inputs, as on one GPU) as torch custom ops over a
megamoe.Buffer."""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _lib
from . import buffer as _buffer
from ._fused_op import _fp8_copy, _release_fp8_copies, grad_outputs, grad_targets, keeps_h

# The EP backward is collective and computes every gradient (an accumulator takes a weight's).
_ALL = [True, True, True, True]


def _forward_workspace_bytes(buf, T: int, I: int) -> int:
    return _lib.call_for_size("megamoe_ep_workspace_size", ctypes.byref(buf._struct), T, I)


def _backward_workspace_bytes(buf, T: int, I: int, h_saved: bool) -> int:
    return _lib.call_for_size("megamoe_ep_backward_workspace_size", ctypes.byref(buf._struct),
                              T, I, int(h_saved))


def _h_shape(buffer_id: int, w_gate_up: Tensor) -> tuple[int, int]:
    return (_buffer.get(buffer_id).max_recv_rows, w_gate_up.shape[1])


# The accumulators have no defaults: torch 2.11 drops trailing default arguments before
# its ADInplaceOrView step, which then indexes a mutated argument that is not there.
@torch.library.custom_op("megamoe::fused_ep_forward", mutates_args=())
def fused_ep_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                     w_down: Tensor, buffer_id: int, save_h: bool, acc_gate_up: Optional[Tensor],
                     acc_down: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """y, and h of the rows this rank computes ([max_recv_rows, 2I]) when save_h, else an
    empty tensor; collective. The accumulators are only handed to autograd."""
    buf = _buffer.get(buffer_id)
    y = torch.empty_like(x)
    h = x.new_empty(_h_shape(buffer_id, w_gate_up)) if save_h else x.new_empty((0,))
    weights = topk_weights.float().contiguous()
    with torch.cuda.device(x.device):
        nbytes = _forward_workspace_bytes(buf, x.shape[0], w_gate_up.shape[1] // 2)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, weights, w_gate_up, w_down, y)]
        d.append(_lib.describe(h) if save_h else None)
        _lib.call("megamoe_ep_forward", ctypes.byref(buf._struct), *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return y, h


@fused_ep_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id, save_h, acc_gate_up, acc_down):
    h = x.new_empty(_h_shape(buffer_id, w_gate_up)) if save_h else x.new_empty((0,))
    return torch.empty_like(x), h


@torch.library.custom_op("megamoe::fused_ep_backward", mutates_args=("acc_gate_up", "acc_down"))
def fused_ep_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                      w_gate_up: Tensor, w_down: Tensor, saved_h: Tensor, buffer_id: int,
                      acc_gate_up: Optional[Tensor], acc_down: Optional[Tensor]
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, d topk_weights (fp32), d w_gate_up, d w_down (this rank's experts); collective.
    saved_h: the forward's h, or empty to recompute L1. A weight gradient with an fp32
    accumulator is added into it instead (and comes back empty)."""
    buf = _buffer.get(buffer_id)
    T = topk_ids.shape[0]
    h_saved = saved_h.numel() > 0
    grads = grad_outputs(x, topk_ids, w_gate_up, w_down, _ALL, acc_gate_up, acc_down)
    targets = grad_targets(grads, acc_gate_up, acc_down)
    with torch.cuda.device(x.device):
        nbytes = _backward_workspace_bytes(buf, T, w_gate_up.shape[1] // 2, h_saved)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (dy, x, topk_ids, topk_weights, w_gate_up, w_down)]
        d.append(_lib.describe(saved_h) if h_saved else None)
        d += [_lib.describe(t) for t in targets]
        _lib.call("megamoe_ep_backward", ctypes.byref(buf._struct), *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return tuple(grads)


@fused_ep_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, buffer_id, acc_gate_up,
      acc_down):
    return tuple(grad_outputs(x, topk_ids, w_gate_up, w_down, _ALL, acc_gate_up, acc_down))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id, _, acc_gate_up, acc_down = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)
    ctx.buffer_id = buffer_id
    ctx.weights_dtype = topk_weights.dtype
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, h, acc_gate_up,
                          acc_down)


def _backward(ctx, dy, _dh):
    x, topk_ids, topk_weights, w_gate_up, w_down, h, acc_gate_up, acc_down = ctx.saved_tensors
    # Collective: every rank runs it, whatever its own inputs need (a rank whose y got no
    # gradient still serves its peers' rows).
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dp, dw1, dw2 = fused_ep_backward(dy.to(x.dtype).contiguous(), x, topk_ids,
                                         topk_weights.float().contiguous(), w_gate_up, w_down,
                                         h, ctx.buffer_id, acc_gate_up, acc_down)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, None, dp.to(ctx.weights_dtype) if needs[2] else None,
            dw1 if needs[3] and acc_gate_up is None else None,
            dw2 if needs[4] and acc_down is None else None, None, None, None, None)


fused_ep_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- blockwise FP8 (docs/fp8.md): the one-GPU FP8 ops' arguments, over a Buffer ----------


def _fp8_forward_workspace_bytes(buf, T: int, I: int) -> int:
    return _lib.call_for_size("megamoe_ep_fp8_workspace_size", ctypes.byref(buf._struct), T, I)


def _fp8_backward_workspace_bytes(buf, T: int, I: int, h_saved: bool, forward_fp8: bool) -> int:
    return _lib.call_for_size("megamoe_ep_fp8_backward_workspace_size",
                              ctypes.byref(buf._struct), T, I, int(h_saved), int(forward_fp8))


@torch.library.custom_op("megamoe::fused_ep_fp8_forward", mutates_args=())
def fused_ep_fp8_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                         w_down: Tensor, gate_up_q: Tensor, gate_up_q_t: Tensor,
                         gate_up_scales: Tensor, down_q: Tensor, down_q_t: Tensor,
                         down_scales: Tensor, forward_fp8: bool, buffer_id: int, save_h: bool,
                         acc_gate_up: Optional[Tensor], acc_down: Optional[Tensor]
                         ) -> tuple[Tensor, Tensor]:
    """As fused_ep_forward, in FP8 when forward_fp8 (else the bf16 forward, whose backward
    runs in FP8)."""
    if not forward_fp8:
        return fused_ep_forward(x, topk_ids, topk_weights, w_gate_up, w_down, buffer_id, save_h,
                                acc_gate_up, acc_down)
    buf = _buffer.get(buffer_id)
    y = torch.empty_like(x)
    h = x.new_empty(_h_shape(buffer_id, w_gate_up)) if save_h else x.new_empty((0,))
    weights = topk_weights.float().contiguous()
    with torch.cuda.device(x.device):
        nbytes = _fp8_forward_workspace_bytes(buf, x.shape[0], w_gate_up.shape[1] // 2)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, weights, w_gate_up, w_down, gate_up_q,
                                        gate_up_scales, down_q, down_scales, y)]
        d.append(_lib.describe(h) if save_h else None)
        _lib.call("megamoe_ep_fp8_forward", ctypes.byref(buf._struct),
                  *(_lib.ref(v) for v in d), ctypes.c_void_p(workspace.data_ptr()), nbytes,
                  _lib.stream(x.device))
    return y, h


@fused_ep_fp8_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
      down_q, down_q_t, down_scales, forward_fp8, buffer_id, save_h, acc_gate_up, acc_down):
    h = x.new_empty(_h_shape(buffer_id, w_gate_up)) if save_h else x.new_empty((0,))
    return torch.empty_like(x), h


@torch.library.custom_op("megamoe::fused_ep_fp8_backward",
                         mutates_args=("acc_gate_up", "acc_down"))
def fused_ep_fp8_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                          w_gate_up: Tensor, w_down: Tensor, gate_up_q: Tensor,
                          gate_up_q_t: Tensor, gate_up_scales: Tensor, down_q_t: Tensor,
                          down_scales: Tensor, forward_fp8: bool, saved_h: Tensor,
                          buffer_id: int, acc_gate_up: Optional[Tensor],
                          acc_down: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As fused_ep_backward, with the backward's GEMMs in FP8."""
    buf = _buffer.get(buffer_id)
    T = topk_ids.shape[0]
    h_saved = saved_h.numel() > 0
    grads = grad_outputs(x, topk_ids, w_gate_up, w_down, _ALL, acc_gate_up, acc_down)
    targets = grad_targets(grads, acc_gate_up, acc_down)
    with torch.cuda.device(x.device):
        nbytes = _fp8_backward_workspace_bytes(buf, T, w_gate_up.shape[1] // 2, h_saved,
                                               forward_fp8)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (dy, x, topk_ids, topk_weights, w_gate_up, w_down,
                                        gate_up_q, gate_up_q_t, gate_up_scales, down_q_t,
                                        down_scales)]
        tail = [_lib.describe(saved_h) if h_saved else None]
        tail += [_lib.describe(t) for t in targets]
        _lib.call("megamoe_ep_fp8_backward", ctypes.byref(buf._struct),
                  *(_lib.ref(v) for v in d), int(forward_fp8), *(_lib.ref(v) for v in tail),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return tuple(grads)


@fused_ep_fp8_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
      down_q_t, down_scales, forward_fp8, saved_h, buffer_id, acc_gate_up, acc_down):
    return tuple(grad_outputs(x, topk_ids, w_gate_up, w_down, _ALL, acc_gate_up, acc_down))


def _setup_context_fp8(ctx, inputs, output):
    (x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
     _down_q, down_q_t, down_scales, forward_fp8, buffer_id, _, acc_gate_up, acc_down) = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)
    ctx.buffer_id = buffer_id
    ctx.weights_dtype = topk_weights.dtype
    ctx.forward_fp8 = forward_fp8
    ctx.fp8_weights = (weakref.ref(w_gate_up), weakref.ref(w_down))
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t,
                          gate_up_scales, down_q_t, down_scales, h, acc_gate_up, acc_down)


def _backward_fp8(ctx, dy, _dh):
    (x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
     down_q_t, down_scales, h, acc_gate_up, acc_down) = ctx.saved_tensors
    # Collective, as _backward.
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dp, dw1, dw2 = fused_ep_fp8_backward(
        dy.to(x.dtype).contiguous(), x, topk_ids, topk_weights.float().contiguous(), w_gate_up,
        w_down, gate_up_q, gate_up_q_t, gate_up_scales, down_q_t, down_scales, ctx.forward_fp8,
        h, ctx.buffer_id, acc_gate_up, acc_down)
    _release_fp8_copies(ctx.fp8_weights)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, None, dp.to(ctx.weights_dtype) if needs[2] else None,
            dw1 if needs[3] and acc_gate_up is None else None,
            dw2 if needs[4] and acc_down is None else None) + (None,) * 11


fused_ep_fp8_forward.register_autograd(_backward_fp8, setup_context=_setup_context_fp8)


def fused_ep_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                 w_down: Tensor, buffer, backward_mode: str = "recompute",
                 weight_grad_accumulators=None, precision: str = "bf16") -> Tensor:
    """The fused layer over an EP group's megamoe.Buffer, differentiable; h is kept only in
    the "saved" mode and only when a backward can follow. precision: "bf16", "fp8" or
    "fp8_bwd" (the weights' FP8 copies from the process-wide cache, as on one GPU)."""
    save_h = keeps_h(backward_mode, x, topk_weights, w_gate_up, w_down)
    acc_gate_up, acc_down = weight_grad_accumulators or (None, None)
    if precision == "bf16":
        y, _ = fused_ep_forward(x, topk_ids, topk_weights, w_gate_up, w_down, buffer.id, save_h,
                                acc_gate_up, acc_down)
        return y
    gate_up, down = _fp8_copy(w_gate_up), _fp8_copy(w_down)
    y, _ = fused_ep_fp8_forward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up.values,
                                gate_up.values_t, gate_up.scales, down.values, down.values_t,
                                down.scales, precision == "fp8", buffer.id, save_h, acc_gate_up,
                                acc_down)
    return y
