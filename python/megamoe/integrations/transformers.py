"""megamoe as a Hugging Face transformers experts implementation.

transformers (>= 5.17) routes the experts module of every MoE model through its experts
interface; importing this module registers megamoe there as ``"megamoe"``::

    import megamoe.integrations.transformers as mt   # registers "megamoe"
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 experts_implementation="megamoe")
    # or, on a model already built: model.set_experts_implementation("megamoe")
    mt.configure(model, backend="fused", backward_mode="saved")   # optional

Options (``configure``, and for the defaults environment variables, read when this
module is imported): ``backend`` (``MEGAMOE_BACKEND``): "auto" (default: "fused" for CUDA
inputs, "reference" for CPU ones), "fused", "torch" or "reference"; ``precision``
(``MEGAMOE_PRECISION``, default "bf16"); ``backward_mode`` (``MEGAMOE_BACKWARD_MODE``,
"recompute" or "saved", used by "fused"); ``on_unsupported`` (``MEGAMOE_ON_UNSUPPORTED``):
"error" (default) or "fallback" (run transformers' own implementation, with a warning
saying why, once per reason); ``group`` and ``buffer``: expert parallelism, as in
``megamoe.moe`` (each rank's experts module holds its E/W experts; the ids stay global);
``check_ids`` (default False): range-check the router's ids on the host, a sync per layer.
Settings made on a model override the process-wide ones, which override the environment,
which overrides the defaults.

megamoe serves experts modules with transformers' default layout and gating:
gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], no biases, SiLU gating
(``silu(gate) * up``, transformers' default ``_apply_gate``) and no other parameters. For
anything else (biases, transposed or interleaved weights, no gate, another activation or
gating, quantized or DTensor weights) and for problems the chosen backend cannot run
(e.g. "fused" needs bf16 CUDA tensors with H and I multiples of 128), it raises
MegaMoEError saying why, or with on_unsupported="fallback" runs transformers'
"grouped_mm" (the module's own forward where grouped_mm does not take the dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from .._fused_op import BACKWARD_MODES
from ..buffer import Buffer
from ..errors import MegaMoEError
from ..ops import moe

try:
    import transformers.activations as _hf_activations
    from transformers.integrations import moe as _hf_moe
    _EXPERTS_FUNCTIONS = _hf_moe.ALL_EXPERTS_FUNCTIONS
except (ImportError, AttributeError) as _err:  # no transformers, or one without the interface
    raise ImportError(
        "megamoe.integrations.transformers needs transformers >= 5.17 (its experts "
        "interface, transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS): "
        "pip install 'megamoe[hf]'") from _err

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None

__all__ = ["Options", "configure", "reset", "options", "register", "experts_forward",
           "shard_experts", "is_experts_module", "MegaMoEFallbackWarning",
           "ENVIRONMENT_VARIABLES"]

BACKENDS = ("auto",) + _validate.BACKENDS
ON_UNSUPPORTED = ("error", "fallback")
ENVIRONMENT_VARIABLES = {
    "backend": "MEGAMOE_BACKEND",
    "precision": "MEGAMOE_PRECISION",
    "backward_mode": "MEGAMOE_BACKWARD_MODE",
    "on_unsupported": "MEGAMOE_ON_UNSUPPORTED",
}
_CHOICES = {"backend": BACKENDS, "precision": _validate.PRECISIONS,
            "backward_mode": BACKWARD_MODES, "on_unsupported": ON_UNSUPPORTED}
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# transformers' grouped_mm runs torch's grouped GEMM, which takes no float64.
_GROUPED_MM_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHTS = ("gate_up_proj", "down_proj")
_SETTINGS_ATTR = "_megamoe_settings"


class MegaMoEFallbackWarning(UserWarning):
    """An experts module runs transformers' own implementation (on_unsupported="fallback")."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The options one experts module runs with (see the module docstring)."""

    backend: str = "auto"
    precision: str = "bf16"
    backward_mode: str = "recompute"
    group: object = None
    buffer: object = None
    on_unsupported: str = "error"
    # transformers' routers take their ids from topk over the E router logits, so they are
    # in range; checking them costs a host sync per layer, which stalls the CPU's launch
    # queue in every forward. configure(check_ids=True) checks them anyway.
    check_ids: bool = False


