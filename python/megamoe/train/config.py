"""The trainer's configuration: one TOML file, checked completely before anything runs.

Every section is a dataclass below and every key a field with its type, default, allowed
values and documentation (docs/training.md is the user-facing copy of the same). `load()`
reads a file (or an embedded config by name), applies command-line overrides
(`--section.key value`, TorchTitan style) and validates: an unknown key (with the closest
known key suggested), a wrong type, a value outside its choices or range, a missing preset,
file or data path, and a precision that is not built all raise ConfigError naming the key.
Checks that need the process group or the model's transformers config (EP size against the
experts and the world size, the fused backend's shape limits) run in `check_runtime()`,
still before any weight is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

DISPATCH_TYPES = ("mega_moe", "torch", "hf")
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
# What each dispatch type runs besides bf16: megamoe's fused FP8 layer ('mega_moe'; on a CPU
# its reference backend computes the exact math), the torch baseline's FP8 recipe.
BUILT_PRECISIONS = {"mega_moe": ("bf16", "fp8", "fp8_bwd"), "torch": ("bf16", "fp8"),
                    "hf": ("bf16",)}
BACKWARD_MODES = ("recompute", "saved")
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
LOSS_IMPLEMENTATIONS = ("auto", "compiled", "eager")
RESHARD_POLICIES = ("default", "always", "never")
FSDP_POLICIES = ("auto", "always")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key."""


def option(default, doc: str, *, choices: tuple | None = None, minimum=None):
    """A config key: its default, one line of documentation, and optional checks."""
    meta = {"doc": doc, "choices": choices, "minimum": minimum}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DispatchConfig:
    type: str = option("mega_moe", "MoE experts implementation: 'mega_moe' (megamoe's fused "
                       "sm_90a backend on GPU, its reference backend on CPU), 'torch' "
                       "(megamoe's TorchTitan-style torch._grouped_mm baseline) or 'hf' "
                       "(transformers' own 'grouped_mm' experts)", choices=DISPATCH_TYPES)
    precision: str = option("bf16", "matrix precision of the experts: 'bf16'; 'fp8' (blockwise "
                            "FP8 forward and backward) and 'fp8_bwd' (FP8 backward) for "
                            "'mega_moe'; 'fp8' for 'torch'; 'mxfp8' needs Blackwell",
                            choices=PRECISIONS)
    backward_mode: str = option("saved", "'saved' keeps the experts' L1 output for the "
                                "backward (under activation checkpointing only for the layer "
                                "being recomputed); 'recompute' recomputes it", choices=BACKWARD_MODES)


@dataclass
class MoEConfig:
    dispatch: DispatchConfig = field(default_factory=DispatchConfig,
                                     metadata={"doc": "how the experts run"})
    aux_loss_coef: float | None = option(None, "coefficient of transformers' load-balancing "
                                         "loss; default: the model config's "
                                         "router_aux_loss_coef; 0 turns it off", minimum=0.0)


@dataclass
class ModelConfig:
    preset: str = option("", "a built-in transformers config: 'qwen3-30b-a3b' or 'tiny' "
                         "(exactly one of preset and path)")
    path: str = option("", "a local directory (or, online, a hub name) holding a transformers "
                       "config.json, loaded with from_pretrained")
    num_layers: int | None = option(None, "override of num_hidden_layers", minimum=1)
    init: str = option("random", "'random' (the model class's own initialisation, seeded by "
                       "train.seed) or 'pretrained' (load the weights under model.path)",
                       choices=("random", "pretrained"))
    attn_implementation: str = option("sdpa", "transformers attention implementation "
                                      "('sdpa', 'eager', 'flash_attention_2', ...)")
    sdpa_backend: str = option("auto", "with attn_implementation = 'sdpa': the PyTorch "
                               "attention kernel tried first ('cudnn', 'flash', 'efficient', "
                               "'math'; the others stay as fallbacks), or 'auto' (PyTorch's "
                               "own order)", choices=SDPA_BACKENDS)
    config: dict = option({}, "further overrides of the transformers config's attributes, "
                          "e.g. {vocab_size = 32768}")
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"doc": "the MoE layers"})


