"""Checks a layer call's arguments and says plainly what is wrong.

Backends differ in what they can run; each check names the argument, what was expected and
what was given, so a user can fix the call without reading the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import MegaMoEError, NotBuiltError

BACKENDS = ("fused", "torch", "reference")
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
# torch._grouped_mm needs 16-byte aligned rows.
TORCH_DIM_MULTIPLE = 8
FUSED_DIM_MULTIPLE = 128
FUSED_MAX_TOPK = 16
FUSED_MAX_EXPERTS = 1024

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_GROUPED_MM_CPU_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Problem:
    """Sizes of one layer call."""

    tokens: int          # T, tokens on this rank
    hidden: int          # H
    intermediate: int    # I
    topk: int            # k
    local_experts: int   # E_local, experts whose weights this rank holds
    world_size: int      # W, ranks in the expert-parallel group

    @property
    def num_experts(self) -> int:  # E_total
        return self.local_experts * self.world_size


def check_backend_and_precision(backend: str, precision: str) -> None:
    if backend not in BACKENDS:
        raise MegaMoEError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if precision not in PRECISIONS:
        raise MegaMoEError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if backend == "reference":
        return  # the reference computes the exact math whatever the precision
    if precision == "mxfp8":
        raise MegaMoEError(
            "precision='mxfp8' (1x32 blocks, e8m0 scales) needs Blackwell (sm_100) block-scaled "
            "MMA; on Hopper use 'fp8' (blockwise 1x128 / 128x128 scales) or 'bf16'")
    if precision == "bf16" or (backend == "torch" and precision == "fp8") or backend == "fused":
        return
    raise NotBuiltError(f"precision={precision!r} is not built yet for backend={backend!r}; use "
                        "'bf16' or 'fp8' (backend='fused' also runs 'fp8_bwd')")


def _tensor(name, value):
    # Any strides are accepted: megamoe.moe makes a dense copy where a backend needs one.
    if not isinstance(value, torch.Tensor):
        raise MegaMoEError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def dense_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, backend):
    """The call's tensors, each replaced by a contiguous copy when it is not contiguous.

    The library's kernels and the C++ reference read dense row-major memory. A copy is
    cheap next to the layer and is differentiable, so a strided input gives the same
    result and gradients as its contiguous copy. backend="fused" and "torch" on CUDA also
    read the rows of x and the weights with 16-byte vector loads and TMA, so such a
    contiguous view whose start is not 16-byte aligned (a slice at an odd offset) is copied
    too; the kernels would refuse it."""
    rows_aligned = backend != "reference" and x.is_cuda
    return (_dense(x, rows_aligned), _dense(topk_ids, False), _dense(topk_weights, False),
            _dense(w_gate_up, rows_aligned), _dense(w_down, rows_aligned))


def _dense(t, needs_alignment):
    if not t.is_contiguous():
        return t.contiguous()
    if needs_alignment and _misaligned(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _misaligned(t) -> bool:
    # While torch.compile traces, tensors have no data pointer; the op then gets what the
    # compiled graph allocates, and the library still refuses a misaligned pointer.
    if torch.compiler.is_compiling() or t.numel() == 0:
        return False
    try:
        return t.data_ptr() % 16 != 0
    except RuntimeError:  # fake or functional tensors outside dynamo
        return False


def _shape(name, value, expected, how):
    if tuple(value.shape) != tuple(expected):
        raise MegaMoEError(f"{name}: expected shape {list(expected)} ({how}), got {list(value.shape)}")


def _group_size(group):
    if group is None:
        return 1
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise MegaMoEError("group: torch.distributed is not initialised")
    return dist.get_world_size(group)


def check_call(x, topk_ids, topk_weights, w_gate_up, w_down, group, backend) -> Problem:
    """Validates shapes, dtypes and devices; returns the problem's sizes. Strides are not
    checked: see dense_inputs."""
    for name, value in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                        ("w_gate_up", w_gate_up), ("w_down", w_down)):
        _tensor(name, value)
    if x.dim() != 2:
        raise MegaMoEError(f"x: expected 2 dimensions [T, H], got shape {list(x.shape)}; "
                           "flatten the batch and sequence dimensions first")
    T, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise MegaMoEError(f"topk_ids: expected shape [T={T}, k], got {list(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if k < 1:
        raise MegaMoEError("topk_ids: k (its second dimension) must be at least 1")
    _shape("topk_weights", topk_weights, (T, k), "same as topk_ids")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 != 0:
        raise MegaMoEError(f"w_gate_up: expected shape [E_local, 2*I, H={H}], got {list(w_gate_up.shape)}")
    E_local, two_I, H_w = w_gate_up.shape
    I = two_I // 2
    if H_w != H:
        raise MegaMoEError(f"w_gate_up: expected shape [E_local, 2*I, H={H}] (H from x), got {list(w_gate_up.shape)}")
    if E_local < 1 or I < 1:
        raise MegaMoEError(f"w_gate_up: expected at least one expert and I >= 1, got {list(w_gate_up.shape)}")
    _shape("w_down", w_down, (E_local, H, I), f"[E_local, H, I] from w_gate_up {list(w_gate_up.shape)}")

    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise MegaMoEError(f"topk_ids: expected dtype int32 or int64, got {topk_ids.dtype}")
    if x.dtype not in _FLOATS:
        raise MegaMoEError(f"x: expected a floating dtype, got {x.dtype}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise MegaMoEError(f"{name}: expected dtype {x.dtype} (the dtype of x), got {w.dtype}")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise MegaMoEError(f"topk_weights: expected dtype float32 or bfloat16, got {topk_weights.dtype}")

    for name, value in (("topk_ids", topk_ids), ("topk_weights", topk_weights),
                        ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if value.device != x.device:
            raise MegaMoEError(f"{name}: expected device {x.device} (the device of x), got {value.device}")

    problem = Problem(T, H, I, k, E_local, _group_size(group))
    if k > problem.num_experts:
        raise MegaMoEError(f"topk_ids: k={k} is larger than the number of experts E={problem.num_experts}")
    _check_backend_limits(problem, x, backend, group)
    return problem


def _check_backend_limits(problem: Problem, x, backend, group):
    H, I = problem.hidden, problem.intermediate
    if backend == "reference" and group is not None and problem.world_size > 1:
        raise MegaMoEError("backend='reference' runs the global problem on one device and takes no "
                           "expert-parallel group; gather the experts' weights onto one rank")
    if backend == "fused":
        _check_fused_limits(problem, x, group)
    if backend == "torch" and x.is_cuda:
        _require_bf16_and_dims("torch", x, H, I, TORCH_DIM_MULTIPLE)
    if backend == "torch" and not x.is_cuda and x.dtype not in _GROUPED_MM_CPU_FLOATS:
        raise MegaMoEError(f"backend='torch' on {x.device} runs torch._grouped_mm, which takes "
                           f"float32, bfloat16 or float16, got x in {x.dtype}; use "
                           "backend='reference' for float64")


def _require_bf16_and_dims(backend, x, H, I, multiple):
    if x.dtype != torch.bfloat16:
        raise MegaMoEError(f"backend={backend!r} on CUDA computes in bf16: expected x and the "
                           f"weights in torch.bfloat16, got {x.dtype}")
    if H % multiple or I % multiple:
        raise MegaMoEError(f"backend={backend!r} needs H and I to be multiples of {multiple}, "
                           f"got H={H}, I={I}")


def _check_fused_limits(problem: Problem, x, group):
    H, I = problem.hidden, problem.intermediate
    if not x.is_cuda:
        raise MegaMoEError(f"backend='fused' runs on CUDA tensors, got x on {x.device}")
    _require_bf16_and_dims("fused", x, H, I, FUSED_DIM_MULTIPLE)
    if problem.topk > FUSED_MAX_TOPK:
        raise MegaMoEError(f"backend='fused' takes k <= {FUSED_MAX_TOPK}, got k={problem.topk}")
    if problem.num_experts > FUSED_MAX_EXPERTS:
        raise MegaMoEError(f"backend='fused' takes at most {FUSED_MAX_EXPERTS} experts, "
                           f"got {problem.num_experts}")


def check_ep_buffer(buffer, problem: Problem, group, backend, x) -> None:
    """The fused backend under an EP group of more than one rank needs the group's Buffer,
    made for these sizes; other calls take none."""
    from .buffer import Buffer

    ep = backend == "fused" and group is not None and problem.world_size > 1
    if not ep:
        if buffer is not None:
            raise MegaMoEError("buffer= belongs to backend='fused' with an expert-parallel group "
                               "of more than one rank; this call takes no buffer")
        return
    if not isinstance(buffer, Buffer):
        raise MegaMoEError("backend='fused' with an expert-parallel group needs buffer="
                           "megamoe.Buffer(group, max_tokens_per_rank, hidden, intermediate, "
                           f"num_experts, topk), got {type(buffer).__name__}")
    if buffer.group is not group and buffer.world_size != problem.world_size:
        raise MegaMoEError("buffer: made for another process group")
    wanted = (problem.num_experts, problem.hidden, problem.intermediate, problem.topk)
    have = (buffer.num_experts, buffer.hidden, buffer.intermediate, buffer.topk)
    if wanted != have:
        raise MegaMoEError(f"buffer: made for (E, H, I, k) = {have}, the call has {wanted}")
    if x.shape[0] > buffer.max_tokens_per_rank:
        raise MegaMoEError(f"x: {x.shape[0]} tokens, more than the buffer's "
                           f"max_tokens_per_rank={buffer.max_tokens_per_rank}")
    if x.device != buffer.device:
        raise MegaMoEError(f"x is on {x.device}, the buffer on {buffer.device}")


def check_weight_grad_accumulators(accumulators, w_gate_up, w_down, backend) -> None:
    """(acc_gate_up, acc_down): fp32 buffers shaped and placed like the weights, either may
    be None; the fused backward adds the weight gradients into them."""
    if accumulators is None:
        return
    if backend != "fused":
        raise MegaMoEError("weight_grad_accumulators: only backend='fused' adds the weight "
                           f"gradients into fp32 buffers, got backend={backend!r}")
    if not isinstance(accumulators, (tuple, list)) or len(accumulators) != 2:
        raise MegaMoEError("weight_grad_accumulators: expected a pair (acc_gate_up, acc_down) "
                           "of fp32 tensors or None")
    for name, acc, weight in (("acc_gate_up", accumulators[0], w_gate_up),
                              ("acc_down", accumulators[1], w_down)):
        if acc is None:
            continue
        if not isinstance(acc, torch.Tensor):
            raise MegaMoEError(f"weight_grad_accumulators: {name} must be a tensor or None, "
                               f"got {type(acc).__name__}")
        if acc.dtype != torch.float32:
            raise MegaMoEError(f"weight_grad_accumulators: {name} must be torch.float32, "
                               f"got {acc.dtype}")
        if acc.shape != weight.shape:
            raise MegaMoEError(f"weight_grad_accumulators: {name} must have the weight's shape "
                               f"{list(weight.shape)}, got {list(acc.shape)}")
        if acc.device != weight.device:
            raise MegaMoEError(f"weight_grad_accumulators: {name} is on {acc.device}, the "
                               f"weight on {weight.device}")
        if not acc.is_contiguous():
            raise MegaMoEError(f"weight_grad_accumulators: {name} must be contiguous")


def should_check_ids(check_ids) -> bool:
    """Value checks read device memory: skip them while tracing or capturing a graph."""
    if check_ids is not None:
        return bool(check_ids)
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_ids_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in [-1, num_experts); names the first offending slot. One host sync."""
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        value = int(topk_ids[t, j])
        raise MegaMoEError(f"topk_ids: expected ids in [-1, {num_experts}) (-1 = no expert), "
                           f"got {value} at token {t}, slot {j}")
