"""`megamoe-train [CONFIG] [--section.key value ...]`: trains a transformers MoE causal LM.

CONFIG is a TOML file or the name of an embedded config (`megamoe-train --list-configs`);
without one the embedded default for this machine runs (a few layers of Qwen3-30B-A3B
geometry on a GPU, a tiny model on a CPU). Under torchrun every rank runs this same
program. docs/training.md describes every key and output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import config as config_mod
from . import data as data_mod
from . import distributed, metrics
from . import model as model_mod
from . import optim as optim_mod
from .config import Config, ConfigError
from .mixed_precision import MasterAdamW, MasterWeights

DEFAULT_GPU = "default-gpu"
DEFAULT_CPU = "default-cpu"


def log(message: str) -> None:
    print(f"[megamoe-train] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megamoe-train",
        description="Train a transformers MoE causal LM from one TOML config. Any key can be "
                    "overridden on the command line as --section.key VALUE (a TOML value), "
                    "e.g. --train.steps 20 --model.moe.dispatch.type torch.")
    parser.add_argument("config", nargs="?", help="TOML file or embedded config name; default: "
                        f"{DEFAULT_GPU!r} on a GPU machine, {DEFAULT_CPU!r} otherwise")
    parser.add_argument("--list-configs", action="store_true", help="list the embedded configs")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    parser.add_argument("--check", action="store_true",
                        help="validate the config (including the checks that need the model "
                             "config and the world size) and exit")
    parser.add_argument("--time-parts", action="store_true",
                        help="before training, time the step's parts in isolation (attention, "
                             "experts, router, LM head + loss) and add them to the summary")
    parser.add_argument("--summary-json", help="also write the run summary to this file (under "
                        "torchrun: rank 0's summary, written by rank 0)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    rest, overrides = config_mod.split_overrides(argv, build_parser().error)
    return build_parser().parse_args(rest), overrides


def default_config_name() -> str:
    return DEFAULT_GPU if torch.cuda.is_available() else DEFAULT_CPU


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Expandable segments keep the caching allocator from fragmenting when a step's
    # transient buffers (gathered layers, gradients, the LM head's chunks) come and go next
    # to 100+ GiB of weights and optimizer state; read at CUDA's first allocation.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args, overrides = parse_args(argv)
    if args.list_configs:
        print("\n".join(config_mod.embedded_configs()))
        return 0
    name = args.config
    if name is None:
        name = default_config_name()
        where = "a CUDA GPU" if name == DEFAULT_GPU else "no CUDA GPU"
        log(f"no config given: this machine has {where}, running the embedded {name!r} config")
    try:
        config = config_mod.load(name, overrides)
    except ConfigError as error:
        print(f"megamoe-train: config error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        summary = run(config, check_only=args.check, time_parts=args.time_parts,
                      command=describe_command(argv))
    except ConfigError as error:
        print(f"megamoe-train: config error: {error}", file=sys.stderr)
        return 2
    # Every rank returns its summary; one file has one writer.
    if summary is not None and args.summary_json and int(os.environ.get("RANK", "0")) == 0:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def describe_command(argv: list[str]) -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"
        return f"{launcher} -m megamoe.train {shlex.join(argv)}".strip()
    return f"megamoe-train {shlex.join(argv)}".strip()


# ---------------------------------------------------------------- the run


@dataclass
class Clock:
    """Marks on the GPU stream (CUDA events) or the host clock."""

    cuda: bool

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


@dataclass
class Run:
    config: Config
    dist: distributed.Dist
    hf_config: object
    dp: int
    ep: int
    corpus: data_mod.Corpus | None = None


@contextlib.contextmanager
def determinism(enabled: bool):
    """torch.use_deterministic_algorithms (and cuDNN's flags) for the run, restored
    afterwards."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark)
    if enabled:
        # cuBLAS reads this when it makes its handle, before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[1:]


def pick_device(config: Config) -> str:
    wanted = config.train.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda', but this machine has no CUDA GPU")
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


def run(config: Config, *, check_only: bool = False, time_parts: bool = False,
        command: str = "megamoe-train") -> dict | None:
    """Runs the whole training; returns the summary (on every rank). With check_only, only
    validates (config, world size, model config, data) and returns None."""
    device_type = pick_device(config)
    threads = torch.get_num_threads()
    if device_type == "cpu" and config.train.cpu_threads:
        torch.set_num_threads(config.train.cpu_threads)
    info = distributed.init(device_type)
    try:
        with determinism(config.train.deterministic):
            return _run(config, info, check_only, time_parts, command)
    finally:
        distributed.shutdown(info)
        torch.set_num_threads(threads)


def _run(config: Config, info: distributed.Dist, check_only: bool, time_parts: bool,
         command: str) -> dict | None:
    started = time.perf_counter()
    say = log if info.is_main else (lambda message: None)
    hf_config = model_mod.load_hf_config(config)
    dp, ep = model_mod.check_runtime(config, hf_config, info.world_size, info.device,
                                     info.local_world_size)
    state = Run(config=config, dist=info, hf_config=hf_config, dp=dp, ep=ep)
    try:
        state.corpus = _load_corpus(config, info, say)
        sequences = data_mod.PackedSequences(state.corpus, config.data.seq_len,
                                             config.train.seed, config.data.shuffle)
    except ValueError as error:  # an unreadable record, a corpus shorter than a sequence
        raise ConfigError(str(error) if str(error).startswith("data") else f"data: {error}") from None
    if state.corpus.vocab_size > hf_config.vocab_size:
        raise ConfigError(f"data.tokenizer: its vocabulary ({state.corpus.vocab_size}) is larger "
                          f"than the model's vocab_size ({hf_config.vocab_size})")
    if check_only:
        say(f"config OK: world size {info.world_size} (dp {dp} x ep {ep}), "
            f"{sequences.sequences_per_epoch} sequences of {config.data.seq_len} tokens per epoch")
        return None
    say(f"{config.source}: {hf_config.model_type}, {hf_config.num_hidden_layers} layers, "
        f"world size {info.world_size} (dp {dp} x ep {ep}) on {_device_name(info.device)}")
    say(f"data: {state.corpus.description}, {state.corpus.num_tokens:,} tokens "
        f"({state.corpus.tokenizer_name}), {sequences.sequences_per_epoch} sequences of "
        f"{config.data.seq_len} per epoch")

    parts = None
    if time_parts:
        from .parts import time_parts as measure_parts

        say("timing the step's parts in isolation (attention, experts, router, LM head + loss)")
        parts = measure_parts(config, hf_config, info.device, say)
        if info.device.type == "cuda":
            torch.cuda.empty_cache()  # the one-layer copy's memory goes back before the model

    setup = _setup_training(config, state, sequences, say)
    summary = _train_loop(config, state, setup, say, command, parts, started)
    return summary


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _load_corpus(config: Config, info: distributed.Dist, say) -> data_mod.Corpus:
    # One process per node builds the caches (tokenizer, tokenized corpus); the others wait
    # and read them. A builder that fails still reaches the barrier, so the others do not
    # hang: they then fail on the same files or on the missing cache.
    builder = info.local_rank == 0
    corpus, failure = None, None
    if builder:
        try:
            corpus = data_mod.build_corpus(config.data, log=say, builder=True)
        except Exception as error:  # noqa: BLE001 -- re-raised after the barrier
            failure = error
    ckpt.barrier()
    if failure is not None:
        raise failure
    if not builder:
        corpus = data_mod.build_corpus(config.data, log=say, builder=False)
    return corpus


@dataclass
class Setup:
    model: torch.nn.Module
    trainer: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: data_mod.DataLoader
    checkpointer: ckpt.Checkpointer | None
    dispatch: str
    counts: dict
    aux_coef: float
    params: list = field(default_factory=list)  # what the optimizer steps
    masters: MasterWeights | None = None         # one rank without FSDP2
    start_step: int = 0
    resumed_from: str | None = None
    ep_buffer: object = None  # megamoe.Buffer of the mega_moe experts under EP


def _setup_training(config: Config, state: Run, sequences, say) -> Setup:
    info, hf_config = state.dist, state.hf_config
    device = info.device
    world_mesh, dp_ep_mesh = distributed.meshes(device.type, info.world_size, state.dp, state.ep)
    geometry = model_mod.moe_geometry(hf_config)

    say("building the model")
    model = model_mod.build_model(config, hf_config, device)
    group = buffer = expert_mesh = expert_views = None
    if state.ep > 1:
        ep_mesh = dp_ep_mesh["ep"]
        group, expert_mesh = ep_mesh.get_group(), dp_ep_mesh["dp"]
        from megamoe.integrations import transformers as mt

        # This rank's E/ep experts, as the integration serves them (global top-k ids).
        mt.shard_experts(model, group)
        if config.model.moe.dispatch.type == "mega_moe":
            import megamoe

            tokens = config.train.micro_batch_size * config.data.seq_len
            buffer = megamoe.Buffer(group, max_tokens_per_rank=tokens, hidden=geometry["hidden"],
                                    intermediate=geometry["intermediate"],
                                    num_experts=geometry["num_experts"], topk=geometry["topk"])
    dispatch = model_mod.apply_dispatch(model, config, device, group=group, buffer=buffer)
    say(f"experts: {dispatch}")
    if config.train.activation_checkpointing:
        model_mod.apply_activation_checkpointing(model, config.train.checkpoint_save_attention,
                                                 config.train.checkpoint_skip_expert_outputs)
    if config.train.compile:
        model_mod.apply_compile(model)
    if config.train.compile_dense:
        compiled = model_mod.apply_compile_dense(model)
        say(f"torch.compile: {len(compiled)} dense modules (the MoE blocks stay eager)")
    aux_coef = model_mod.aux_loss_coefficient(config, hf_config)
    trainer = model_mod.CausalLMTrainer(model, config.train.loss_chunk_size, aux_coef,
                                        config.train.loss_implementation)
    param_dtype = torch.bfloat16 if config.train.dtype == "bf16" else torch.float32
    masters = None
    if model_mod.uses_fsdp(config, info.world_size):
        reshard, why = model_mod.reshard_policy(config, device, info.world_size)
        if why:
            say(why)
        model_mod.apply_fsdp(trainer, model, world_mesh, expert_mesh, param_dtype,
                             info.world_size, reshard)
    else:
        say("one rank: no FSDP2 (parallel.fsdp = 'auto')" + (
            "; the model computes in bf16 copies of the fp32 weights the optimizer steps"
            if param_dtype == torch.bfloat16 else ""))
        if config.parallel.reshard_after_forward != "default":
            say("parallel.reshard_after_forward is an FSDP2 setting: it has no effect here "
                "(set parallel.fsdp = 'always' to use FSDP2 on one rank)")
        masters = MasterWeights(model, param_dtype,
                                [block.gate for block in model_mod.moe_blocks(model)],
                                accumulate_in_fp32=config.train.grad_accum > 1)
    if state.ep > 1:
        fqns = {name for name, _ in model.named_parameters() if ".experts." in f".{name}"}
        expert_views = ckpt.ExpertViews(fqns, dp_ep_mesh, state.ep)

    # Without FSDP2 the optimizer and the checkpoints see the masters, under the model's
    # names; with it, the model's own (sharded fp32) parameters.
    owner = model if masters is None else masters.module
    params = [p for p in owner.parameters() if p.requires_grad]
    if masters is None:
        optimizer = optim_mod.build_optimizer(params, config.optim, device)
    else:
        o = config.optim
        optimizer = MasterAdamW(masters, lr=o.lr, betas=o.betas, eps=o.eps,
                                weight_decay=o.weight_decay, implementation=o.implementation)
    scheduler = optim_mod.build_scheduler(optimizer, config.optim, config.train.steps)
    loader = data_mod.DataLoader(sequences, config.train.micro_batch_size, config.train.grad_accum,
                                 info.rank, info.world_size, device)
    log_dir = Path(config.log.dir)
    root = Path(config.checkpoint.dir) if config.checkpoint.dir else log_dir / "checkpoints"
    checkpointer = ckpt.Checkpointer(root, owner, optimizer, scheduler, loader, rank=info.rank,
                                     expert_views=expert_views,
                                     keep_last=config.checkpoint.keep_last)
    setup = Setup(model=model, trainer=trainer, optimizer=optimizer, scheduler=scheduler,
                  loader=loader, checkpointer=checkpointer, dispatch=dispatch,
                  counts=model_mod.count_parameters(model), aux_coef=aux_coef,
                  params=params, masters=masters, ep_buffer=buffer)
    _maybe_resume(config, setup, root, say)
    return setup


def _maybe_resume(config: Config, setup: Setup, root: Path, say) -> None:
    resume = config.checkpoint.resume
    if resume == "none":
        return
    path = ckpt.latest(root) if resume == "latest" else Path(resume)
    if path is None:
        say(f"checkpoint.resume = 'latest': no checkpoint in {root}, starting from step 0")
        return
    step, had_rng = setup.checkpointer.load(path)
    if setup.masters is not None:
        setup.masters.copy_to_model()
    if not had_rng:
        say(f"{path} holds no RNG state for this rank (another world size?): RNG not restored")
    if step >= config.train.steps:
        raise ConfigError(f"checkpoint.resume: {path} is at step {step}, and train.steps = "
                          f"{config.train.steps} leaves nothing to run")
    setup.start_step, setup.resumed_from = step, str(path)
    say(f"resumed from {path} (step {step}, data position {setup.loader.position})")


def _train_loop(config: Config, state: Run, setup: Setup, say, command: str, parts,
                started: float) -> dict:
    info = state.dist
    device = info.device
    cuda = device.type == "cuda"
    clock = Clock(cuda)
    log_dir = Path(config.log.dir)
    if info.is_main:
        log_dir.mkdir(parents=True, exist_ok=True)
    steps_log = _previous_steps(log_dir / "steps.jsonl", setup.start_step) if info.is_main else []
    seq_len, batch, accum = config.data.seq_len, config.train.micro_batch_size, config.train.grad_accum
    tokens_per_rank = seq_len * batch * accum
    flops_token = metrics.flops_per_token(setup.counts, seq_len)
    gpu_name = _device_name(device) if cuda else None
    peak = metrics.peak_tflops(gpu_name, config.log.peak_tflops) if cuda else None
    params = setup.params
    inv_tokens, inv_accum = 1.0 / (seq_len * batch), 1.0 / accum
    summary_base = _summary_base(config, state, setup, command, gpu_name, peak, flops_token,
                                 tokens_per_rank)
    say(f"training steps {setup.start_step + 1}..{config.train.steps}: "
        f"{tokens_per_rank * info.world_size:,} tokens per step, "
        f"{metrics.count(setup.counts['total'])} parameters "
        f"({metrics.count(setup.counts['active_matmul'])} active matmul parameters per token, "
        f"{metrics.count(flops_token)} FLOPs per token)")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    jsonl = (log_dir / "steps.jsonl").open("a") if info.is_main else None
    alloc_retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0
    try:
        for step in range(setup.start_step + 1, config.train.steps + 1):
            profiler = _step_profiler(cuda) if step == config.log.profile_step else None
            if profiler is not None:
                profiler.start()
            t0 = time.perf_counter()
            ce_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            for input_ids, labels in setup.loader.next_step():
                with model_mod.sdpa_backend(config.model.sdpa_backend):
                    ce, aux = setup.trainer(input_ids, labels)
                    loss = (ce * inv_tokens + setup.aux_coef * aux) * inv_accum
                    loss.backward()
                ce_sum += ce.detach()
                aux_sum += aux.detach()
            opt_start = clock.mark()
            lr = setup.scheduler.get_last_lr()[0]
            grad_norm = optim_mod.clip_and_step(setup.optimizer, params, config.optim.grad_clip)
            setup.scheduler.step()
            setup.optimizer.zero_grad(set_to_none=True)
            opt_end = clock.mark()
            sums = distributed.all_reduce_sum(torch.stack([ce_sum, aux_sum]))
            # The step's one host sync (the grad norm is already the same on every rank).
            ce_total, aux_total, norm = torch.cat([sums, grad_norm.reshape(1).to(sums)]).tolist()
            step_time = time.perf_counter() - t0
            if profiler is not None:
                profiler.stop()
                if info.is_main:
                    path = _write_profile(profiler, log_dir, step, cuda)
                    say(f"step {step}: wrote the per-kernel profile {path} (this step's "
                        "time includes the profiler's overhead)")
            record = {
                "step": step,
                "loss": ce_total / (tokens_per_rank * info.world_size),
                "aux_loss": aux_total / (accum * info.world_size),
                "grad_norm": norm,
                "lr": lr,
                "step_time_s": step_time,
                "optimizer_ms": clock.elapsed_ms(opt_start, opt_end),
                "tokens_per_s_per_gpu": tokens_per_rank / step_time,
                "mfu": (flops_token * tokens_per_rank / step_time / (peak * 1e12)) if peak else None,
                "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if cuda else None,
            }
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                # The caching allocator freeing its cache to retry an allocation syncs the
                # device and remaps memory: one per step costs tens of milliseconds.
                retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
                record["alloc_retries"] = retries - alloc_retries
                alloc_retries = retries
            if info.is_main:
                steps_log.append(record)
                jsonl.write(json.dumps(record) + "\n")
                jsonl.flush()
                if step % config.log.interval == 0 or step == config.train.steps:
                    print(metrics.format_line(record, config.train.steps,
                                              "GPU" if cuda else "rank"), flush=True)
            if setup.ep_buffer is not None:
                # A failed EP call of the step (a peer's timeout, the receive capacity) left
                # NaN outputs: stop with its error, which names the rank and the phase.
                setup.ep_buffer.check()
            if not all(map(_finite, (record["loss"], record["aux_loss"], norm))):
                raise FloatingPointError(f"step {step}: loss {record['loss']}, aux "
                                         f"{record['aux_loss']}, grad norm {norm} is not finite")
            interval = config.checkpoint.interval
            if interval and (step % interval == 0 or step == config.train.steps):
                path = setup.checkpointer.save(step)
                say(f"saved checkpoint {path}")
    finally:
        if jsonl is not None:
            jsonl.close()
    summary = _finish(config, state, setup, summary_base, steps_log, parts, started)
    return summary


def _step_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities)