@dataclass
class DataConfig:
    paths: list[str] = option([], "text or jsonl files, directories (searched recursively "
                              "for data.extensions) or glob patterns; empty: the Python "
                              "standard library's own source files")
    extensions: list[str] = option([".txt", ".md", ".jsonl"], "file suffixes taken from "
                                   "directories in data.paths")
    text_field: str = option("text", "the field of each jsonl record that holds the text")
    tokenizer: str = option("bytes", "'bytes' (UTF-8 bytes + one EOS id, vocabulary 257), "
                            "'bpe' (a byte-level BPE trained locally on the corpus with "
                            "`tokenizers`, cached) or a path to a tokenizer.json")
    bpe_vocab_size: int = option(32768, "vocabulary of the locally trained BPE", minimum=260)
    seq_len: int = option(16384, "tokens per sequence (documents are packed, EOS between "
                          "them)", minimum=2)
    shuffle: bool = option(True, "shuffle the documents before packing, anew each epoch "
                           "(seeded by train.seed and the epoch)")
    cache_dir: str = option("", "where the trained tokenizer and the tokenized corpus are "
                            "cached; default $MEGAMOE_CACHE_DIR, else $XDG_CACHE_HOME/megamoe, else "
                            "~/.cache/megamoe")


@dataclass
class OptimConfig:
    lr: float = option(3e-4, "peak learning rate", minimum=0.0)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of optim.lr",
                                 minimum=0.0)
    betas: list[float] = option([0.9, 0.95], "AdamW (beta1, beta2)")
    eps: float = option(1e-8, "AdamW epsilon", minimum=0.0)
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (every parameter)",
                                 minimum=0.0)
    warmup_steps: int = option(10, "linear warm-up from 0 to optim.lr", minimum=0)
    decay: str = option("cosine", "decay after warm-up, to min_lr_ratio * lr",
                        choices=("cosine", "linear", "constant"))
    decay_steps: int | None = option(None, "length of warm-up + decay; default train.steps "
                                     "(set it when one schedule spans runs of different "
                                     "train.steps)", minimum=1)
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = no clipping",
                              minimum=0.0)
    implementation: str = option("auto", "AdamW implementation: 'auto' (fused on GPU, "
                                 "foreach on CPU), 'fused', 'foreach' or 'for_loop'; on one "
                                 "rank without FSDP2 'fused' is megamoe's one-pass step of "
                                 "the fp32 masters and their bf16 copies",
                                 choices=("auto", "fused", "foreach", "for_loop"))


