"""Synthetic routing (megamoe.routing.make_routing): shapes, distinct experts per token,
loads per mode, and argument errors."""

import pytest
import torch

from megamoe.routing import ROUTING_MODES, make_routing


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _loads(ids, num_experts):
    return torch.bincount(ids.flatten().long(), minlength=num_experts)


def _assert_distinct_per_token(ids):
    sorted_ids = ids.sort(dim=1).values
    assert not (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(), "a token got the same expert twice"


@pytest.mark.parametrize("mode", ROUTING_MODES)
@pytest.mark.parametrize("T,E,k", [(1000, 8, 2), (333, 6, 4), (77, 5, 5), (50, 128, 8), (9, 3, 1)])
def test_shapes_dtypes_distinct_and_weights(mode, T, E, k):
    ids, weights = make_routing(T, E, k, mode, generator=_generator())
    assert ids.shape == (T, k) and ids.dtype == torch.int32
    assert weights.shape == (T, k) and weights.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < E
    _assert_distinct_per_token(ids)
    assert (weights > 0).all()
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(T), atol=1e-5, rtol=0)


@pytest.mark.parametrize("T,E,k", [(1000, 8, 2), (333, 6, 4), (77, 5, 5), (50, 128, 8), (1, 7, 3),
                                   (4097, 128, 8)])
def test_balanced_loads_differ_by_at_most_one(T, E, k):
    ids, _ = make_routing(T, E, k, "balanced", generator=_generator(1))
    loads = _loads(ids, E)
    assert int(loads.sum()) == T * k
    assert int(loads.min()) == T * k // E
    assert int(loads.max()) == -(-T * k // E)


def test_balanced_is_not_one_fixed_pattern():
    ids, _ = make_routing(4096, 128, 8, "balanced", generator=_generator(2))
    distinct_sets = {tuple(sorted(row)) for row in ids.tolist()}
    assert len(distinct_sets) > 1000


def test_random_loads_are_near_uniform():
    T, E, k = 16384, 128, 8
    ids, _ = make_routing(T, E, k, "random", generator=_generator(3))
    loads = _loads(ids, E).float()
    # Binomial(T*k, 1/E) has sd ~31 around the mean 1024: 20% is over 6 sd.
    assert (loads - T * k / E).abs().max() < 0.2 * T * k / E


@pytest.mark.parametrize("E,k,hot_factor", [(8, 2, 2.0), (128, 8, 8.0)])
def test_skewed_loads_are_skewed(E, k, hot_factor):
    T = 8192
    ids, _ = make_routing(T, E, k, "skewed", generator=_generator(4))
    loads = _loads(ids, E).float()
    mean = T * k / E
    assert loads.max() > hot_factor * mean
    assert loads.min() < 0.5 * mean


def test_skewed_hot_expert_changes_with_the_seed():
    hottest = {int(_loads(make_routing(2048, 64, 4, "skewed", generator=_generator(s))[0], 64).argmax())
               for s in range(8)}
    assert len(hottest) > 1, "the popularity ranks should be a random permutation of the experts"


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_same_seed_same_routing(mode):
    first = make_routing(100, 16, 4, mode, generator=_generator(5))
    second = make_routing(100, 16, 4, mode, generator=_generator(5))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_weights_dtype_and_zero_tokens():
    ids, weights = make_routing(10, 8, 2, weights_dtype=torch.bfloat16, generator=_generator())
    assert weights.dtype == torch.bfloat16
    ids, weights = make_routing(0, 8, 2, "balanced")
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


@pytest.mark.parametrize("args,message", [
    ((10, 4, 5, "random"), r"topk \(5\) must not exceed num_experts \(4\)"),
    ((10, 4, 0, "random"), r"topk must be >= 1, got 0"),
    ((-1, 4, 2, "random"), r"num_tokens must be >= 0, got -1"),
    ((10, 0, 1, "random"), r"num_experts must be >= 1, got 0"),
    ((10, 4, 2, "zipf"), r"unknown routing mode 'zipf'; valid modes: random, balanced, skewed"),
])
def test_argument_errors(args, message):
    with pytest.raises(ValueError, match=message):
        make_routing(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_generator_gives_the_same_routing_on_cuda():
    on_cpu = make_routing(64, 16, 4, "skewed", generator=_generator(6))
    on_cuda = make_routing(64, 16, 4, "skewed", device="cuda", generator=_generator(6))
    assert on_cuda[0].is_cuda
    assert torch.equal(on_cpu[0], on_cuda[0].cpu())
