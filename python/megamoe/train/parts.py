"""The step's parts timed in isolation, at the training run's shapes, in its process:
one MoE decoder layer's attention (self_attn, with its q/k norms and RoPE), its router
(fp32, as trained), its experts (the configured implementation, fed by that router), and the
chunked LM head + cross-entropy over the micro-batch. Each is timed forward and
forward + backward (medians of repeated calls after warm-up; CUDA events on a GPU).

The modules come from a one-layer copy of the model made for this (bf16 weights where the
run computes in bf16, router fp32), without FSDP: these are the compute costs without the
all-gathers and reduce-scatters, which `other` (the step minus the parts) then holds. The
optimizer's time is measured inside the training steps themselves (optimizer_ms).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import model as model_mod
from .config import Config
from .loss import chunked_linear_cross_entropy

WARMUP, ITERATIONS = 3, 10


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    return run


def _measure(fn, device, iterations: int, warmup: int) -> float:
    timed = _timer(device)
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(iterations))


def _forward_backward(forward, inputs: list[torch.Tensor], params: list[torch.Tensor]):
    """Returns (fwd, fwd+bwd) callables; the backward sends a fixed random gradient."""
    def fwd():
        for t in inputs:
            t.grad = None
        return forward()

    grad_out = {}

    def fwd_bwd():
        out = fwd()
        if "g" not in grad_out:
            grad_out["g"] = torch.randn_like(out) if out.dim() else torch.ones_like(out)
        out.backward(grad_out["g"])
        for p in params:
            p.grad = None

    return fwd, fwd_bwd


def time_parts(config: Config, hf_config, device: torch.device, say=print, *,
               iterations: int = ITERATIONS, warmup: int = WARMUP) -> dict:
    try:
        return _time_parts(config, hf_config, device, say, iterations, warmup)
    finally:
        # The compiled attention run under _KernelClock's dispatch mode leaves the code
        # objects it ran (the attention's and RMSNorm's forward, which the training model's
        # modules share) set to run eagerly: the run's compiled modules would then never
        # compile. Dynamo starts the training as it would have without the parts.
        torch._dynamo.reset()


def _time_parts(config: Config, hf_config, device: torch.device, say, iterations: int,
                warmup: int) -> dict:
    dtype = torch.bfloat16 if config.train.dtype == "bf16" else torch.float32
    tokens = config.train.micro_batch_size * config.data.seq_len
    small = copy.deepcopy(hf_config)
    small.num_hidden_layers = 1
    moe_layer = _first_moe_layer(hf_config)
    if moe_layer is None:
        raise ValueError("the model has no MoE layer to time")
    small.mlp_only_layers = []
    if hasattr(small, "decoder_sparse_step"):
        small.decoder_sparse_step = 1
    torch.manual_seed(config.train.seed)
    config_one = copy.deepcopy(config)
    config_one.model.init = "random"
    model = model_mod.build_model(config_one, small, device)
    if config.parallel.ep > 1:
        say("parts: expert parallelism is not reproduced in isolation; the experts are timed "
            "as on one device")
    dispatch = model_mod.apply_dispatch(model, config, device)
    if config.train.compile_dense:
        model_mod.apply_compile_dense(model)  # the attention part is then the compiled one
    layer = model_mod.decoder_layers(model)[0]
    block = model_mod.moe_blocks(model)[0]
    for name, param in model.named_parameters():
        if not name.endswith("mlp.gate.weight"):
            param.data = param.data.to(dtype)

    generator = torch.Generator(device=device).manual_seed(config.train.seed + 1)
    hidden = torch.randn(1, tokens, hf_config.hidden_size, device=device, dtype=dtype,
                         generator=generator, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    base = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        rope = base.rotary_emb(hidden, positions)
    results = {"tokens": tokens, "dispatch": dispatch}

    attn = layer.self_attn
    attn_params = list(attn.parameters())
    fwd, fwd_bwd = _forward_backward(
        lambda: attn(hidden_states=hidden, position_embeddings=rope, attention_mask=None)[0],
        [hidden], attn_params)
    with model_mod.sdpa_backend(config.model.sdpa_backend):
        results["attention"] = _pair(fwd, fwd_bwd, device, iterations, warmup)
        # What the backward's recompute skips when train.checkpoint_save_attention keeps
        # the kernel's outputs.
        results["attention"]["kernel_fwd_ms"] = _kernel_forward_ms(fwd, device, iterations)

    flat = hidden.detach().reshape(tokens, -1).requires_grad_()
    router = block.gate
    fwd, fwd_bwd = _forward_backward(lambda: router(flat.float())[0], [flat], list(router.parameters()))
    results["router"] = _pair(fwd, fwd_bwd, device, iterations, warmup)

    with torch.no_grad():
        _, weights, ids = router(flat.float())
    experts = block.experts
    fwd, fwd_bwd = _forward_backward(lambda: experts(flat, ids, weights), [flat],
                                     list(experts.parameters()))
    results["experts"] = _pair(fwd, fwd_bwd, device, iterations, warmup)

    head = model.get_output_embeddings().weight.detach().to(dtype).requires_grad_()
    labels = torch.randint(0, hf_config.vocab_size, (tokens,), device=device, generator=generator)
    chunk, loss_kind = config.train.loss_chunk_size, config.train.loss_implementation
    fwd, fwd_bwd = _forward_backward(
        lambda: chunked_linear_cross_entropy(flat, head, labels, chunk,
                                             implementation=loss_kind) / tokens, [flat], [head])
    results["lm_head_loss"] = _pair(fwd, fwd_bwd, device, iterations, warmup)

    say("parts (ms, fwd / fwd+bwd): " + ", ".join(
        f"{k} {v['fwd_ms']:.2f} / {v['fwd_bwd_ms']:.2f}" for k, v in results.items()
        if isinstance(v, dict)))
    return results


class _KernelClock(TorchDispatchMode):
    """Marks (CUDA events or host clock) around every fused attention kernel it sees."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.kernels = set(model_mod.attention_kernels())
        self.cuda = device.type == "cuda"
        self.marks = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.kernels:
            return func(*args, **(kwargs or {}))
        start = self._mark()
        out = func(*args, **(kwargs or {}))
        self.marks.append((start, self._mark()))
        return out

    def elapsed_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.marks)
        return sum(b - a for a, b in self.marks) * 1e3


