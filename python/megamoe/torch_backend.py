"""The baseline users run today, written the way TorchTitan writes it.

Permute token slots by expert, run both expert layers with `torch._grouped_mm`, SwiGLU in
between, and combine with the router weights; with an expert-parallel group, the counts are
exchanged with `all_to_all_single`, the host reads the split sizes (a device-to-host sync,
as TorchTitan does), and token rows travel with `all_to_all_single` (uneven splits) to the
ranks that own their experts and back. Autograd differentiates the whole graph.

This is the yardstick of every speedup megamoe claims, so it is the good version of the
baseline: one gather, two grouped GEMMs over all experts at once, a vectorised combine.
precision="fp8" runs the expert GEMMs as TorchTitan's FP8 does (torch_fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import torch_fp8
from .errors import MegaMoEError


def _grouped_experts(rows, counts, w_gate_up, w_down, precision="bf16"):
    """L1, SwiGLU, L2 over rows sorted by local expert; counts [E_local] int64."""
    if precision == "fp8":
        return torch_fp8.grouped_experts(rows, counts, w_gate_up, w_down)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    return torch._grouped_mm(a, w_down.transpose(-2, -1), offs=offsets)


def _inverse(permutation):
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _count_by_expert(experts, num_experts):
    # scatter_add instead of bincount keeps the output shape static for torch.compile.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, group=None, precision="bf16"):
    if precision == "fp8":
        torch_fp8.check_supported(x, w_gate_up)
    T, H = x.shape
    k = topk_ids.shape[1]
    E_local = w_gate_up.shape[0]
    world = 1 if group is None else torch.distributed.get_world_size(group)
    E = E_local * world

    # A slot with id -1 rides along on expert 0 with weight 0: it adds nothing to y, gets
    # dp = 0 and no weight gradient, and every shape stays static (no host sync at EP=1).
    flat_ids = topk_ids.reshape(-1).long()
    valid = flat_ids >= 0
    experts = torch.where(valid, flat_ids, torch.zeros_like(flat_ids))
    weights = topk_weights * valid.view(T, k).to(topk_weights.dtype)

    order = torch.argsort(experts, stable=True)
    counts = _count_by_expert(experts, E)
    rows = x[order // k]
    if world == 1:
        out = _grouped_experts(rows, counts, w_gate_up, w_down, precision)
    else:
        out = _expert_parallel(rows, counts, w_gate_up, w_down, group, world, E_local, precision)

    slot_out = out[_inverse(order)]
    y = (slot_out.view(T, k, H).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype)


_checked_groups: set = set()


def _check_same_layout(group, world, E_local, H, I, device):
    """Every rank must hold the same number of experts and sizes, or all_to_all hangs."""
    key = (id(group), E_local, H, I)
    if key in _checked_groups:
        return
    mine = torch.tensor([E_local, H, I], dtype=torch.int64, device=device)
    everyone = torch.empty(world * 3, dtype=torch.int64, device=device)
    torch.distributed.all_gather_into_tensor(everyone, mine, group=group)
    everyone = everyone.view(world, 3)
    if not bool((everyone == mine).all()):
        raise MegaMoEError("expert-parallel ranks disagree on [E_local, H, I]: "
                           f"{everyone.tolist()}; every rank must hold the same number of experts")
    _checked_groups.add(key)


def _expert_parallel(rows, counts, w_gate_up, w_down, group, world, E_local, precision):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    _check_same_layout(group, world, E_local, rows.shape[1], w_down.shape[2], rows.device)
    # recv_counts[s, e]: slots that rank s sends to my local expert e.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(world, E_local)
    send_splits = counts.view(world, E_local).sum(dim=1)
    recv_splits = recv_counts.sum(dim=1)
    splits = torch.cat([send_splits, recv_splits]).tolist()  # the host sync TorchTitan has
    input_splits, output_splits = splits[:world], splits[world:]

    received = all_to_all_single_autograd(rows, output_splits, input_splits, group)
    # Rows arrive grouped by (source rank, expert); the grouped GEMM wants (expert, source).
    segment = torch.arange(world * E_local, device=rows.device).view(world, E_local)
    expert_major_key = (segment % E_local) * world + segment // E_local
    row_key = torch.repeat_interleave(expert_major_key.reshape(-1), recv_counts.reshape(-1),
                                      output_size=sum(output_splits))
    by_expert = torch.argsort(row_key, stable=True)
    out = _grouped_experts(received[by_expert], recv_counts.sum(dim=0), w_gate_up, w_down,
                           precision)
    back = out[_inverse(by_expert)]
    return all_to_all_single_autograd(back, input_splits, output_splits, group)
