"""Loads libmegamoe.so with ctypes and turns torch tensors into its tensor descriptors.

The library has a plain C ABI (include/megamoe/megamoe.h) so that one build serves every
Python and PyTorch version. Lookup order: $MEGAMOE_LIBRARY, then the copy installed inside
this package.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from .errors import LibraryError, MegaMoEError

# Mirrors of include/megamoe/megamoe.h; tests/python/test_binding.py parses the header and
# fails when the two differ.
MAX_DIMS = 4  # MEGAMOE_MAX_DIMS
MAX_RANKS = 8  # MEGAMOE_EP_MAX_RANKS

_DTYPE_CODES = {  # megamoe_dtype
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float8_e4m3fn: 6,
}


class TensorDescriptor(ctypes.Structure):
    """Mirror of `megamoe_tensor`."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


class EpGroupStruct(ctypes.Structure):
    """Mirror of `megamoe_ep_group`."""

    _fields_ = [
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("buffers", ctypes.c_void_p * MAX_RANKS),
        ("buffer_bytes", ctypes.c_uint64),
        ("num_experts", ctypes.c_int64),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("max_recv_rows", ctypes.c_int64),
        ("timeout_ns", ctypes.c_int64),
        ("num_comm_sms", ctypes.c_int32),
    ]


def describe(tensor: torch.Tensor) -> TensorDescriptor:
    """Descriptor of a tensor's memory; the tensor must outlive the library call."""
    if tensor.dtype not in _DTYPE_CODES:
        raise MegaMoEError(f"dtype {tensor.dtype} has no megamoe equivalent")
    if tensor.dim() > MAX_DIMS:
        raise MegaMoEError(f"tensors of more than {MAX_DIMS} dimensions are not supported")
    desc = TensorDescriptor()
    desc.data = tensor.data_ptr() if tensor.numel() > 0 else None
    desc.dtype = _DTYPE_CODES[tensor.dtype]
    desc.ndim = tensor.dim()
    for i, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        desc.shape[i] = size
        desc.strides[i] = stride
    return desc


def _candidate_paths() -> list[Path]:
    override = os.environ.get("MEGAMOE_LIBRARY")
    if override:
        return [Path(override)]
    return [Path(__file__).resolve().parent / "libmegamoe.so"]


_TENSOR = ctypes.POINTER(TensorDescriptor)
_GROUP = ctypes.POINTER(EpGroupStruct)
_SIZE_OUT = ctypes.POINTER(ctypes.c_size_t)
_STATUS = ctypes.c_int  # megamoe_status (a C enum is an int)
_I64, _I32 = ctypes.c_int64, ctypes.c_int32
_TAIL = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]  # workspace, its bytes, stream

