"""Fp8WeightCache on the CPU with the reference quantizer: hits while a weight is
unchanged, misses after in-place updates and optimizer steps (fused ones included), no copy
left behind when a parameter dies."""

import gc
import weakref

import pytest
import torch

from megamoe import fp8
from megamoe.weight_cache import Fp8WeightCache, QuantizedWeight, default_quantizer
from moe_testing import BASE_SEED


def _param(E=2, N=256, K=128, seed=0):
    g = torch.Generator().manual_seed(BASE_SEED + seed)
    return torch.nn.Parameter(torch.randn(E, N, K, generator=g).to(torch.bfloat16))


class CountingQuantizer:
    def __init__(self):
        self.calls = 0

    def __call__(self, weight, transposed):
        self.calls += 1
        return default_quantizer(weight, transposed)


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _matches_reference(copy, weight):
    q, s = fp8.quantize_128x128(weight.detach())
    return _same_bits(copy.values, q) and torch.equal(copy.scales, s)


def test_hit_while_unchanged_then_miss_after_in_place_update():
    quantize = CountingQuantizer()
    cache = Fp8WeightCache(quantize)
    w = _param()
    first = cache.get(w)
    assert isinstance(first, QuantizedWeight) and _matches_reference(first, w)
    assert cache.get(w) is first and cache.get(w) is first  # micro-batches of one step
    assert (cache.hits, cache.misses, quantize.calls) == (2, 1, 1)
    with torch.no_grad():
        w.mul_(-2)
    second = cache.get(w)
    assert second is not first and quantize.calls == 2 and _matches_reference(second, w)
    assert not _same_bits(second.values, first.values)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD([p], lr=0.5),
    lambda p: torch.optim.SGD([p], lr=0.5, foreach=True),
    lambda p: torch.optim.AdamW([p], lr=0.5, fused=True),  # leaves p._version unchanged
])
def test_an_optimizer_step_makes_a_new_copy(make):
    cache = Fp8WeightCache()
    w = _param(seed=1)
    opt = make(w)
    first = cache.get(w)
    w.grad = torch.ones_like(w)
    opt.step()
    second = cache.get(w)
    assert cache.misses == 2 and second is not first and _matches_reference(second, w)


def test_without_the_step_hook_the_version_counter_still_counts():
    cache = Fp8WeightCache(invalidate_on_optimizer_step=False)
    w = _param(seed=2)
    first = cache.get(w)
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=0.5).step()
    assert cache.get(w) is not first and _matches_reference(cache.get(w), w)


def test_no_copy_outlives_its_parameter():
    cache = Fp8WeightCache()
    w = _param(seed=3)
    values = weakref.ref(cache.get(w).values)
    assert len(cache) == 1
    del w
    gc.collect()
    assert len(cache) == 0 and values() is None
    # A new parameter, possibly at the dead one's id, gets its own copy.
    w2 = _param(seed=4)
    assert _matches_reference(cache.get(w2), w2) and cache.misses == 2


def test_replaced_storage_and_explicit_invalidation():
    cache = Fp8WeightCache()
    w = _param(seed=5)
    first = cache.get(w)
    w.data = _param(seed=6).data  # bypasses the version counter, changes the storage
    assert cache.get(w) is not first and _matches_reference(cache.get(w), w)
    third = cache.get(w)
    with torch.no_grad():
        w.detach().zero_()  # an alias write; the version counter is shared with detach()
    assert cache.get(w) is not third
    fourth = cache.get(w)
    w.data.add_(1)  # .data has its own version counter: invisible to the cache
    assert cache.get(w) is fourth
    cache.invalidate(w)
    assert cache.get(w) is not fourth and _matches_reference(cache.get(w), w)


def test_transposed_values_share_the_scales():
    cache = Fp8WeightCache()
    w = _param(E=3, N=256, K=384, seed=7)
    direct = cache.get(w)
    assert direct.values_t is None
    both = cache.get(w, transposed=True)  # added to the entry, not requantized
    assert cache.misses == 1 and both.values is direct.values
    q_t, s_t = fp8.quantize_128x128(w.detach().transpose(-2, -1).contiguous())
    assert _same_bits(both.values_t, q_t) and torch.equal(both.scales.transpose(-2, -1), s_t)
    assert cache.get(w).values_t is both.values_t
    E, N, K = w.shape
    scales = E * (N // 128) * (K // 128) * 4
    assert cache.nbytes() == 2 * E * N * K + scales


def test_separate_weights_separate_entries_and_bad_input():
    cache = Fp8WeightCache()
    a, b = _param(seed=8), _param(seed=9)
    assert not _same_bits(cache.get(a).values, cache.get(b).values) and len(cache) == 2
    cache.invalidate()
    assert len(cache) == 0
    with pytest.raises(ValueError, match=r"weight: expected 3 dimensions \[E, N, K\]"):
        cache.get(torch.zeros(128, 128))
