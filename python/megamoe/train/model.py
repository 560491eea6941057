"""The model: a transformers MoE causal LM (no model code of our own), its experts dispatched
to megamoe or to transformers' own grouped_mm (under expert parallelism the integration's
shard_experts keeps each rank's share), activation checkpointing, torch.compile, and FSDP2.

FSDP2 units (TorchTitan's layout; on one rank FSDP2 is off unless parallel.fsdp = "always",
megamoe.train.mixed_precision): every router (fp32 params, fp32 inputs, so its logits,
softmax and top-k weights are fp32), under EP every experts module (sharded over the dp mesh
dimension only, since the ep dimension already splits them), every decoder layer, the token
embedding, and the root (`CausalLMTrainer`: final norm + LM head). Dense parameters are
sharded over every rank. Mixed precision: fp32 master weights, bf16 compute
(param_dtype), fp32 gradient reduction (reduce_dtype).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import sys

import torch
from torch import nn

from .config import RESHARD_POLICIES, Config, ConfigError
from .loss import chunked_linear_cross_entropy
from .presets import make_config


# ---------------------------------------------------------------- transformers config


def load_hf_config(config: Config):
    """The transformers config of [model], overrides applied. ConfigError names the key."""
    model = config.model
    if model.preset:
        hf_config = make_config(model.preset)
    else:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(model.path)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model.path: no transformers config could be read from "
                              f"{model.path!r}: {error}") from None
    for key, value in model.config.items():
        if not hasattr(hf_config, key):
            known = [k for k in hf_config.to_dict() if not k.startswith("_")]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"model.config.{key}: {type(hf_config).__name__} has no attribute "
                              f"{key!r}{hint}")
        setattr(hf_config, key, value)
    if model.num_layers is not None:
        hf_config.num_hidden_layers = model.num_layers
        if getattr(hf_config, "layer_types", None):
            hf_config.layer_types = hf_config.layer_types[:model.num_layers]
    return hf_config


def moe_geometry(hf_config) -> dict:
    """Experts, top-k, hidden and expert intermediate sizes of a transformers MoE config."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    topk = getattr(hf_config, "num_experts_per_tok", None)
    if not experts or not topk:
        raise ConfigError(f"model: {type(hf_config).__name__} is not a Mixture-of-Experts config "
                          "(no num_experts / num_experts_per_tok)")
    intermediate = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return {"num_experts": int(experts), "topk": int(topk), "hidden": int(hf_config.hidden_size),
            "intermediate": int(intermediate)}