@dataclass
class TrainConfig:
    steps: int = option(100, "optimizer steps", minimum=1)
    micro_batch_size: int = option(1, "sequences per rank per micro-batch", minimum=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", minimum=1)
    activation_checkpointing: bool = option(True, "activation checkpointing, one "
                                            "region per decoder layer")
    checkpoint_save_attention: bool = option(True, "with activation_checkpointing: keep the "
                                             "fused attention kernel's outputs (bf16 tokens x "
                                             "heads x head_dim + fp32 log-sum-exp per layer) "
                                             "so the backward does not rerun it; false "
                                             "recomputes the whole layer")
    checkpoint_skip_expert_outputs: bool = option(True, "with activation_checkpointing and "
                                                  "the mega_moe experts on one GPU per "
                                                  "expert group: the recompute runs the fused "
                                                  "experts only as far as their backward "
                                                  "needs (L1 in the saved backward mode), not "
                                                  "the output the recompute throws away; the "
                                                  "same gradients, bit for bit")
    compile: bool = option(False, "torch.compile each decoder layer")
    compile_dense: bool = option(False, "torch.compile each decoder layer's dense part (its "
                                 "attention block and norms, and the final norm), leaving "
                                 "the MoE blocks (router and experts) in eager mode")
    seed: int = option(0, "seed of the initialisation, the data order and the RNG", minimum=0)
    deterministic: bool = option(False, "torch.use_deterministic_algorithms(True) and "
                                 "CUBLAS_WORKSPACE_CONFIG=:4096:8")
    dtype: str = option("bf16", "compute dtype: 'bf16' (fp32 master weights, bf16 compute, "
                        "fp32 gradient reduction) or 'fp32'", choices=("bf16", "fp32"))
    device: str = option("auto", "'auto' (cuda when present), 'cuda' or 'cpu'",
                         choices=("auto", "cuda", "cpu"))
    cpu_threads: int = option(0, "torch.set_num_threads on CPU runs; 0 = torch's default "
                              "(small models run faster on one thread)", minimum=0)
    loss_chunk_size: int = option(2048, "tokens per chunk of the chunked LM-head + "
                                  "cross-entropy (its logits are chunk x vocab)", minimum=1)
    loss_implementation: str = option("auto", "the chunked loss's softmax and gradient between "
                                      "its matmuls: 'compiled' (torch.compile fuses them into "
                                      "a few passes over the bf16 logits), 'eager' (PyTorch "
                                      "ops over an fp32 copy) or 'auto' (compiled on CUDA, "
                                      "falling back to eager with a warning if compiling "
                                      "fails; eager on CPU)", choices=LOSS_IMPLEMENTATIONS)


@dataclass
class ParallelConfig:
    dp: int = option(-1, "data-parallel (FSDP2) degree of the experts: world size / ep; "
                     "-1 = derive it. Dense parameters are sharded over every rank",
                     minimum=-1)
    ep: int = option(1, "expert-parallel degree, inside one node (rank r of an EP group owns "
                     "experts [r*E/ep, (r+1)*E/ep))", minimum=1)
    reshard_after_forward: str = option("default", "whether FSDP2 units free their gathered "
                                        "bf16 parameters after the forward: 'always', "
                                        "'never' (faster, ~2 bytes per parameter more "
                                        "memory) or 'default' (only units sharded over more "
                                        "than one rank, never the last decoder layer; "
                                        "every unit on one GPU with fused FP8 experts); "
                                        "no effect where FSDP2 is off (parallel.fsdp)",
                                        choices=RESHARD_POLICIES)
    fsdp: str = option("auto", "'auto': FSDP2 where there is more than one rank; on one rank "
                       "the model computes in bf16 copies of fp32 master weights that the "
                       "optimizer steps (FSDP2's numbers without its copies); 'always': "
                       "FSDP2 on one rank too", choices=FSDP_POLICIES)


@dataclass
class CheckpointConfig:
    dir: str = option("", "checkpoint directory; default <log.dir>/checkpoints")
    interval: int = option(0, "save every this many steps and at the last step; 0 = never",
                           minimum=0)
    resume: str = option("none", "'none', 'latest' (the newest checkpoint in "
                         "checkpoint.dir, if any) or the path of one checkpoint")
    keep_last: int = option(2, "checkpoints kept (older ones are deleted); 0 = keep all",
                            minimum=0)


@dataclass
class LogConfig:
    dir: str = option("outputs/megamoe-train", "where the JSON log, the PNG and (by "
                      "default) the checkpoints go")
    interval: int = option(1, "print a line every this many steps (the JSON log has every "
                           "step)", minimum=1)
    plot: bool = option(True, "write loss and throughput curves as a PNG (needs matplotlib)")
    peak_tflops: float = option(0.0, "the GPU's dense bf16 peak for MFU; 0 = the datasheet "
                                "value of a known GPU (989 for H100/H200 SXM)", minimum=0.0)
    profile_step: int = option(0, "profile this step with torch.profiler and write its "
                               "per-kernel table (on a GPU also a table by host time and the "
                               "allocator's counters) to profile-step<N>.txt in log.dir; "
                               "0 = off",
                               minimum=0)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "the model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "the corpus"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "AdamW"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "the loop"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig,
                                     metadata={"doc": "FSDP2 and expert parallelism"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig,
                                         metadata={"doc": "torch.distributed.checkpoint"})
    log: LogConfig = field(default_factory=LogConfig, metadata={"doc": "output"})
    source: str = field(default="", metadata={"internal": True})  # where it was read from

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data


# ---------------------------------------------------------------- embedded configs

EMBEDDED_PACKAGE = "megamoe.train.configs"


def embedded_configs() -> list[str]:
    """Names of the configs shipped in the package (file names without .toml)."""
    files = resources.files(EMBEDDED_PACKAGE).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".toml"))


