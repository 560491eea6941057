"""Synthetic router outputs (top-k expert ids and weights) for benchmarks and tests.

Every mode gives each token k *distinct* experts, as a real top-k router does, and
weights that are a softmax over the token's k chosen logits (positive, summing to 1).

Modes:
- "random":   a top-k over i.i.d. standard-normal logits: every k-subset of experts is
              equally likely, so expert loads are binomial around T*k/E.
- "balanced": every expert gets floor(T*k/E) or ceil(T*k/E) slots, the ideal load a
              load-balancing loss aims for; which experts share a token is random.
- "skewed":   expert e has popularity p_e ~ 1/(rank_e + 1)**SKEW_EXPONENT, with the
              ranks a random permutation of the experts (so "hot" experts are not always
              the low ids, and under EP they land on random ranks). Each token draws k
              experts without replacement with probabilities p (Gumbel top-k), so the
              hottest expert can receive up to one slot from every token.

Random numbers are drawn on the generator's device (the default generator of `device`
when none is given) and the results moved to `device`; a CPU generator therefore gives
the same routing whatever `device` is.
"""

from __future__ import annotations

import math

import torch

ROUTING_MODES = ("random", "balanced", "skewed")

# Exponent of the Zipf-like popularity of "skewed". With E=128, k=8 the hottest expert
# gets about 15x the mean load (a slot from ~95% of tokens) and the coldest ~0.1x; with
# E=8, k=2 about 2.8x and 0.3x. A badly balanced router looks like this early in training.
SKEW_EXPONENT = 1.2


def make_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    mode: str = "random",
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_ids int32 [T, k], topk_weights [T, k] in weights_dtype)."""
    _check_arguments(num_tokens, num_experts, topk, mode)
    draw_device = generator.device if generator is not None else torch.device(device)

    if mode == "random":
        ids, logits = _random_topk(num_tokens, num_experts, topk, draw_device, generator)
    elif mode == "balanced":
        ids, logits = _balanced_topk(num_tokens, num_experts, topk, draw_device, generator)
    else:
        ids, logits = _skewed_topk(num_tokens, num_experts, topk, draw_device, generator)

    weights = torch.softmax(logits.float(), dim=-1).to(weights_dtype)
    return ids.to(device=device, dtype=torch.int32), weights.to(device)


def _check_arguments(num_tokens: int, num_experts: int, topk: int, mode: str) -> None:
    if mode not in ROUTING_MODES:
        raise ValueError(f"unknown routing mode {mode!r}; valid modes: {', '.join(ROUTING_MODES)}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if topk > num_experts:
        raise ValueError(
            f"topk ({topk}) must not exceed num_experts ({num_experts}): "
            "each token needs k distinct experts"
        )


def _random_topk(T, E, k, device, generator):
    logits = torch.randn(T, E, device=device, generator=generator)
    chosen_logits, ids = logits.topk(k, dim=-1)
    return ids, chosen_logits


def _balanced_topk(T, E, k, device, generator):
    # Lay the T*k slots out in order and give slot s the expert perm[s % E]: consecutive
    # slots are distinct as long as k <= E, so every token gets distinct experts, and the
    # loads are floor/ceil(T*k/E). To avoid every token sharing one fixed cyclic order, a
    # fresh permutation is drawn per block of tokens whose slots cover a whole number of
    # cycles (block_tokens*k = lcm(E, k)), so each full block adds exactly the same load to
    # every expert and only the last, partial block decides who gets the extra slots.
    block_tokens = E // math.gcd(E, k)
    num_blocks = max(1, -(-T // block_tokens))
    perms = torch.rand(num_blocks, E, device=device, generator=generator).argsort(dim=-1)

    token = torch.arange(T, device=device).unsqueeze(1)
    slot = torch.arange(k, device=device).unsqueeze(0)
    position_in_cycle = ((token % block_tokens) * k + slot) % E
    ids = perms[token // block_tokens, position_in_cycle]

    logits = torch.randn(T, k, device=device, generator=generator)
    return ids, logits


def _skewed_topk(T, E, k, device, generator):
    expert_rank = torch.rand(E, device=device, generator=generator).argsort()
    log_popularity = -SKEW_EXPONENT * torch.log1p(expert_rank.float())
    # Gumbel top-k: top-k of log(p) + Gumbel noise is a draw of k experts without
    # replacement with probabilities p. -log(Exp(1)) is a standard Gumbel variable.
    exponential = torch.empty(T, E, device=device).exponential_(generator=generator)
    scores = log_popularity - exponential.log()
    chosen_scores, ids = scores.topk(k, dim=-1)
    return ids, chosen_scores