def _check_choice(name: str, value, origin: str) -> None:
    if value not in _CHOICES[name]:
        raise MegaMoEError(f"{origin}: expected one of {_CHOICES[name]}, got {value!r}")


def _read_environment(environ) -> dict:
    """The defaults that environment variables set, checked (the error names the variable)."""
    found = {}
    for name, variable in ENVIRONMENT_VARIABLES.items():
        value = environ.get(variable)
        if value is None or value == "":
            continue
        _check_choice(name, value.strip(), variable)
        found[name] = value.strip()
    return found


_ENVIRONMENT = _read_environment(os.environ)
_PROCESS: dict = {}  # configure(model=None, ...)


class _ModuleSettings(dict):
    """The options configure() set on one experts module. A copy of the model (deepcopy)
    keeps them and shares the process group and buffer, which cannot be copied."""

    def __deepcopy__(self, memo):
        return _ModuleSettings(self)


def _given(backend, precision, backward_mode, group, buffer, on_unsupported,
           check_ids=None) -> dict:
    given = {}
    if check_ids is not None:
        if not isinstance(check_ids, bool):
            raise MegaMoEError(f"check_ids: expected True or False, got {check_ids!r}")
        given["check_ids"] = check_ids
    for name, value in (("backend", backend), ("precision", precision),
                        ("backward_mode", backward_mode), ("on_unsupported", on_unsupported)):
        if value is not None:
            _check_choice(name, value, name)
            given[name] = value
    if group is not None:
        if not (torch.distributed.is_available()
                and isinstance(group, torch.distributed.ProcessGroup)):
            raise MegaMoEError(f"group: expected a torch.distributed ProcessGroup, "
                               f"got {type(group).__name__}")
        given["group"] = group
    if buffer is not None:
        if not isinstance(buffer, Buffer):
            raise MegaMoEError(f"buffer: expected a megamoe.Buffer, got {type(buffer).__name__}")
        given["buffer"] = buffer
    return given


def is_experts_module(module) -> bool:
    """True for a module of a class that transformers' @use_experts_implementation made
    (it carries the layout flags that decorator sets)."""
    return isinstance(module, nn.Module) and all(
        hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed",
                                           "is_concatenated"))


def _experts_modules(model) -> list:
    if not isinstance(model, nn.Module):
        raise MegaMoEError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
    found = [m for m in model.modules() if is_experts_module(m)]
    if not found:
        raise MegaMoEError(f"model: {type(model).__name__} contains no transformers experts "
                           "module (a class decorated with @use_experts_implementation)")
    return found


def configure(model=None, *, backend=None, precision=None, backward_mode=None, group=None,
              buffer=None, on_unsupported=None, check_ids=None) -> None:
    """Sets options: process-wide defaults (model=None), or on every experts module inside
    `model` (overriding the defaults). An argument left None leaves that option as it is;
    `reset` clears them. Unknown values raise MegaMoEError naming the argument.

    backend: "auto" | "fused" | "torch" | "reference"; precision: megamoe's precisions
    ("bf16", ...); backward_mode: "recompute" | "saved"; group, buffer: expert parallelism
    as in megamoe.moe (each rank's experts module then holds its E/W experts, and
    top_k_index holds global ids); on_unsupported: "error" | "fallback"; check_ids: check
    every call's ids on the host (one sync per layer; default False, see Options)."""
    given = _given(backend, precision, backward_mode, group, buffer, on_unsupported,
                   check_ids)
    if model is None:
        _PROCESS.update(given)
        return
    for module in _experts_modules(model):
        # A new object, read back with getattr: torch.compile guards on both, so a compiled
        # model sees the change (it does not guard what module.__dict__.get returns).
        old = getattr(module, _SETTINGS_ATTR, None) or {}
        setattr(module, _SETTINGS_ATTR, _ModuleSettings({**old, **given}))