def check_runtime(config: Config, hf_config, world_size: int, device: torch.device,
                  local_world_size: int) -> tuple[int, int]:
    """Checks that need the world size, the device and the model config; returns (dp, ep)."""
    geometry = moe_geometry(hf_config)
    ep = config.parallel.ep
    if world_size % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide the world size {world_size}")
    dp = world_size // ep if config.parallel.dp == -1 else config.parallel.dp
    if dp * ep != world_size:
        raise ConfigError(f"parallel.dp = {config.parallel.dp} x parallel.ep = {ep} must equal "
                          f"the world size {world_size} (or set parallel.dp = -1)")
    if geometry["num_experts"] % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide the model's "
                          f"{geometry['num_experts']} experts")
    if ep > 1 and ep > local_world_size:
        raise ConfigError(f"parallel.ep = {ep}: an EP group lives inside one node, which has "
                          f"{local_world_size} processes (LOCAL_WORLD_SIZE)")
    dispatch = config.model.moe.dispatch
    if ep > 1 and dispatch.type == "hf":
        raise ConfigError("parallel.ep > 1 with model.moe.dispatch.type = 'hf': transformers' own "
                          "experts run no expert parallelism here; use 'mega_moe' or 'torch'")
    if ep > 1 and device.type != "cuda" and dispatch.type == "mega_moe":
        raise ConfigError("parallel.ep > 1 with model.moe.dispatch.type = 'mega_moe' needs CUDA "
                          "GPUs (on CPU it is the reference backend, which runs on one device)")
    from megamoe import buffer

    if ep > buffer.MAX_RANKS and dispatch.type == "mega_moe":
        raise ConfigError(f"parallel.ep = {ep}: megamoe's EP groups hold at most "
                          f"{buffer.MAX_RANKS} ranks")
    if device.type == "cuda":
        _check_gpu_dispatch(config, geometry, device)
    seq_len, limit = config.data.seq_len, getattr(hf_config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise ConfigError(f"data.seq_len = {seq_len} is longer than the model's "
                          f"max_position_embeddings = {limit} (raise it with "
                          f"model.config = {{max_position_embeddings = {seq_len}}})")
    return dp, ep


def _check_gpu_dispatch(config: Config, geometry: dict, device: torch.device) -> None:
    from megamoe import _validate

    kind = config.model.moe.dispatch.type
    H, I = geometry["hidden"], geometry["intermediate"]
    if kind in ("mega_moe", "torch") and config.train.dtype != "bf16":
        raise ConfigError(f"model.moe.dispatch.type = {kind!r} computes in bf16 on GPU: set "
                          "train.dtype = 'bf16'")
    if kind == "torch" and (H % _validate.TORCH_DIM_MULTIPLE or I % _validate.TORCH_DIM_MULTIPLE):
        raise ConfigError(f"model.moe.dispatch.type = 'torch' needs hidden and expert "
                          f"intermediate sizes that are multiples of "
                          f"{_validate.TORCH_DIM_MULTIPLE}, the model has H={H}, I={I}")
    if kind != "mega_moe":
        return
    major, minor = torch.cuda.get_device_capability(device)
    problems = []
    if (major, minor) != (9, 0):
        problems.append(f"a Hopper GPU (sm_90), this one is sm_{major}{minor}")
    if H % _validate.FUSED_DIM_MULTIPLE or I % _validate.FUSED_DIM_MULTIPLE:
        problems.append(f"H and I multiples of {_validate.FUSED_DIM_MULTIPLE}, the model has "
                        f"H={H}, I={I}")
    if geometry["topk"] > _validate.FUSED_MAX_TOPK:
        problems.append(f"top-k <= {_validate.FUSED_MAX_TOPK}, the model has {geometry['topk']}")
    if geometry["num_experts"] > _validate.FUSED_MAX_EXPERTS:
        problems.append(f"at most {_validate.FUSED_MAX_EXPERTS} experts, the model has "
                        f"{geometry['num_experts']}")
    if problems:
        raise ConfigError("model.moe.dispatch.type = 'mega_moe' runs megamoe's fused kernels, "
                          f"which need {'; '.join(problems)}; use 'torch' or 'hf'")


# ---------------------------------------------------------------- building


def build_model(config: Config, hf_config, device: torch.device) -> nn.Module:
    """The transformers model, fp32, on `device`, in training mode."""
    from transformers import AutoModelForCausalLM

    attn = config.model.attn_implementation
    if config.model.init == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(config.model.path, config=hf_config,
                                                     dtype=torch.float32, attn_implementation=attn)
        model.to(device)
    else:
        torch.manual_seed(config.train.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                     attn_implementation=attn)
    if getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError("model: tied input and output embeddings are not supported by the "
                          "trainer's FSDP layout; set model.config = {tie_word_embeddings = false}")
    model.train()
    return model


def decoder_layers(model) -> nn.ModuleList:
    base = getattr(model, model.base_model_prefix)
    return base.layers


def moe_blocks(model) -> list[nn.Module]:
    """Modules holding a router (`gate`) and experts (`experts` with 3-D gate_up_proj /
    down_proj), in layer order."""
    blocks = [m for m in model.modules()
              if isinstance(getattr(m, "experts", None), nn.Module)
              and isinstance(getattr(m, "gate", None), nn.Module)
              and isinstance(getattr(m.experts, "gate_up_proj", None), torch.Tensor)]
    if not blocks:
        raise ConfigError(f"model: {type(model).__name__} has no MoE blocks with experts in the "
                          "transformers layout (experts.gate_up_proj / experts.down_proj)")
    return blocks


def apply_dispatch(model, config: Config, device: torch.device, group=None, buffer=None) -> str:
    """Routes the experts to the configured implementation; returns a description."""
    dispatch = config.model.moe.dispatch
    if dispatch.type == "hf":
        model.set_experts_implementation("grouped_mm")
        return "transformers grouped_mm"
    from megamoe.integrations import transformers as mt

    backend = "torch" if dispatch.type == "torch" else ("fused" if device.type == "cuda" else "reference")
    # backward_mode is the fused backend's choice; the others get the default.
    mode = dispatch.backward_mode if backend == "fused" else "recompute"
    mt.configure(model, backend=backend, precision=dispatch.precision, backward_mode=mode,
                 group=group, buffer=buffer, on_unsupported="error")
    model.set_experts_implementation("megamoe")
    if backend == "fused" and dispatch.precision != "bf16":
        # Each layer's FP8 weight copies are dropped after its backward rather than held to
        # the optimizer step: at the end of a backward they would sit beside every gradient,
        # where the step's memory peaks (megamoe.weight_cache).
        from megamoe.weight_cache import shared_cache
        shared_cache().release_after_backward = True
    if backend == "reference":
        return "megamoe backend=reference"
    mode = f", backward_mode={dispatch.backward_mode}" if backend == "fused" else ""
    return f"megamoe backend={backend}, precision={dispatch.precision}{mode}"


def sdpa_backend(name: str):
    """A context in which PyTorch's scaled_dot_product_attention tries backend `name` first
    (the others, in PyTorch's order, stay as fallbacks); 'auto' changes nothing. It must
    cover the backward too: activation checkpointing recomputes the forward there."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "auto":
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    order.remove(first)
    return sdpa_kernel([first, *order], set_priority=True)


def attention_kernels() -> list:
    """The aten ops of PyTorch's fused attention kernels (sdpa's backends but 'math', which
    is made of smaller ops), those this PyTorch build has."""
    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return [getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)]


def apply_activation_checkpointing(model, save_attention: bool = False,
                                   skip_expert_outputs: bool = False) -> None:
    """One checkpointed region per decoder layer. With save_attention, the outputs of the
    fused attention kernels are kept from the forward (selective checkpointing), so the
    backward's recompute of the layer reruns everything but the attention kernel: the same
    values, since the kept outputs are what the recompute would produce again. With
    skip_expert_outputs, the recompute runs inside megamoe.skip_expert_outputs(): the fused
    experts compute only what their backward keeps (a decoder layer's MoE output feeds only
    its residual add, whose result the recompute throws away); the gradients are the same
    bits."""
    # Non-reentrant: the router logits recorded inside each layer (for the load-balancing
    # loss) keep their gradient path, and nested FSDP units work inside the region.
    from torch.utils.checkpoint import noop_context_fn

    kwargs = {"use_reentrant": False}
    contexts = noop_context_fn  # a fresh pair (forward, recompute) for every checkpointed call
    if save_attention:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        kept = set(attention_kernels())

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    if skip_expert_outputs:
        from megamoe import skip_expert_outputs as skip

        @contextlib.contextmanager
        def recompute_skipping(recompute):
            with recompute, skip():
                yield

        inner = contexts

        def with_skip():
            forward, recompute = inner()
            return forward, recompute_skipping(recompute)

        contexts = with_skip
    if contexts is not noop_context_fn:
        kwargs["context_fn"] = contexts
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_compile(model) -> None:
    # Only each layer's forward is compiled: the module hooks (FSDP2's, activation
    # checkpointing's __call__) stay in eager mode around it.
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)


def apply_compile_dense(model) -> list[str]:
    """torch.compile of every module of each decoder layer that holds no experts (the
    attention block with its q/k norms and RoPE, the layer norms, a dense MLP) and of the
    norms outside the layers; the MoE blocks, whose implementations the benchmark compares,
    stay eager. Returns the compiled modules' names."""
    compiled = []
    layers = decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}

    def compile_module(name, module):
        # Inductor's deterministic mode, as in the compiled loss: reduction block sizes from
        # heuristics, not from timing candidates on the device, so that two runs of a
        # config sum in the same order.
        module.forward = torch.compile(module.forward, dynamic=False,
                                       options={"deterministic": True})
        compiled.append(name)

    for i, layer in enumerate(layers):
        for name, child in layer.named_children():
            if not any(_holds_experts(m) for m in child.modules()):
                compile_module(f"layers.{i}.{name}", child)
    for name, module in model.named_modules():
        if id(module) not in inside and type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
            compile_module(name, module)
    return compiled


