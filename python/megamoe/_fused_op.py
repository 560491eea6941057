"""backend="fused" on one GPU as a torch custom op (forward only in this version)."""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from . import _lib


@functools.lru_cache(maxsize=64)
def workspace_bytes(T: int, k: int, H: int, I: int, E: int) -> int:
    size = ctypes.c_size_t()
    _lib.call("megamoe_fused_workspace_size", T, k, H, I, E, ctypes.byref(size))
    return size.value


@torch.library.custom_op("megamoe::fused_moe_forward", mutates_args=())
def fused_moe_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor,
                      w_down: Tensor) -> Tensor:
    T, H = x.shape
    k = topk_ids.shape[1]
    E, two_I, _ = w_gate_up.shape
    y = torch.empty_like(x)
    with torch.cuda.device(x.device):
        nbytes = workspace_bytes(T, k, H, two_I // 2, E)
        # The caching allocator hands out 512-byte aligned blocks; no initialisation needed.
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        d = [_lib.describe(t) for t in (x, topk_ids, topk_weights, w_gate_up, w_down, y)]
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _lib.call("megamoe_fused_forward", *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(workspace.data_ptr()), nbytes, ctypes.c_void_p(stream))
    return y


@fused_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down):
    return torch.empty_like(x)