def read_source(name_or_path: str) -> tuple[str, str]:
    """(TOML text, description) of a config file or an embedded config's name."""
    path = Path(name_or_path)
    if path.is_file():
        return path.read_text(), str(path)
    stem = name_or_path[:-5] if name_or_path.endswith(".toml") else name_or_path
    if "/" not in name_or_path and stem in embedded_configs():
        return resources.files(EMBEDDED_PACKAGE).joinpath(f"{stem}.toml").read_text(), \
            f"embedded config {stem!r}"
    raise ConfigError(f"config: no file {name_or_path!r}, and no embedded config of that name "
                      f"(embedded: {', '.join(embedded_configs())})")


# ---------------------------------------------------------------- parsing and checks


def load(name_or_path: str | None, overrides: list[tuple[str, str]] = (),
         text: str | None = None) -> Config:
    """Reads and validates a config. `overrides` are (dotted key, TOML value text) pairs
    from the command line; `text` gives the TOML directly (tests)."""
    if text is None:
        text, source = read_source(name_or_path)
    else:
        source = name_or_path or "<text>"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config {source}: not valid TOML: {error}") from None
    for key, value_text in overrides:
        _set_dotted(raw, key, _parse_value(value_text))
    config = _build(Config, raw, "")
    config.source = source
    check_static(config)
    return config


def split_overrides(argv: list[str], error) -> tuple[list[str], list[tuple[str, str]]]:
    """Separates --section.key VALUE / --section.key=VALUE overrides (a dot in an option's
    name marks one) from the other arguments, before argparse sees them, so that an
    override's value is never taken for a positional argument. `error(message)` reports a
    missing value."""
    overrides, rest = [], []
    i = 0
    while i < len(argv):
        item = argv[i]
        name = item.split("=", 1)[0]
        if not (item.startswith("--") and "." in name):
            rest.append(item)
            i += 1
        elif "=" in item:
            overrides.append((name[2:], item.split("=", 1)[1]))
            i += 1
        elif i + 1 < len(argv):
            overrides.append((name[2:], argv[i + 1]))
            i += 2
        else:
            error(f"{item} needs a value")
            i += 1
    return rest, overrides