def _holds_experts(module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)


def uses_fsdp(config: Config, world_size: int) -> bool:
    """parallel.fsdp: 'auto' shards with FSDP2 only where there is more than one rank
    (megamoe.train.mixed_precision is the one-rank path)."""
    return config.parallel.fsdp == "always" or world_size > 1


def reshard_after_forward(policy: str, mesh_size: int, *, last_layer: bool = False) -> bool:
    """Whether an FSDP2 unit frees its unsharded (param_dtype) parameters after its forward
    (parallel.reshard_after_forward). 'default': only where its mesh spans more than one
    rank, and never for the last decoder layer, which the backward needs at once. On one
    rank the all-gather is only a cast + copy of the local parameters: resharding saves the
    memory of that copy but repeats it in the backward (docs/training.md)."""
    if policy not in RESHARD_POLICIES:
        raise ConfigError(f"parallel.reshard_after_forward: expected one of "
                          f"{list(RESHARD_POLICIES)}, got {policy!r}")
    if policy == "always":
        return True
    if policy == "never":
        return False
    return mesh_size > 1 and not last_layer


def reshard_policy(config: Config, device: torch.device, world_size: int) -> tuple[str, str]:
    """parallel.reshard_after_forward as applied, and why when it differs from the config:
    on one GPU, 'default' reshards every layer for the fused FP8 experts. Their weight
    copies (W and W^T, as much memory as the bf16 experts) then take the room the gathered
    bf16 layers would hold from the forward to the backward; keeping both pushed the
    caching allocator into retries (two per step at the benchmark's 11 layers, +170 ms;
    docs/training.md)."""
    policy = config.parallel.reshard_after_forward
    dispatch = config.model.moe.dispatch
    if (policy == "default" and world_size == 1 and device.type == "cuda"
            and dispatch.type == "mega_moe" and dispatch.precision != "bf16"):
        return "always", (f"parallel.reshard_after_forward 'default' means 'always' here: one "
                          f"GPU with the fused experts in {dispatch.precision}")
    return policy, ""