def reset(model=None) -> None:
    """Clears what configure() set: the process-wide options (model=None, the environment's
    stay), or those of the experts modules inside `model`."""
    if model is None:
        _PROCESS.clear()
        return
    for module in _experts_modules(model):
        if hasattr(module, _SETTINGS_ATTR):
            delattr(module, _SETTINGS_ATTR)


def _effective(module) -> Options:
    own = getattr(module, _SETTINGS_ATTR, None) or {}
    return Options(**{**_ENVIRONMENT, **_PROCESS, **own})


def options(module) -> Options:
    """The options one experts module runs with (backend "auto" is resolved per call from
    the inputs' device)."""
    if not is_experts_module(module):
        raise MegaMoEError(f"module: expected a transformers experts module, got "
                           f"{type(module).__name__}")
    return _effective(module)


def register(name: str = "megamoe") -> None:
    """Registers experts_forward in transformers' experts interface under `name`
    (idempotent; importing this module registers "megamoe")."""
    if not isinstance(name, str) or not name:
        raise MegaMoEError(f"name: expected a non-empty string, got {name!r}")
    current = _EXPERTS_FUNCTIONS.get(name)
    if current is experts_forward:
        return
    # Another implementation keeps its name; ours (from before a reload) is replaced.
    theirs = current is not None and getattr(current, "__module__", None) != __name__
    if name == "eager" or theirs:
        owner = getattr(current, "__module__", "transformers")
        raise MegaMoEError(f"name: {name!r} is already an experts implementation (of {owner}); "
                           "choose another name")
    _EXPERTS_FUNCTIONS.register(name, experts_forward)


# -- what megamoe can serve --------------------------------------------------------------

def _is_silu(act) -> bool:
    """SiLU by identity: the function itself, or a module of an exact class known to compute
    it (a subclass may override forward)."""
    if act is F.silu:
        return True
    silu_classes = (nn.SiLU, getattr(_hf_activations, "SiLUActivation", nn.SiLU))
    return isinstance(act, nn.Module) and type(act) in silu_classes


def _describe(obj) -> str:
    if obj is None:
        return "missing"
    if isinstance(obj, nn.Module):
        return type(obj).__name__
    return getattr(obj, "__name__", None) or repr(obj)


def _custom_gate(module) -> bool:
    default = getattr(_hf_moe, "_default_apply_gate", None)
    return ("_apply_gate" in module.__dict__
            or getattr(type(module), "_apply_gate", None) is not default)


def _module_problems(module) -> list[str]:
    """Why megamoe cannot compute this module's experts, whatever the backend."""
    problems = []
    if getattr(module, "has_bias", False):
        problems.append("its experts add biases (has_bias=True)")
    if getattr(module, "is_transposed", False):
        problems.append("its weights are stored transposed (is_transposed=True, where megamoe "
                        "takes gate_up_proj [E, 2I, H] and down_proj [E, H, I])")
    if not getattr(module, "is_concatenated", True):
        problems.append("its gate and up rows are interleaved (is_concatenated=False, where "
                        "megamoe takes the I gate rows, then the I up rows)")
    if not getattr(module, "has_gate", True):
        problems.append("its experts have no gate (has_gate=False, where megamoe computes "
                        "down(silu(gate(x)) * up(x)))")
    elif _custom_gate(module):
        problems.append(f"{type(module).__name__} defines its own _apply_gate (a gating other "
                        "than silu(gate) * up, e.g. clamped)")
    elif not _is_silu(getattr(module, "act_fn", None)):
        problems.append(f"its activation is {_describe(getattr(module, 'act_fn', None))}, "
                        "not SiLU")
    names = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    if names - set(_WEIGHTS):
        problems.append(f"it holds {sorted(names - set(_WEIGHTS))} beside gate_up_proj and "
                        "down_proj")
    for name in _WEIGHTS:
        w = getattr(module, name, None)
        if not isinstance(w, torch.Tensor):
            problems.append(f"it has no {name} tensor")
        elif _is_dtensor(w):
            problems.append(f"{name} is a DTensor (sharded by a transformers tp_plan); for "
                            "expert parallelism give each rank its experts' weights and "
                            "configure(group=...)")
        elif w.dtype not in _FLOATS:
            problems.append(f"{name} is {w.dtype} (megamoe takes float32, float64, bfloat16 "
                            "or float16 weights, not quantized ones)")
    return problems