def _write_profile(profiler, log_dir: Path, step: int, cuda: bool) -> Path:
    """The step's operators and kernels by total time (device time on a GPU)."""
    key = "cuda_time_total" if cuda else "cpu_time_total"
    averages = profiler.key_averages()
    table = averages.table(sort_by=key, row_limit=60, max_name_column_width=100)
    path = log_dir / f"profile-step{step}.txt"
    text = f"# megamoe-train, step {step}: torch.profiler, sorted by {key}\n{table}\n"
    if cuda:
        # A step whose host work outlasts its kernels leaves the GPU waiting: the
        # operators and runtime calls by their own host time show where.
        cpu = averages.table(sort_by="self_cpu_time_total", row_limit=40,
                             max_name_column_width=100)
        text += f"# the same step sorted by self_cpu_time_total\n{cpu}\n"
        # Allocator churn near the top of memory (cudaMalloc / cudaFree between kernels,
        # retries after freeing the cache) shows here, not in the kernel table.
        stats = torch.cuda.memory_stats()
        keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                "num_sync_all_streams")
        text += "# allocator since start: " + ", ".join(
            f"{k} {stats.get(k, 0)}" for k in keys) + (
            f", reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB\n")
    path.write_text(text)
    return path


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _previous_steps(path: Path, start_step: int) -> list[dict]:
    """The steps a resumed run already logged (up to its checkpoint); the log file is
    rewritten to hold exactly those, so the curve continues without a gap or repeat."""
    if start_step == 0 or not path.exists():
        if path.exists() and start_step == 0:
            path.unlink()
        return []
    kept = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= start_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _summary_base(config: Config, state: Run, setup: Setup, command: str, gpu_name, peak,
                  flops_token, tokens_per_rank) -> dict:
    import transformers

    from megamoe.bench import git_commit

    corpus = state.corpus
    return {
        "command": command,
        "config_source": config.source,
        "config": config.to_dict(),
        "commit": git_commit(),
        "gpu": gpu_name or "cpu",
        "device": state.dist.device.type,
        "world_size": state.dist.world_size, "dp": state.dp, "ep": state.ep,
        "dispatch": setup.dispatch,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "model": {"type": state.hf_config.model_type, **setup.counts},
        "flops_per_token": flops_token,
        "peak_tflops": peak,
        "tokens_per_step_per_gpu": tokens_per_rank,
        "data": {"description": corpus.description, "tokens": corpus.num_tokens,
                 "documents": corpus.num_documents, "tokenizer": corpus.tokenizer_name,
                 "vocab_size": corpus.vocab_size, "key": corpus.key},
        "resumed_from": setup.resumed_from,
    }


