"""backend="fused" on one GPU as torch custom ops: the forward, the backward, and their
autograd link. Backward modes: "recompute" (the forward keeps only its inputs; L1 is
recomputed) and "saved" (the forward also writes the L1 output h [T*k, 2I], which the
backward reads instead: more memory, less work).

Inside `skip_expert_outputs()` (the recompute of an activation-checkpointed region) the
forward computes only what its backward keeps: h in the saved mode (L1 alone), nothing in
the recompute mode; y is then a NaN tensor."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import weakref

from typing import Optional

import torch
from torch import Tensor

from . import _lib

BACKWARD_MODES = ("recompute", "saved")

_skip = threading.local()


@contextlib.contextmanager
def skip_expert_outputs():
    """Inside, the fused experts on one GPU (backend="fused" without a buffer) compute only
    what their backward keeps and return y [T, H] filled with NaN: in the "saved" mode L1
    and its output h (no L2, no combine), in the "recompute" mode nothing. The backward is
    the same, bit for bit. For the recompute of an activation-checkpointed region, whose
    outputs are thrown away, where the MoE output feeds nothing that autograd keeps (a
    residual add): megamoe-train enters it in the recompute of each checkpointed decoder
    layer (train.checkpoint_skip_expert_outputs). Were y kept after all, the NaNs would show
    in the gradients. Read when the layer is called in eager mode; ignored while
    torch.compile traces (a traced graph would keep whichever branch it saw). Nests; per
    thread."""
    depth = getattr(_skip, "depth", 0)
    _skip.depth = depth + 1
    try:
        yield
    finally:
        _skip.depth = depth


def _outputs_wanted() -> bool:
    return getattr(_skip, "depth", 0) == 0 or torch.compiler.is_compiling()


@functools.lru_cache(maxsize=64)
def workspace_bytes(T: int, k: int, H: int, I: int, E: int) -> int:
    return _lib.call_for_size("megamoe_fused_workspace_size", T, k, H, I, E)


@functools.lru_cache(maxsize=64)
def backward_workspace_bytes(T: int, k: int, H: int, I: int, E: int, h_saved: bool) -> int:
    return _lib.call_for_size("megamoe_fused_backward_workspace_size", T, k, H, I, E,
                              int(h_saved))


def _sizes(x: Tensor, topk_ids: Tensor, w_gate_up: Tensor):
    T, H = x.shape
    E, two_I, _ = w_gate_up.shape
    return T, topk_ids.shape[1], H, two_I // 2, E


def _empty_h(x: Tensor) -> Tensor:
    return x.new_empty((0,))


def _outputs(x: Tensor, T: int, k: int, I: int, save_h: bool, output: bool):
    """The forward's y and h; y NaN when the call does not compute it."""
    y = torch.empty_like(x) if output else torch.full_like(x, float("nan"))
    return y, (x.new_empty((T * k, 2 * I)) if save_h else _empty_h(x))


@torch.library.custom_op("megamoe::fused_moe_forward", mutates_args=())
def fused_moe_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                      w_down: Tensor, save_h: bool, acc_gate_up: Optional[Tensor],
                      acc_down: Optional[Tensor], output: bool = True) -> tuple[Tensor, Tensor]:
    """y, and h (the L1 output in expert-sorted rows) when save_h, else an empty tensor.
    acc_gate_up / acc_down: fp32 buffers the backward adds the weight gradients into (the
    forward only hands them to autograd). output False: y is NaN and only h is computed
    (nothing without save_h; see skip_expert_outputs)."""
    T, k, H, I, E = _sizes(x, topk_ids, w_gate_up)
    y, h = _outputs(x, T, k, I, save_h, output)
    if not output and not save_h:
        return y, h
    with torch.cuda.device(x.device):
        nbytes = workspace_bytes(T, k, H, I, E)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, topk_weights, w_gate_up, w_down)]
        d.append(_lib.describe(y) if output else None)
        d.append(_lib.describe(h) if save_h else None)
        _lib.call("megamoe_fused_forward", *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return y, h


@fused_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, save_h, acc_gate_up, acc_down, output=True):
    T, k, _, I, _ = _sizes(x, topk_ids, w_gate_up)
    return torch.empty_like(x), (x.new_empty((T * k, 2 * I)) if save_h else _empty_h(x))