def _is_dtensor(t) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def _world_size(group) -> int:
    if group is None:
        return 1
    if not torch.distributed.is_initialized():
        raise MegaMoEError("group: torch.distributed is not initialised")
    return torch.distributed.get_world_size(group)


def _compute_dtype(weights: torch.Tensor, x: torch.Tensor, backend: str) -> torch.dtype:
    # Under CUDA autocast to bf16 (fp32 master weights, e.g. the Trainer's bf16=True), the
    # GPU backends compute in bf16 as autocast's own matmuls do; otherwise everything runs
    # in the weights' dtype, as transformers' implementations do.
    if (backend in ("fused", "torch") and x.is_cuda and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16
            and weights.dtype in (torch.float32, torch.float16)):
        return torch.bfloat16
    return weights.dtype


def _call_problem(x, ids, p, w1, w2, opts: Options, backend: str) -> str | None:
    """Why the chosen backend cannot run this call (megamoe's own argument checks)."""
    try:
        _validate.check_backend_and_precision(backend, opts.precision)
        _validate.check_call(x, ids, p, w1, w2, opts.group, backend)
    except MegaMoEError as err:
        return err.args[0]  # not str(err): torch.compile traces .args, not a C str()
    return None


# -- the experts implementation ----------------------------------------------------------

_WARNED: set = set()


def _fallback(module, reason: str, world: int, hidden_states, top_k_index, top_k_weights):
    if world > 1:
        raise MegaMoEError(
            f"megamoe cannot serve {type(module).__name__}: {reason}. It cannot fall back "
            f"to transformers' implementations: under an expert-parallel group of {world} "
            "ranks each rank holds only its own experts, which they do not combine")
    if module.gate_up_proj.dtype in _GROUPED_MM_FLOATS and "grouped_mm" in _EXPERTS_FUNCTIONS:
        fn, name = _EXPERTS_FUNCTIONS["grouped_mm"], "'grouped_mm'"
    else:
        fn = getattr(type(module).forward, "__wrapped__", None)
        name = "own eager forward"
        if fn is None:
            raise MegaMoEError(f"megamoe cannot serve {type(module).__name__}: {reason}. It "
                               "has no transformers implementation to fall back to")
    key = (type(module).__qualname__, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"megamoe: {type(module).__name__} runs transformers' {name} experts "
                      f"implementation instead: {reason}", MegaMoEFallbackWarning, stacklevel=3)
    return fn(module, hidden_states, top_k_index, top_k_weights)


def _unsupported(module, opts: Options, world: int, reason: str, args, *, backend=None):
    if opts.on_unsupported == "fallback" or world > 1:
        return _fallback(module, reason, world, *args)
    remedy = ("choose another backend with configure(backend=...)" if backend is not None
              else "use another experts implementation (e.g. 'grouped_mm')")
    raise MegaMoEError(f"megamoe cannot serve {type(module).__name__}: {reason}. To run it, "
                       f"{remedy}, or configure(on_unsupported='fallback') to let transformers' "
                       "own implementation run it")


# How the configs of transformers' MoE families name the total number of routed experts.
_CONFIG_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _global_experts(module) -> int | None:
    """The model's number of routed experts, from the module's config (None if unknown)."""
    config = getattr(module, "config", None)
    for name in _CONFIG_EXPERT_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_expert_split(module, local_experts: int, world: int) -> None:
    """Each rank of an EP group holds E/W experts; without a group, a module that holds
    fewer experts than it counts was sliced for expert parallelism that is not configured
    (transformers' own expert parallelism counts only the local ones: it passes)."""
    if world > 1:
        total = _global_experts(module)
        if total is not None and total != local_experts * world:
            share = total // world
            raise MegaMoEError(
                f"{type(module).__name__} holds {local_experts} experts of {total}; with an "
                f"expert-parallel group of {world} ranks each rank must hold its {share}: "
                f"rank r keeps experts [r*{share}, (r+1)*{share}) of gate_up_proj and "
                "down_proj (shard_experts(model, group) does it)")
        return
    counted = getattr(module, "num_experts", None)
    if isinstance(counted, int) and counted != local_experts:
        raise MegaMoEError(
            f"{type(module).__name__} holds {local_experts} experts but counts "
            f"num_experts={counted}: experts sliced for expert parallelism need "
            "configure(group=...)")