# Every function of megamoe.h: name -> (return type, argument types).
SIGNATURES = {
    "megamoe_version": (ctypes.c_char_p, []),
    "megamoe_version_number": (_I32, []),
    "megamoe_last_error": (ctypes.c_char_p, []),
    "megamoe_clear_error": (None, []),
    "megamoe_status_name": (ctypes.c_char_p, [_STATUS]),
    "megamoe_dtype_size": (ctypes.c_size_t, [ctypes.c_int]),
    "megamoe_reference_forward": (_STATUS, [_TENSOR] * 6),
    "megamoe_reference_backward": (_STATUS, [_TENSOR] * 10),
    "megamoe_cuda_device_count": (_STATUS, [ctypes.POINTER(_I32)]),
    "megamoe_routing_counts": (_STATUS, [_TENSOR, _I64, _TENSOR, _TENSOR, ctypes.c_void_p]),
    "megamoe_fused_workspace_size": (_STATUS, [_I64] * 5 + [_SIZE_OUT]),
    "megamoe_fused_forward": (_STATUS, [_TENSOR] * 7 + _TAIL),
    "megamoe_fused_backward_workspace_size": (_STATUS, [_I64] * 5 + [_I32, _SIZE_OUT]),
    "megamoe_fused_backward": (_STATUS, [_TENSOR] * 11 + _TAIL),
    "megamoe_fused_fp8_workspace_size": (_STATUS, [_I64] * 5 + [_SIZE_OUT]),
    "megamoe_fused_fp8_forward": (_STATUS, [_TENSOR] * 11 + _TAIL),
    "megamoe_fused_fp8_backward_workspace_size": (_STATUS, [_I64] * 5 + [_I32, _I32, _SIZE_OUT]),
    "megamoe_fused_fp8_backward": (_STATUS, [_TENSOR] * 11 + [_I32] + [_TENSOR] * 5 + _TAIL),
    "megamoe_ep_buffer_size": (_STATUS, [_GROUP, _SIZE_OUT]),
    "megamoe_ep_workspace_size": (_STATUS, [_GROUP, _I64, _I64, _SIZE_OUT]),
    "megamoe_ep_backward_workspace_size": (_STATUS, [_GROUP, _I64, _I64, _I32, _SIZE_OUT]),
    "megamoe_ep_error_offset": (_STATUS, [_GROUP, _SIZE_OUT]),
    "megamoe_ep_describe_error": (_STATUS, [_I32, ctypes.c_char_p, ctypes.c_size_t]),
    "megamoe_ep_forward": (_STATUS, [_GROUP] + [_TENSOR] * 7 + _TAIL),
    "megamoe_ep_backward": (_STATUS, [_GROUP] + [_TENSOR] * 11 + _TAIL),
    "megamoe_ep_fp8_workspace_size": (_STATUS, [_GROUP, _I64, _I64, _SIZE_OUT]),
    "megamoe_ep_fp8_forward": (_STATUS, [_GROUP] + [_TENSOR] * 11 + _TAIL),
    "megamoe_ep_fp8_backward_workspace_size": (_STATUS, [_GROUP, _I64, _I64, _I32, _I32,
                                                         _SIZE_OUT]),
    "megamoe_ep_fp8_backward": (_STATUS, [_GROUP] + [_TENSOR] * 11 + [_I32] + [_TENSOR] * 5
                                + _TAIL),
    "megamoe_quantize_fp8_1x128": (_STATUS, [_TENSOR] * 3 + [ctypes.c_void_p]),
    "megamoe_quantize_fp8_128x128": (_STATUS, [_TENSOR] * 4 + [ctypes.c_void_p]),
    "megamoe_quantize_fp8_cols_128": (_STATUS, [_TENSOR] * 3 + [ctypes.c_void_p]),
}


def _declare(lib) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library; raises MegaMoEError saying where it looked if it is missing."""
    tried = []
    for path in _candidate_paths():
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as err:
                raise MegaMoEError(f"could not load {path}: {err}") from err
            _declare(lib)
            return lib
        tried.append(str(path))
    raise MegaMoEError(
        "libmegamoe.so not found (looked at: " + ", ".join(tried) + "). Install the package "
        "with `pip install .`, or point MEGAMOE_LIBRARY at a built library."
    )


def call(name: str, *args) -> None:
    """Calls a library function and raises LibraryError with its message on failure."""
    lib = library()
    status = getattr(lib, name)(*args)
    if status != 0:
        status_name = lib.megamoe_status_name(status).decode()
        message = lib.megamoe_last_error().decode(errors="replace")
        raise LibraryError(name, status_name, message)


def call_for_size(name: str, *args) -> int:
    """Calls a library query whose last argument is a `size_t*` out value; returns it."""
    size = ctypes.c_size_t()
    call(name, *args, ctypes.byref(size))
    return size.value


def library_version() -> str:
    return library().megamoe_version().decode()


def ref(desc: TensorDescriptor | None):
    """Pointer argument for an optional descriptor (NULL for None)."""
    return ctypes.byref(desc) if desc is not None else None


def stream(device) -> ctypes.c_void_p:
    """The current CUDA stream of `device`, as the library's `void* cuda_stream`."""
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def workspace(nbytes: int, device) -> torch.Tensor:
    """Device scratch memory for one call. The library needs 256-byte alignment, which the
    caching allocator's blocks (512-byte aligned) give, and no initialisation."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
