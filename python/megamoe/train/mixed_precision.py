"""Mixed precision on one rank without FSDP2: the model's parameters are bf16 compute
copies, the optimizer steps fp32 master weights (`parallel.fsdp = "auto"` on one rank).

On one rank FSDP2 shards nothing, yet it still sends every parameter through its
all-gather (a cast of the fp32 shard into the gather buffer, a copy out of it) and every
gradient through its reduce-scatter (a cast into an fp32 buffer, the collective's copy out).
Here the bf16 gradients stay where the backward put them, and `MasterAdamW` reads them
there: on CUDA one pass per tensor reads the gradient, the fp32 master and both moments and
writes the master, the moments and the bf16 copy (megamoe.train._adamw_kernel), so a step
moves 28 bytes per parameter and no gradient is ever held in fp32. With gradient
accumulation the micro-batches' bf16 gradients are added into fp32 gradients of the
masters as the backward produces them, like FSDP2's fp32 reduction. The numbers are FSDP2's
at world size 1: bf16 parameters rounded from the fp32 masters, bf16 gradients taken in
fp32, routers in fp32 with fp32 inputs. What it costs: the bf16 copies live through the
whole step (2 bytes per parameter), where FSDP2 frees a layer's copy after its backward;
the fp32 gradients FSDP2 holds (4 bytes per parameter) are not needed.
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
    fp32 weights under transformers' names, as under FSDP2. A master's gradient is its
    compute copy's bf16 `.grad`, or with `accumulate_in_fp32` (gradient accumulation) its
    own fp32 `.grad`, into which every micro-batch's is added. `MasterAdamW` writes the
    copies in its step; call `copy_to_model()` after anything else writes the masters (a
    checkpoint load).
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype,
                 fp32_modules: list[nn.Module] = (), *, accumulate_in_fp32: bool = False):
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
            if param.requires_grad and accumulate_in_fp32:
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


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over the masters of `weights`, taking each gradient where it is
    (`gradient`) and writing the compute copies. Its state and state dict are AdamW's, so
    checkpoints move between this and FSDP2's torch AdamW. On CUDA each contiguous tensor
    takes one Triton pass; elsewhere (and for any other tensor) the gradients are cast to
    fp32 and torch's AdamW steps them, then the copies are cast (`implementation`
    'foreach' or 'for_loop' chooses torch's kernels for every tensor, on CUDA too). `clip_and_step(max_norm)` is clipping by the global norm and
    the step in one, the coefficient applied as the gradients are read."""

    def __init__(self, weights: MasterWeights, *, lr: float, betas, eps: float,
                 weight_decay: float, implementation: str = "auto"):
        params = [p for p in weights.module.parameters() if p.requires_grad]
        foreach = implementation != "for_loop"
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         foreach=foreach)
        self.weights = weights
        self._copy = {id(master): param for param, master in weights.pairs}
        self._scale = None
        self._kernel = implementation in ("auto", "fused")

    def gradient(self, master: torch.Tensor) -> torch.Tensor | None:
        if master.grad is not None:
            return master.grad
        copy = self._copy.get(id(master))
        return None if copy is None else copy.grad

    def _with_gradients(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]
                if self.gradient(p) is not None]

    @torch.no_grad()
    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Returns the gradients' global L2 norm before clipping (fp32, on the device)."""
        params = self._with_gradients()
        if not params:
            self.step()
            return torch.zeros(())
        grads = [self.gradient(p) for p in params]
        if any(g.dtype != torch.float32 for g in grads) and not (self._kernel and grads[0].is_cuda):
            # Without the kernel the norm is taken over the fp32 gradients the step will
            # use, as FSDP2's is: the same numbers, bit for bit.
            self._cast_gradients(params)
            grads = [p.grad for p in params]
        norm = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum().sqrt()
        if max_norm > 0:
            self._scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        try:
            self.step()
        finally:
            self._scale = None
        return norm

    def _cast_gradients(self, params) -> None:
        for p in params:
            if p.grad is None:
                p.grad = self.gradient(p).to(p.dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slow = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for master in group["params"]:
                grad = self.gradient(master)
                if grad is None:
                    continue
                if not (self._kernel and _fits_kernel(master, grad, self._copy.get(id(master)))):
                    slow.append(master)
                    continue
                state = self.state[master]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                if state["step"].device.type != "cpu":
                    state["step"] = state["step"].cpu()  # once, after loading a CUDA step
                state["step"] += 1
                scale = self._scale if self._scale is not None else _ones(master.device)
                adamw_step = _kernel()
                adamw_step(master, grad, state["exp_avg"], state["exp_avg_sq"],
                           self._copy.get(id(master)), scale.reshape(1), lr=float(group["lr"]),
                           beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], step=int(state["step"].item()))
        if slow:
            self._slow_step(slow)
        return loss

    def _slow_step(self, params) -> None:
        """torch's AdamW on fp32 gradients for `params` only, then their copies."""
        self._cast_gradients(params)
        if self._scale is not None:
            torch._foreach_mul_([p.grad for p in params], self._scale.to(params[0].device))
        chosen = {id(p) for p in params}
        groups = self.param_groups
        kept = [dict(g, params=[p for p in g["params"] if id(p) in chosen]) for g in groups]
        # AdamW.step walks self.param_groups; it is shown only these parameters.
        self.param_groups = [g for g in kept if g["params"]]
        try:
            super().step()
        finally:
            self.param_groups = groups
        pairs = [(self._copy[id(p)], p) for p in params if id(p) in self._copy]
        if pairs:
            torch._foreach_copy_([c for c, _ in pairs], [m for _, m in pairs])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for param, _ in self.weights.pairs:
            param.grad = None


def _fits_kernel(master: torch.Tensor, grad: torch.Tensor, copy) -> bool:
    tensors = [master, grad] + ([copy] if copy is not None else [])
    return (master.is_cuda and master.dtype == torch.float32 and grad.is_cuda
            and all(t.is_contiguous() and t.numel() == master.numel() for t in tensors)
            and grad.dtype in (torch.float32, torch.bfloat16, torch.float16))


@functools.cache
def _kernel():
    # Imported on first use: Triton is needed only for CUDA tensors.
    from ._adamw_kernel import adamw_step
    return adamw_step


@functools.cache
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)