def shard_experts(model, group) -> None:
    """Expert parallelism: keeps in every experts module of `model` only this rank's experts
    (rank r of W: [r*E/W, (r+1)*E/W), as new Parameters; build the optimizer afterwards)
    and configures `group` on them. The router and the rest of the model are untouched."""
    import torch.distributed as dist
    modules = _experts_modules(model)
    given = _given(None, None, None, group, None, None)
    if "group" not in given:
        raise MegaMoEError("group: expected the expert-parallel ProcessGroup, got None")
    world, rank = _world_size(group), dist.get_rank(group)
    for module in modules:
        total = _global_experts(module) or module.gate_up_proj.shape[0]
        held = module.gate_up_proj.shape[0]
        if held != total:
            raise MegaMoEError(f"model: {type(module).__name__} holds {held} of {total} "
                               "experts; it is sharded already")
        if total % world:
            raise MegaMoEError(f"group: {total} experts do not split over {world} ranks")
        share = total // world
        for name in _WEIGHTS:
            weight = getattr(module, name)
            local = weight.detach()[rank * share:(rank + 1) * share].clone()
            setattr(module, name, nn.Parameter(local, requires_grad=weight.requires_grad))
    configure(model, group=group)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: hidden_states [N, H], top_k_index [N, k] (global
    expert ids), top_k_weights [N, k] -> [N, H] in hidden_states' dtype, by megamoe.moe."""
    opts = _effective(self)
    backend = opts.backend
    if backend == "auto":
        backend = "fused" if hidden_states.is_cuda else "reference"
    world = _world_size(opts.group)
    args = (hidden_states, top_k_index, top_k_weights)
    problems = _module_problems(self)
    if problems:
        return _unsupported(self, opts, world, "; ".join(problems), args)

    H, k = hidden_states.shape[-1], top_k_index.shape[-1]
    x = hidden_states.reshape(-1, H)
    ids = top_k_index.reshape(-1, k)
    weights = top_k_weights.reshape(-1, k)
    w_gate_up, w_down = self.gate_up_proj, self.down_proj
    dtype = _compute_dtype(w_gate_up, x, backend)
    x = x.to(dtype)
    if w_gate_up.dtype != dtype:
        w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    if weights.dtype not in (torch.float32, torch.bfloat16) and not (
            backend == "reference" and weights.dtype == torch.float64):
        weights = weights.float()
    _check_expert_split(self, w_gate_up.shape[0], world)
    problem = _call_problem(x, ids, weights, w_gate_up, w_down, opts, backend)
    if problem is not None:
        hint = ""
        if backend in ("fused", "torch") and x.is_cuda and x.dtype != torch.bfloat16:
            hint = (" (load the model with dtype=torch.bfloat16, or run it under "
                    "torch.autocast('cuda', dtype=torch.bfloat16))")
        return _unsupported(self, opts, world, f"with backend={backend!r}: {problem}{hint}",
                            args, backend=backend)
    if opts.group is None:
        # transformers' expert-parallel router marks a slot owned by another rank with the
        # id num_local_experts; its implementations skip such slots, as megamoe skips -1.
        ids = ids.masked_fill(ids == w_gate_up.shape[0], -1)
    # The inputs are cast above; autocast must not recast the matmuls of the backends.
    no_autocast = (torch.autocast(x.device.type, enabled=False)
                   if torch.is_autocast_enabled(x.device.type) else contextlib.nullcontext())
    with no_autocast:
        y = moe(x, ids, weights, w_gate_up, w_down, group=opts.group, buffer=opts.buffer,
                precision=opts.precision, backend=backend, backward_mode=opts.backward_mode,
                check_ids=opts.check_ids)
    return y.reshape(hidden_states.shape).to(hidden_states.dtype)


register()
