"""Random inputs of one layer call for the profiling tools (imported from tools/)."""

import torch

from megamoe.routing import make_routing


def layer_inputs(shape, tokens: int, experts: int | None = None, seed: int = 0,
                 requires_grad: bool = True, routing: str = "random"):
    """x [T, H], topk_ids and topk_weights over all shape.E experts (`routing`: a mode of
    megamoe.routing.make_routing, random by default),
    w_gate_up and w_down of `experts` local experts (default: all), dy [T, H]; bf16 on the
    current CUDA device. With requires_grad, x, the weights and topk_weights need grads."""
    experts = shape.E if experts is None else experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, shape.H, device="cuda", dtype=torch.bfloat16, generator=g)
    w_gate_up = torch.randn(experts, 2 * shape.I, shape.H, device="cuda", dtype=torch.bfloat16,
                            generator=g) * shape.H ** -0.5
    w_down = torch.randn(experts, shape.H, shape.I, device="cuda", dtype=torch.bfloat16,
                         generator=g) * shape.I ** -0.5
    ids, weights = make_routing(tokens, shape.E, shape.k, routing, device="cuda", generator=g)
    dy = torch.randn_like(x)
    if requires_grad:
        for t in (x, weights, w_gate_up, w_down):
            t.requires_grad_(True)
    return x, ids, weights, w_gate_up, w_down, dy