def apply_fsdp(trainer_module: nn.Module, model, world_mesh, expert_mesh, param_dtype,
               world_size: int, reshard: str = "default") -> None:
    """FSDP2 units as described in the module docstring. `expert_mesh` (the dp dimension)
    is None without expert parallelism: the experts then belong to their layer's unit.
    `reshard`: parallel.reshard_after_forward's policy (see reshard_after_forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    # The experts' inputs include the router's fp32 top-k weights: their unit must not cast
    # its inputs to param_dtype.
    experts_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                          cast_forward_inputs=False)
    on_world = reshard_after_forward(reshard, world_mesh.size())
    layers = decoder_layers(model)
    blocks = {id(b): b for b in moe_blocks(model)}
    for index, layer in enumerate(layers):
        for block in (m for m in layer.modules() if id(m) in blocks):
            fully_shard(block.gate, mesh=world_mesh, mp_policy=full,
                        reshard_after_forward=on_world)
            if expert_mesh is not None:
                fully_shard(block.experts, mesh=expert_mesh, mp_policy=experts_policy,
                            reshard_after_forward=reshard_after_forward(reshard,
                                                                        expert_mesh.size()))
                # Each rank's expert gradients already sum the tokens of its whole EP group;
                # dividing by the world size (not the dp size) makes them the mean over every
                # rank's loss, like the dense gradients.
                block.experts.set_gradient_divide_factor(float(world_size))
        last = index == len(layers) - 1
        fully_shard(layer, mesh=world_mesh, mp_policy=mixed,
                    reshard_after_forward=reshard_after_forward(reshard, world_mesh.size(),
                                                                last_layer=last))
    fully_shard(model.get_input_embeddings(), mesh=world_mesh, mp_policy=mixed,
                reshard_after_forward=on_world)
    fully_shard(trainer_module, mesh=world_mesh, mp_policy=mixed, reshard_after_forward=False)


# ---------------------------------------------------------------- the training module


class CausalLMTrainer(nn.Module):
    """Root module of a step: the base model's hidden states, then the chunked LM head +
    cross-entropy and transformers' load-balancing loss. Returns (sum of token losses,
    auxiliary loss) of a micro-batch."""

    def __init__(self, model, loss_chunk_size: int, aux_loss_coef: float,
                 loss_implementation: str = "auto"):
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size
        self.loss_implementation = loss_implementation
        self.aux_loss_coef = aux_loss_coef
        geometry = moe_geometry(model.config)
        self.num_experts, self.topk = geometry["num_experts"], geometry["topk"]
        self._balancing_loss = _load_balancing_loss_func(model)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        base = getattr(self.model, self.model.base_model_prefix)
        want_router = self.aux_loss_coef > 0
        out = base(input_ids=input_ids, use_cache=False, output_router_logits=want_router)
        hidden = out.last_hidden_state
        weight = self.model.get_output_embeddings().weight
        ce_sum = chunked_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                              labels.reshape(-1), self.loss_chunk_size,
                                              implementation=self.loss_implementation)
        if want_router:
            aux = self._balancing_loss(out.router_logits, self.num_experts, self.topk)
        else:
            aux = torch.zeros((), device=hidden.device)
        return ce_sum, aux


def _load_balancing_loss_func(model):
    # transformers defines load_balancing_loss_func in each MoE family's modeling module
    # (the same Switch-Transformer loss); take the model's own.
    module = sys.modules.get(type(model).__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as func
    return func


def aux_loss_coefficient(config: Config, hf_config) -> float:
    if config.model.moe.aux_loss_coef is not None:
        return config.model.moe.aux_loss_coef
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


def count_parameters(model) -> dict:
    """Parameter counts from the config: the total, and the matmul parameters one token
    passes through (attention projections, router, its k experts, the LM head: the N of the
    6N FLOP model; the embedding lookup is no matmul)."""
    hf = model.config
    geometry = moe_geometry(hf)
    H, I, E, k = geometry["hidden"], geometry["intermediate"], geometry["num_experts"], geometry["topk"]
    heads, kv = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or H // heads
    attention = H * head_dim * (2 * heads + 2 * kv)
    layers = decoder_layers(model)
    moe_layers = sum(1 for layer in layers if any(isinstance(getattr(m, "experts", None), nn.Module)
                                                   for m in layer.modules()))
    dense_layers = len(layers) - moe_layers
    dense_mlp = 3 * H * hf.intermediate_size
    vocab = hf.vocab_size
    per_moe_total = attention + E * H + E * 3 * H * I
    per_moe_active = attention + E * H + k * 3 * H * I
    per_dense = attention + dense_mlp
    embeddings = 2 * vocab * H
    return {
        "total": moe_layers * per_moe_total + dense_layers * per_dense + embeddings,
        "active_matmul": moe_layers * per_moe_active + dense_layers * per_dense + vocab * H,
        "embeddings_and_head": embeddings,
        "per_moe_layer": per_moe_total,
        "attention_heads_x_dim": heads * head_dim,
        "num_layers": len(layers),
    }


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
