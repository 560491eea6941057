"""The one-pass AdamW step of megamoe.train.mixed_precision for CUDA tensors (Triton).

Per element it reads the fp32 master, its gradient (bf16 from the backward, or fp32 where
micro-batches were accumulated in fp32) and both fp32 moments, and writes the master, the
moments and the bf16 compute copy: 28 bytes per parameter from a bf16 gradient, the bytes
torch's fused AdamW moves from an fp32 one, without the casts before (gradient to fp32) and
after (master to bf16) that the step would otherwise need. The arithmetic is torch.optim's
AdamW (decoupled weight decay, bias corrections, eps added after the square root), with
the gradient multiplied by the clipping coefficient as it is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_step(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, scale_ptr, n,
                lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
                WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * tl.load(scale_ptr)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    param = param * decay
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * (exp_avg / denom)
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if WRITE_COPY:
        # bf16 by round-to-nearest-even on the bits (what torch's .to(bfloat16) does; NaN
        # stays a quiet NaN), spelled out so that it holds in Triton's interpreter too.
        bits = param.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(param != param, 0x7FC0, rounded)
        tl.store(copy_ptr + offsets, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, copy: torch.Tensor | None, scale: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               step: int) -> None:
    """One AdamW step of one contiguous fp32 tensor, in place; `copy` (bf16, or None)
    receives the new values; `scale` is a one-element fp32 CUDA tensor multiplying the
    gradient (the clipping coefficient), read on the device, so no host sync."""
    n = param.numel()
    if n == 0:
        return
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    grid = (triton.cdiv(n, BLOCK),)
    if copy is not None and copy.dtype != torch.bfloat16:
        raise TypeError(f"adamw_step: the copy must be bfloat16, got {copy.dtype}")
    copy_bits = copy.view(torch.int16) if copy is not None else param
    _adamw_step[grid](param, grad, exp_avg, exp_avg_sq, copy_bits,
                      scale, n, lr, beta1, beta2, eps, 1.0 - lr * weight_decay,
                      lr / bias_correction1, bias_correction2 ** 0.5,
                      WRITE_COPY=copy is not None, BLOCK=BLOCK, num_warps=8)