def _kernel_forward_ms(fwd, device, iterations: int) -> float:
    """Median time of the fused attention kernels within one call of fwd (0 where sdpa
    runs its 'math' backend, which has no single kernel)."""
    times = []
    for _ in range(iterations):
        clock = _KernelClock(device)
        # With autograd on, as in training: the kernel then also writes its log-sum-exp.
        with torch.enable_grad(), clock:
            fwd()
        times.append(clock.elapsed_ms())
    return statistics.median(times)


def _pair(fwd, fwd_bwd, device, iterations, warmup) -> dict:
    with torch.enable_grad():
        return {"fwd_ms": _measure(fwd, device, iterations, warmup),
                "fwd_bwd_ms": _measure(fwd_bwd, device, iterations, warmup)}


def _first_moe_layer(hf_config) -> int | None:
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(hf_config, "mlp_only_layers", []) or [])
    for index in range(hf_config.num_hidden_layers):
        if index not in mlp_only and (index + 1) % sparse_step == 0:
            return index
    return None


def step_breakdown(parts: dict, num_layers: int, step_ms: float, optimizer_ms: float | None,
                   checkpointing: bool, grad_accum: int, saves_attention: bool = False) -> dict:
    """The parts scaled to one optimizer step: per micro-batch every layer's attention,
    router and experts fwd+bwd (plus one more forward of each under activation
    checkpointing, without the attention kernel when its outputs are kept) and one LM
    head + loss; once per step the optimizer. `other` is the measured step time minus all
    of that (embedding, norms, residuals, FSDP's copies and collectives, launch gaps)."""
    recompute = {k: parts[k]["fwd_ms"] if checkpointing else 0.0
                 for k in ("attention", "router", "experts")}
    if checkpointing and saves_attention:
        recompute["attention"] -= parts["attention"].get("kernel_fwd_ms", 0.0)
    per_layer = {k: parts[k]["fwd_bwd_ms"] + recompute[k] for k in recompute}
    total = {k: v * num_layers * grad_accum for k, v in per_layer.items()}
    total["lm_head_loss"] = parts["lm_head_loss"]["fwd_bwd_ms"] * grad_accum
    total["optimizer"] = optimizer_ms or 0.0
    total["other"] = step_ms - sum(total.values())
    return {f"{k}_ms": v for k, v in total.items()}