def _parse_value(text: str):
    """A command-line value read as a TOML value (42, 1e-4, true, "x", [1, 2]); a bare word
    that is not TOML is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(raw: dict, key: str, value) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table, "
                          f"got {_describe(raw)}")
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    for key in raw:
        if key not in known:
            raise ConfigError(_unknown_key_message(prefix + key, key, known, prefix))
    values = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal") or f.name not in raw:
            continue
        name = prefix + f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], name + ".")
        else:
            values[f.name] = _check_value(name, raw[f.name], hint, f.metadata)
    return cls(**values)


def _unknown_key_message(full: str, key: str, known: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    where = prefix.rstrip(".") or "the top level"
    return (f"{full}: unknown key{hint} (keys of [{where}]: {', '.join(known)})"
            if prefix else f"{full}: unknown section{hint} (sections: {', '.join(known)})")


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_value(name: str, value, hint, meta):
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list of {item.__name__}, got {_describe(value)}")
        return [_check_scalar(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a table, got {_describe(value)}")
        return value
    if optional and value is None:
        return None
    value = _check_scalar(name, value, hint)
    choices, minimum = meta.get("choices"), meta.get("minimum")
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint_text = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name}: expected one of {list(choices)}, got {value!r}{hint_text}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value!r}")
    return value


def _check_scalar(name: str, value, hint):
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{name}: expected {hint.__name__}, got {_describe(value)}")
    return value


def check_static(config: Config) -> None:
    """Checks that need neither the process group nor the model config."""
    from . import presets  # late: presets imports transformers

    model = config.model
    if bool(model.preset) == bool(model.path):
        raise ConfigError("model.preset / model.path: give exactly one of them "
                          f"(got preset={model.preset!r}, path={model.path!r})")
    if model.preset and model.preset not in presets.PRESETS:
        close = difflib.get_close_matches(model.preset, list(presets.PRESETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"model.preset: unknown preset {model.preset!r}{hint} "
                          f"(presets: {', '.join(presets.PRESETS)})")
    if model.init == "pretrained" and not model.path:
        raise ConfigError("model.init = 'pretrained' needs model.path (a preset has no weights)")
    dispatch = model.moe.dispatch
    built = BUILT_PRECISIONS[dispatch.type]
    if dispatch.precision not in built:
        why = ("needs Blackwell (sm_100) block-scaled MMA; on Hopper use 'bf16' or 'fp8'"
               if dispatch.precision == "mxfp8" else
               f"is not built for model.moe.dispatch.type = {dispatch.type!r}; use one of {list(built)}")
        raise ConfigError(f"model.moe.dispatch.precision: {dispatch.precision!r} {why}")
    if len(config.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(f"optim.betas: expected two values in [0, 1), got {config.optim.betas}")
    if config.optim.min_lr_ratio > 1.0:
        raise ConfigError(f"optim.min_lr_ratio: must be <= 1, got {config.optim.min_lr_ratio}")
    if config.log.profile_step > config.train.steps:
        raise ConfigError(f"log.profile_step: step {config.log.profile_step} is past the run's "
                          f"last step (train.steps = {config.train.steps})")
    if config.parallel.dp == 0:
        raise ConfigError("parallel.dp: must be >= 1, or -1 to derive it from the world size")
    if config.train.compile_dense and config.train.compile:
        raise ConfigError("train.compile_dense: train.compile already compiles each whole "
                          "decoder layer, its dense part included; set one of them")
    if (config.train.compile_dense and config.train.activation_checkpointing
            and config.train.checkpoint_save_attention):
        # The selective checkpointing policy picks the attention kernel out of the ops the
        # dispatcher shows it; whether it is shown the kernel that runs inside compiled
        # code (and so keeps its outputs) is not checked, and the saving must not be lost
        # without a word.
        raise ConfigError("train.compile_dense: not built with "
                          "train.checkpoint_save_attention = true (that the checkpointing "
                          "keeps the outputs of an attention kernel inside compiled code is "
                          "not checked); set train.checkpoint_save_attention = false")
    _check_data(config.data)
    resume = config.checkpoint.resume
    if resume not in ("none", "latest") and not Path(resume).is_dir():
        raise ConfigError(f"checkpoint.resume: expected 'none', 'latest' or the directory of a "
                          f"checkpoint, got {resume!r} (no such directory)")


def _check_data(data: DataConfig) -> None:
    from .data import expand_paths  # late: data imports numpy

    for i, pattern in enumerate(data.paths):
        try:
            expand_paths([pattern], data.extensions)
        except FileNotFoundError as error:
            raise ConfigError(f"data.paths[{i}]: {error}") from None
    if data.tokenizer not in ("bytes", "bpe") and not Path(data.tokenizer).exists():
        raise ConfigError(f"data.tokenizer: expected 'bytes', 'bpe' or the path of a "
                          f"tokenizer.json, got {data.tokenizer!r} (no such file)")
    for i, ext in enumerate(data.extensions):
        if not ext.startswith("."):
            raise ConfigError(f"data.extensions[{i}]: expected a suffix starting with '.', "
                              f"got {ext!r}")


def describe_keys(cls=Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) of every key, for the documentation and --help-config."""
    rows = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe_keys(hint, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        type_name = _type_name(hint)
        doc = f.metadata["doc"]
        if f.metadata.get("choices"):
            doc += f" (one of {', '.join(repr(c) for c in f.metadata['choices'])})"
        rows.append((prefix + f.name, type_name, _toml_repr(default), doc))
    return rows


def _type_name(hint) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return f"{_type_name(args[0])} (optional)"
    if typing.get_origin(hint) is list:
        return f"list of {typing.get_args(hint)[0].__name__}"
    return {dict: "table"}.get(hint, hint.__name__)


def _toml_repr(value) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return repr(value)


def markdown_table() -> str:
    """The key reference of docs/training.md (a test keeps the two equal; regenerate with
    python -c 'from megamoe.train.config import markdown_table; print(markdown_table())')."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, doc in describe_keys():
        lines.append(f"| `{key}` | {type_name} | `{default}` | {doc} |")
    return "\n".join(lines)