def grad_outputs(x, topk_ids, w_gate_up, w_down, needs, acc_gate_up, acc_down) -> list[Tensor]:
    """The backward op's outputs: a tensor for each gradient that is needed and not added
    into an accumulator, an empty one (of the gradient's dtype) for the others."""
    T, k = topk_ids.shape
    written = [needs[0], needs[1], needs[2] and acc_gate_up is None,
               needs[3] and acc_down is None]
    like = [(x.shape, x.dtype), ((T, k), torch.float32), (w_gate_up.shape, w_gate_up.dtype),
            (w_down.shape, w_down.dtype)]
    return [x.new_empty(shape if w else (0,), dtype=dtype)
            for (shape, dtype), w in zip(like, written)]


def grad_targets(grads: list[Tensor], acc_gate_up: Optional[Tensor],
                 acc_down: Optional[Tensor]) -> list[Tensor]:
    """Where each gradient goes: its own output, or its fp32 accumulator."""
    return grads[:2] + [acc if acc is not None else g
                        for acc, g in ((acc_gate_up, grads[2]), (acc_down, grads[3]))]


def _gradient_buffers(x, topk_ids, w_gate_up, w_down, needs, acc_gate_up, acc_down):
    """(the op's outputs, where each gradient is written, which the library computes)."""
    grads = grad_outputs(x, topk_ids, w_gate_up, w_down, needs, acc_gate_up, acc_down)
    targets = grad_targets(grads, acc_gate_up, acc_down)
    computed = [needs[0], needs[1], needs[2] or acc_gate_up is not None,
                needs[3] or acc_down is not None]
    return grads, targets, computed


def keeps_h(backward_mode: str, x: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
            w_down: Tensor) -> bool:
    """The "saved" mode keeps h only when a backward can follow."""
    return backward_mode == "saved" and torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w_gate_up, w_down))


