"""The layer's math (docs/design.md, "The layer") in plain PyTorch, at a chosen compute precision.

This is the oracle for CUDA tensors (float64 in tests, float32 behind backend="reference")
and mirrors the C++ CPU reference, which the tests check it against. Every sum over the
top-k slots is done in a fixed order (no atomics), so results are reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _routes(topk_ids: torch.Tensor, num_experts: int):
    """Slots grouped by expert: (slot order, per-expert counts as host ints, first valid).

    Slots with id -1 sort first and are skipped. One device-to-host copy of the counts:
    acceptable for a reference, never for a fast path.
    """
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    return order, counts[1:], counts[0]


def _expert_segments(topk_ids, num_experts):
    order, counts, start = _routes(topk_ids, num_experts)
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start:start + count]
        start += count


def forward(x, topk_ids, topk_weights, w_gate_up, w_down, compute_dtype=torch.float64):
    """y [T, H] in compute_dtype."""
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w_down.shape[2]
    x_c = x.to(compute_dtype)
    p = topk_weights.to(compute_dtype).reshape(-1)
    slot_out = torch.zeros(T * k, H, dtype=compute_dtype, device=x.device)
    for e, slots in _expert_segments(topk_ids, w_gate_up.shape[0]):
        h = x_c[slots // k] @ w_gate_up[e].to(compute_dtype).T
        a = F.silu(h[:, :I]) * h[:, I:]
        slot_out[slots] = (a @ w_down[e].to(compute_dtype).T) * p[slots, None]
    return slot_out.view(T, k, H).sum(dim=1)


def backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down, compute_dtype=torch.float64):
    """(dx, d_topk_weights, d_w_gate_up, d_w_down), all in compute_dtype."""
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w_down.shape[2]
    x_c = x.to(compute_dtype)
    dy_c = dy.to(compute_dtype)
    p = topk_weights.to(compute_dtype).reshape(-1)
    slot_dx = torch.zeros(T * k, H, dtype=compute_dtype, device=x.device)
    dp = torch.zeros(T * k, dtype=compute_dtype, device=x.device)
    d_w_gate_up = torch.zeros(w_gate_up.shape, dtype=compute_dtype, device=x.device)
    d_w_down = torch.zeros(w_down.shape, dtype=compute_dtype, device=x.device)
    for e, slots in _expert_segments(topk_ids, w_gate_up.shape[0]):
        tokens = slots // k
        wgu = w_gate_up[e].to(compute_dtype)
        wd = w_down[e].to(compute_dtype)
        xs, dys, ps = x_c[tokens], dy_c[tokens], p[slots, None]
        h = xs @ wgu.T
        g, u = h[:, :I], h[:, I:]
        silu_g = F.silu(g)
        a = silu_g * u
        dy_wd = dys @ wd                               # w_down^T dy, [n, I]
        dp[slots] = (dy_wd * a).sum(dim=1)             # <dy, o> without forming o
        da = ps * dy_wd
        sig = torch.sigmoid(g)
        dg = da * u * sig * (1 + g * (1 - sig))
        du = da * silu_g
        dh = torch.cat([dg, du], dim=1)
        d_w_down[e] = (ps * dys).T @ a
        d_w_gate_up[e] = dh.T @ xs
        slot_dx[slots] = dh @ wgu
    return slot_dx.view(T, k, H).sum(dim=1), dp.view(T, k), d_w_gate_up, d_w_down
