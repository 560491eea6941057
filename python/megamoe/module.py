"""`megamoe.MoE`: a Qwen3-MoE style sparse block (router + experts) as an nn.Module."""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validate import BACKENDS
from .errors import MegaMoEError
from .ops import moe


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Softmax over experts in float32, top-k, optional renormalisation (as Qwen3-MoE's
    `norm_topk_prob`). Returns (topk_ids int64 [T, k], topk_weights float32 [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights


class MoE(nn.Module):
    """Router + experts, weights in the Hugging Face transformers 5.x layout.

    Holds `gate` (the router, [E_total, H]), `w_gate_up` [E_local, 2I, H] and `w_down`
    [E_local, H, I]. With an expert-parallel `group` of W ranks, E_local = num_experts / W and
    this rank holds experts [rank*E_local, (rank+1)*E_local); the router is replicated.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, norm_topk_prob: bool = True, group=None, buffer=None, backend: str = "fused",
                 precision: str = "bf16", device=None, dtype=None):
        super().__init__()
        if backend not in BACKENDS:
            raise MegaMoEError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        world = 1 if group is None else torch.distributed.get_world_size(group)
        if num_experts % world:
            raise MegaMoEError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                               f"group size {world}")
        if not 1 <= top_k <= num_experts:
            raise MegaMoEError(f"top_k: expected 1 <= top_k <= num_experts={num_experts}, got {top_k}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.group, self.buffer, self.backend, self.precision = group, buffer, backend, precision
        local = num_experts // world
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, **factory))
        self.w_down = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Unit-variance activations in, unit-variance out of each linear layer.
        nn.init.normal_(self.w_gate_up, std=1 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(self.intermediate_size))
        self.gate.reset_parameters()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        topk_ids, topk_weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        y = moe(x.contiguous(), topk_ids, topk_weights, self.w_gate_up, self.w_down,
                group=self.group, buffer=self.buffer, precision=self.precision, backend=self.backend)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, backend={self.backend!r}, "
                f"precision={self.precision!r}")