@torch.library.custom_op("megamoe::fused_moe_backward", mutates_args=("acc_gate_up", "acc_down"))
def fused_moe_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                       w_gate_up: Tensor, w_down: Tensor, saved_h: Tensor, needs: list[bool],
                       acc_gate_up: Optional[Tensor], acc_down: Optional[Tensor]
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, d topk_weights (fp32), d w_gate_up, d w_down; `needs` says which to compute (an
    empty tensor stands for the others). saved_h: the forward's h, or empty to recompute.
    topk_weights must be fp32. A weight gradient with an fp32 accumulator is added into it
    instead (and comes back empty)."""
    T, k, H, I, E = _sizes(x, topk_ids, w_gate_up)
    h_saved = saved_h.numel() > 0
    grads, targets, needs = _gradient_buffers(x, topk_ids, w_gate_up, w_down, needs,
                                              acc_gate_up, acc_down)
    with torch.cuda.device(x.device):
        nbytes = backward_workspace_bytes(T, k, H, I, E, h_saved)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (dy, x, topk_ids, topk_weights, w_gate_up, w_down)]
        d.append(_lib.describe(saved_h) if h_saved else None)
        d += [_lib.describe(t) if need else None for t, need in zip(targets, needs)]
        _lib.call("megamoe_fused_backward", *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return tuple(grads)


@fused_moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, needs, acc_gate_up, acc_down):
    return tuple(grad_outputs(x, topk_ids, w_gate_up, w_down, needs, acc_gate_up, acc_down))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate_up, w_down, _, acc_gate_up, acc_down, *_ = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    # h never gets a gradient: without this, autograd fills a zero tensor of h's size.
    ctx.set_materialize_grads(False)
    ctx.weights_dtype = topk_weights.dtype
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, h, acc_gate_up,
                          acc_down)


def _backward(ctx, dy, _dh):
    x, topk_ids, topk_weights, w_gate_up, w_down, h, acc_gate_up, acc_down = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    dx, dp, dw1, dw2 = fused_moe_backward(
        dy.to(x.dtype).contiguous(), x, topk_ids, topk_weights.float().contiguous(), w_gate_up,
        w_down, h, needs, acc_gate_up, acc_down)
    # A weight whose gradient went into its accumulator gets none from autograd.
    return (dx if needs[0] else None, None,
            dp.to(ctx.weights_dtype) if needs[1] else None,
            dw1 if needs[2] and acc_gate_up is None else None,
            dw2 if needs[3] and acc_down is None else None, None, None, None, None)


fused_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- blockwise FP8 (docs/fp8.md) --------------------------------------------------------
# The ops take the weights' FP8 copies as inputs (values, values^T, scales of w_gate_up and
# of w_down), so that a traced or captured graph sees them; forward_fp8 says whether the
# forward runs in FP8 ("fp8") or in bf16 with an FP8 backward ("fp8_bwd").


@functools.lru_cache(maxsize=64)
def fp8_workspace_bytes(T: int, k: int, H: int, I: int, E: int) -> int:
    return _lib.call_for_size("megamoe_fused_fp8_workspace_size", T, k, H, I, E)


@functools.lru_cache(maxsize=64)
def fp8_backward_workspace_bytes(T: int, k: int, H: int, I: int, E: int, h_saved: bool,
                                 forward_fp8: bool) -> int:
    return _lib.call_for_size("megamoe_fused_fp8_backward_workspace_size", T, k, H, I, E,
                              int(h_saved), int(forward_fp8))


@torch.library.custom_op("megamoe::fused_moe_fp8_forward", mutates_args=())
def fused_moe_fp8_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                          w_down: Tensor, gate_up_q: Tensor, gate_up_q_t: Tensor,
                          gate_up_scales: Tensor, down_q: Tensor, down_q_t: Tensor,
                          down_scales: Tensor, forward_fp8: bool, save_h: bool,
                          acc_gate_up: Optional[Tensor], acc_down: Optional[Tensor],
                          output: bool = True) -> tuple[Tensor, Tensor]:
    """As fused_moe_forward, in FP8 when forward_fp8 (else the bf16 forward, whose backward
    runs in FP8)."""
    if not forward_fp8:
        return fused_moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, save_h,
                                 acc_gate_up, acc_down, output)
    T, k, H, I, E = _sizes(x, topk_ids, w_gate_up)
    y, h = _outputs(x, T, k, I, save_h, output)
    if not output and not save_h:
        return y, h
    with torch.cuda.device(x.device):
        nbytes = fp8_workspace_bytes(T, k, H, I, E)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q,
                                        gate_up_scales, down_q, down_scales)]
        d.append(_lib.describe(y) if output else None)
        d.append(_lib.describe(h) if save_h else None)
        _lib.call("megamoe_fused_fp8_forward", *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, _lib.stream(x.device))
    return y, h


@fused_moe_fp8_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
      down_q, down_q_t, down_scales, forward_fp8, save_h, acc_gate_up, acc_down, output=True):
    T, k, _, I, _ = _sizes(x, topk_ids, w_gate_up)
    return torch.empty_like(x), (x.new_empty((T * k, 2 * I)) if save_h else _empty_h(x))


@torch.library.custom_op("megamoe::fused_moe_fp8_backward",
                         mutates_args=("acc_gate_up", "acc_down"))
def fused_moe_fp8_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                           w_gate_up: Tensor, w_down: Tensor, gate_up_q: Tensor,
                           gate_up_q_t: Tensor, gate_up_scales: Tensor, down_q_t: Tensor,
                           down_scales: Tensor, forward_fp8: bool, saved_h: Tensor,
                           needs: list[bool], acc_gate_up: Optional[Tensor],
                           acc_down: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As fused_moe_backward, with the backward's GEMMs in FP8."""
    T, k, H, I, E = _sizes(x, topk_ids, w_gate_up)
    h_saved = saved_h.numel() > 0
    grads, targets, needs = _gradient_buffers(x, topk_ids, w_gate_up, w_down, needs,
                                              acc_gate_up, acc_down)
    with torch.cuda.device(x.device):
        nbytes = fp8_backward_workspace_bytes(T, k, H, I, E, h_saved, forward_fp8)
        workspace = _lib.workspace(nbytes, x.device)
        d = [_lib.describe(t) for t in (dy, x, topk_ids, topk_weights, w_gate_up, w_down,
                                        gate_up_q, gate_up_q_t, gate_up_scales, down_q_t,
                                        down_scales)]
        tail = [_lib.describe(saved_h) if h_saved else None]
        tail += [_lib.describe(t) if need else None for t, need in zip(targets, needs)]
        _lib.call("megamoe_fused_fp8_backward", *(_lib.ref(v) for v in d), int(forward_fp8),
                  *(_lib.ref(v) for v in tail), ctypes.c_void_p(workspace.data_ptr()), nbytes,
                  _lib.stream(x.device))
    return tuple(grads)


