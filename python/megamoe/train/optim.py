"""AdamW, the learning-rate schedule (linear warm-up, then cosine / linear / no decay to
min_lr_ratio * lr) and gradient clipping by the global norm over every rank."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from .config import OptimConfig


def build_optimizer(params, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    implementation = optim.implementation
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
             "for_loop": {"foreach": False}}[implementation]
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay, **flags)


def warmup_decay(step: int, *, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """LambdaLR factor of step s (0-based: the factor used by optimizer step s + 1):
    (s + 1) / warmup during warm-up, then the decay from 1 to min_ratio over the remaining
    steps of `total`, and min_ratio after."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup + 1) / span)
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer, optim: OptimConfig, train_steps: int):
    """The schedule's shape comes from the config (a partial: LambdaLR saves no settings of
    it), its position (the step count) from a checkpoint."""
    factor = functools.partial(warmup_decay, warmup=optim.warmup_steps,
                               total=optim.decay_steps or train_steps, decay=optim.decay,
                               min_ratio=optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _local_and_share(grad: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The part of `grad` this rank holds, and the fraction of the global sum it counts for:
    shards partition a tensor over their mesh dimension, replicas repeat it."""
    if not isinstance(grad, DTensor):
        return grad, 1.0 / (dist.get_world_size() if dist.is_initialized() else 1)
    share = 1.0
    for size, placement in zip(grad.device_mesh.mesh.shape, grad.placements):
        if isinstance(placement, Replicate):
            share /= size
    return grad.to_local(), share


@torch.no_grad()
def grad_norm(params) -> torch.Tensor | None:
    """Global L2 norm of the gradients, or None when no parameter has one. Dense gradients
    are sharded over every rank and experts gradients over (dp, ep), so each rank adds its
    local shards' squares and one all-reduce over the world gives the total; this also works
    where the gradients live on different meshes (the dense and the experts ones under EP),
    which torch.nn.utils.clip_grad_norm_ cannot combine."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    locals_, shares = zip(*(_local_and_share(g) for g in grads))
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in locals_])
    # Grouped by share, so the weights stay Python numbers (a tensor of them would be a
    # host-to-device copy that waits for the backward).
    by_share: dict[float, list[torch.Tensor]] = {}
    for norm_, share in zip(norms, shares):
        by_share.setdefault(share, []).append(norm_)
    total = sum(torch.stack(group).square().sum() * share for share, group in by_share.items())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def _clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (before clipping, see grad_norm), and clips them to
    max_norm when it is > 0."""
    params = list(params)
    norm = grad_norm(params)
    if norm is None:
        return torch.zeros(())
    if max_norm > 0:
        grads = [_local_and_share(p.grad)[0] for p in params if p.grad is not None]
        torch._foreach_mul_(grads, _clip_coefficient(norm, max_norm))
    return norm


def _takes_grad_scale(optimizer) -> bool:
    # torch's fused Adam/AdamW kernels divide every gradient by the optimizer's
    # `grad_scale` tensor (the attribute GradScaler sets for optimizers that declare
    # _step_supports_amp_scaling) inside the kernel that reads them anyway; the foreach and
    # for-loop implementations refuse it.
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and bool(optimizer.defaults.get("fused"))
            and getattr(optimizer, "_step_supports_amp_scaling", False))


@torch.no_grad()
def clip_and_step(optimizer, params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm(params, max_norm) then optimizer.step(); returns the norm before
    clipping. With a fused AdamW the clipping rides in the step: its grad_scale is set to
    1 / clip coefficient for this step (and reset after), which saves a separate read and
    write of every gradient; the result equals clip-then-step to rounding (the kernel
    divides by the reciprocal instead of multiplying)."""
    if hasattr(optimizer, "clip_and_step"):  # mixed_precision.MasterAdamW
        return optimizer.clip_and_step(max_norm)
    params = list(params)
    if max_norm <= 0 or not _takes_grad_scale(optimizer):
        norm = clip_grad_norm(params, max_norm)
        optimizer.step()
        return norm
    norm = grad_norm(params)
    if norm is None:
        optimizer.step()
        return torch.zeros(())
    optimizer.grad_scale = 1.0 / _clip_coefficient(norm, max_norm)
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None
    return norm
