"""Mixed precision on one rank without FSDP2: the model's parameters are bf16 compute
copies, the optimizer steps fp32 master weights (`parallel.fsdp = "auto"` on one rank).

On one rank FSDP2 shards nothing, yet it still sends every parameter through its
all-gather (a cast of the fp32 shard into the gather buffer, a copy out of it) and every
gradient through its reduce-scatter (a cast into an fp32 buffer, the collective's copy out):
about 87 ms of the benchmark's step (docs/training.md). Here the same arithmetic takes one
cast each way: a bf16 gradient is cast into (over micro-batches: added to) its master's
fp32 gradient as soon as the backward has accumulated it, and after the optimizer step the
masters are cast back into the bf16 parameters. The numbers are FSDP2's at world size 1:
bf16 parameters rounded from the fp32 masters, bf16 gradients accumulated in fp32, routers
in fp32 with fp32 inputs. What it costs: the bf16 copies live through the whole step (2
bytes per parameter), where FSDP2 frees a layer's copy after its backward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_map


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _inputs_to_fp32(module, args, kwargs):
    return tree_map(_to_fp32, args), tree_map(_to_fp32, kwargs)


def _into_master(master: torch.Tensor, param: torch.Tensor) -> None:
    # A post-accumulate-grad hook: the bf16 gradient is freed at once, so no two gradient
    # copies of a parameter are ever held.
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)
    param.grad = None


def _place(root: nn.Module, name: str, value: torch.Tensor, *, parameter: bool) -> None:
    """Registers `value` in `root` under the dotted `name`, making empty modules on the way,
    so that `root`'s state dict has the model's names."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if leaf in module._parameters or leaf in module._buffers:
        raise KeyError(f"{name} is already registered")
    if parameter:
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)


class MasterWeights:
    """fp32 masters of `model`'s parameters, the model cast to `compute_dtype`.

    `fp32_modules` (the routers) keep fp32 parameters, which are their own masters, and get
    their floating-point inputs cast to fp32, like FSDP2's fp32 units. `module` holds the
    masters (and the model's persistent buffers) under the model's names: the optimizer
    steps `module.parameters()` and the checkpoints save `module`, so a checkpoint holds
    fp32 weights under transformers' names, as under FSDP2. Call `copy_to_model()` after
    every optimizer step and after loading a checkpoint into `module`.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype,
                 fp32_modules: list[nn.Module] = ()):
        keep = {id(p) for m in fp32_modules for p in m.parameters()}
        self.module = nn.Module()
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._handles = []
        names = set()
        for name, param in model.named_parameters():
            names.add(name)
            if (compute_dtype == torch.float32 or id(param) in keep
                    or not param.is_floating_point() or param.dtype == compute_dtype):
                _place(self.module, name, param, parameter=True)
                continue
            master = nn.Parameter(param.data, requires_grad=param.requires_grad)
            param.data = master.data.to(compute_dtype)
            _place(self.module, name, master, parameter=True)
            self.pairs.append((param, master))
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(
                    functools.partial(_into_master, master)))
        for name, buffer in model.state_dict(keep_vars=True).items():
            if name not in names:
                _place(self.module, name, buffer, parameter=False)
        if compute_dtype != torch.float32:
            for module in fp32_modules:
                self._handles.append(module.register_forward_pre_hook(_inputs_to_fp32,
                                                                      with_kwargs=True))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Rounds every master into its compute copy (one fused cast over all of them)."""
        if self.pairs:
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