@fused_moe_fp8_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
      down_q_t, down_scales, forward_fp8, saved_h, needs, acc_gate_up, acc_down):
    return tuple(grad_outputs(x, topk_ids, w_gate_up, w_down, needs, acc_gate_up, acc_down))


def _setup_context_fp8(ctx, inputs, output):
    (x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
     _down_q, down_q_t, down_scales, forward_fp8, _, acc_gate_up, acc_down, *_) = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)
    ctx.weights_dtype = topk_weights.dtype
    ctx.forward_fp8 = forward_fp8
    ctx.fp8_weights = (weakref.ref(w_gate_up), weakref.ref(w_down))
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t,
                          gate_up_scales, down_q_t, down_scales, h, acc_gate_up, acc_down)


def _backward_fp8(ctx, dy, _dh):
    (x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_q, gate_up_q_t, gate_up_scales,
     down_q_t, down_scales, h, acc_gate_up, acc_down) = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    dx, dp, dw1, dw2 = fused_moe_fp8_backward(
        dy.to(x.dtype).contiguous(), x, topk_ids, topk_weights.float().contiguous(), w_gate_up,
        w_down, gate_up_q, gate_up_q_t, gate_up_scales, down_q_t, down_scales, ctx.forward_fp8,
        h, needs, acc_gate_up, acc_down)
    _release_fp8_copies(ctx.fp8_weights)
    return (dx if needs[0] else None, None,
            dp.to(ctx.weights_dtype) if needs[1] else None,
            dw1 if needs[2] and acc_gate_up is None else None,
            dw2 if needs[3] and acc_down is None else None) + (None,) * 11


fused_moe_fp8_forward.register_autograd(_backward_fp8, setup_context=_setup_context_fp8)

@torch.library.custom_op("megamoe::quantize_fp8_weight", mutates_args=())
def quantize_fp8_weight(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(values, values^T, scales) of a bf16 weight [E, N, K] in 128 x 128 blocks."""
    from .weight_cache import default_quantizer
    copy = default_quantizer(weight, True)
    return copy.values, copy.values_t, copy.scales


@quantize_fp8_weight.register_fake
def _(weight):
    E, N, K = weight.shape
    return (weight.new_empty((E, N, K), dtype=torch.float8_e4m3fn),
            weight.new_empty((E, K, N), dtype=torch.float8_e4m3fn),
            weight.new_empty((E, N // 128, K // 128), dtype=torch.float32))


def _fp8_copy(weight: Tensor):
    """The weight's FP8 copy (values, values^T, scales): from the process-wide cache
    (quantized once per optimizer step), or made afresh inside a torch.compile graph or a
    CUDA graph being captured, so that every run of the graph quantizes the weights it is
    given (a cached copy would be baked in)."""
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        from .weight_cache import QuantizedWeight
        values, values_t, scales = quantize_fp8_weight(weight.detach())
        return QuantizedWeight(values, scales, values_t)
    from .weight_cache import shared_cache
    return shared_cache().get(weight, transposed=True)


def _release_fp8_copies(weights) -> None:
    """After a backward, drops its weights' cached copies when the cache is set to
    (Fp8WeightCache.release_after_backward): the backward was their last use before the
    optimizer changes the weights."""
    from . import weight_cache
    cache = weight_cache._shared
    if cache is None or not cache.release_after_backward or torch.compiler.is_compiling():
        return
    for ref in weights:
        weight = ref()
        if weight is not None:
            cache.invalidate(weight)


def fused_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
              w_down: Tensor, backward_mode: str = "recompute",
              weight_grad_accumulators: tuple[Tensor, Tensor] | None = None,
              precision: str = "bf16") -> Tensor:
    """The fused layer on one GPU, differentiable; h is kept only in the "saved" mode and
    only when a backward can follow. precision: "bf16", "fp8" or "fp8_bwd"."""
    save_h = keeps_h(backward_mode, x, topk_weights, w_gate_up, w_down)
    acc_gate_up, acc_down = weight_grad_accumulators or (None, None)
    output = _outputs_wanted()
    if precision == "bf16":
        y, _ = fused_moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, save_h,
                                 acc_gate_up, acc_down, output)
        return y
    gate_up, down = _fp8_copy(w_gate_up), _fp8_copy(w_down)
    y, _ = fused_moe_fp8_forward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up.values,
                                 gate_up.values_t, gate_up.scales, down.values, down.values_t,
                                 down.scales, precision == "fp8", save_h, acc_gate_up, acc_down,
                                 output)
    return y