def _finish(config: Config, state: Run, setup: Setup, base: dict, steps: list[dict], parts,
            started: float) -> dict:
    median = metrics.median_step_time(steps)
    tokens = base["tokens_per_step_per_gpu"]
    peak = base["peak_tflops"]
    memories = [r["peak_memory_gib"] for r in steps if r["peak_memory_gib"] is not None]
    summary = {
        **base,
        "steps_run": len(steps),
        "step_time_median_s": median,
        "step_time_median_steps": "6-20",
        "tokens_per_s_per_gpu": tokens / median if median else None,
        "mfu": (base["flops_per_token"] * tokens / median / (peak * 1e12)) if median and peak else None,
        "peak_memory_gib": max(memories) if memories else None,
        "optimizer_ms_median": _median([r["optimizer_ms"] for r in steps if r["step"] >= 6]),
        "final_loss": steps[-1]["loss"] if steps else None,
        "parts": parts,
        "wall_time_s": time.perf_counter() - started,
    }
    if state.dist.is_main:
        log_dir = Path(config.log.dir)
        metrics.write_json(log_dir / "run.json", summary, steps)
        if config.log.plot and steps:
            title = (f"{base['model']['type']} x{base['model']['num_layers']} layers, "
                     f"{setup.dispatch}, {base['gpu']}, commit {base['commit'][:12]}")
            metrics.plot_curves(log_dir / "curves.png", steps, title)
        log(f"wrote {log_dir / 'run.json'}" + (f" and {log_dir / 'curves.png'}" if config.log.plot else ""))
        if median:
            mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] else ""
            per = "rank" if base["gpu"] == "cpu" else "GPU"
            window = f"steps 6-{min(20, max(r['step'] for r in steps))}"
            log(f"median step time ({window}) {median * 1e3:.1f} ms, "
                f"{summary['tokens_per_s_per_gpu']:,.0f} tokens/s/{per}{mfu}")
    summary["steps"] = steps
    return summary


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None
