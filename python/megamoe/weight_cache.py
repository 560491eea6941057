"""Expert weights quantized once per optimizer step, not once per layer call.

`Fp8WeightCache.get(w_gate_up)` returns the 128 x 128-block FP8 copy of a weight (the recipe
of megamoe.fp8): made on the first call, reused while the weight is unchanged. One copy
serves the forward, the L1 recompute and the dgrad: a 128 x 128 tile's scale is the same for
W and W^T. The values themselves are laid out for one orientation; Hopper's FP8 MMA reads
both operands K-major, so a GEMM that contracts over W's rows (the dgrad) reads W^T's
values, which `get(w, transposed=True)` adds to the entry (W^T bit for bit, same scales).

Memory, per layer (E experts, hidden H, intermediate I; bf16 weights take 2 bytes/value):
    w_gate_up [E, 2I, H] and w_down [E, H, I]: E*2I*H + E*H*I bytes of e4m3 values,
    plus 4 bytes per 128 x 128 tile of scales (E*(2I/128)*(H/128) + E*(H/128)*(I/128)
    floats), i.e. half the bf16 weights' memory; the transposed copies add as much again.
    qwen3-30b-a3b (E=128, H=2048, I=768): 576 MiB per layer, 1152 MiB with W^T.

When a copy goes stale (the next `get` quantizes again):
- the weight's version counter moved (an in-place update through autograd-visible ops:
  torch.optim's for-loop and foreach steps, `p.copy_()` under no_grad, load_state_dict);
- any torch.optim optimizer finished a step (a global step hook; fused optimizers, e.g.
  AdamW(fused=True), update the weights without moving their version counters);
- its storage, shape, dtype, device or strides changed (`p.data = ...`).
What it cannot see: writes through `p.data` or a `.detach()`ed alias outside an optimizer
step (they bypass the version counter); call `invalidate()` after those.

Training that is short of memory can set `release_after_backward` (the trainer does in its
FP8 precisions): the fused layer's backward then drops its weights' copies, its last use of
them before the optimizer step. At the end of a backward every layer's copies would
otherwise still be held next to all the gradients, which is where a step's memory peaks
(12.4 GB at 11 layers of qwen3-30b-a3b). The cost: a forward after a backward without an
optimizer step between them (the next micro-batch of gradient accumulation) quantizes
again, about one read of the bf16 weights and one write of their copies.

Entries are keyed on the weight object itself (pass the nn.Parameter, not `.data` or a
view, which are new objects on every access) and hold it only weakly: when the parameter
dies its copy is dropped, and no copy outlives its weight.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import fp8


class QuantizedWeight(NamedTuple):
    """The FP8 copy of a weight [E, N, K]."""

    values: torch.Tensor                # [E, N, K] e4m3
    scales: torch.Tensor                # [E, N/128, K/128] fp32, the scale of tile (i, j)
    values_t: Optional[torch.Tensor]    # [E, K, N] e4m3 = values^T, when asked for

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


# (weight [E, N, K], transposed) -> QuantizedWeight; the default picks the CUDA kernel for
# bf16 CUDA weights and the reference quantizer otherwise (the same bits).
Quantizer = Callable[[torch.Tensor, bool], QuantizedWeight]


def default_quantizer(weight: torch.Tensor, transposed: bool) -> QuantizedWeight:
    if weight.is_cuda and weight.dtype == torch.bfloat16:
        from . import _fp8_kernels
        q, q_t, scales = _fp8_kernels.quantize_128x128(weight.detach(), transposed=transposed)
        return QuantizedWeight(q, scales, q_t)
    q, scales = fp8.quantize_128x128(weight.detach())
    return QuantizedWeight(q, scales, _transposed(q) if transposed else None)


def _transposed(q: torch.Tensor) -> torch.Tensor:
    return q.transpose(-2, -1).contiguous()


def _layout(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)


def _version(weight: torch.Tensor) -> Optional[int]:
    try:
        return weight._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


@dataclass
class _Entry:
    ref: weakref.ref
    version: int
    layout: tuple
    copy: QuantizedWeight


class Fp8WeightCache:
    """Quantized copies of weights, each made once while its weight is unchanged.

    Args:
        quantize: the quantizer (see `Quantizer`); the default is `default_quantizer`.
        invalidate_on_optimizer_step: drop every copy when any torch.optim optimizer
            finishes a step (needed for fused optimizers; see the module docstring).
        release_after_backward: the fused layer's backward drops the copies of the
            weights it used (see the module docstring); an attribute, may be changed.
    """

    def __init__(self, quantize: Optional[Quantizer] = None, *,
                 invalidate_on_optimizer_step: bool = True,
                 release_after_backward: bool = False):
        self._quantize = quantize or default_quantizer
        self.release_after_backward = release_after_backward
        self._entries: dict[int, _Entry] = {}
        self.hits = 0
        self.misses = 0
        self._hook = None
        if invalidate_on_optimizer_step:
            me = weakref.ref(self)

            def after_step(optimizer, args, kwargs):
                cache = me()
                if cache is not None:
                    cache.invalidate()

            self._hook = register_optimizer_step_post_hook(after_step)

    def __del__(self):
        if self._hook is not None:
            self._hook.remove()

    def get(self, weight: torch.Tensor, *, transposed: bool = False) -> QuantizedWeight:
        """The FP8 copy of `weight` [E, N, K] (N and K multiples of 128), with W^T's values
        in `values_t` when `transposed`."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
        if weight.dim() != 3:
            raise ValueError(f"weight: expected 3 dimensions [E, N, K], got shape {list(weight.shape)}")
        key = id(weight)
        version = _version(weight)
        entry = self._entries.get(key)
        if (entry is not None and entry.ref() is weight and version is not None
                and entry.version == version and entry.layout == _layout(weight)):
            self.hits += 1
            if transposed and entry.copy.values_t is None:
                entry.copy = entry.copy._replace(values_t=_transposed(entry.copy.values))
            return entry.copy
        self.misses += 1
        copy = self._quantize(weight, transposed)
        if version is not None:
            self._entries[key] = _Entry(self._dropper(key, weight), version, _layout(weight), copy)
        return copy

    def _dropper(self, key: int, weight: torch.Tensor) -> weakref.ref:
        entries = self._entries

        def drop(ref):
            entry = entries.get(key)
            if entry is not None and entry.ref is ref:
                del entries[key]

        return weakref.ref(weight, drop)

    def invalidate(self, weight: Optional[torch.Tensor] = None) -> None:
        """Drops the copy of `weight`, or every copy when None."""
        if weight is None:
            self._entries.clear()
        else:
            entry = self._entries.get(id(weight))
            if entry is not None and entry.ref() is weight:
                del self._entries[id(weight)]

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Device memory the cached copies hold."""
        return sum(entry.copy.nbytes() for entry in self._entries.values())


_shared: Optional[Fp8WeightCache] = None


def shared_cache() -> Fp8WeightCache:
    """The process-wide cache the fused layer's FP8 precisions take their weights from."""
    global _shared
    if _shared is None:
        _shared = Fp8WeightCache()
    return _shared
