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

MAX_DIMS = 4

_DTYPE_CODES = {
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


_PTR = ctypes.POINTER(TensorDescriptor)


def _declare(lib: ctypes.CDLL) -> None:
    lib.megamoe_version.restype = ctypes.c_char_p
    lib.megamoe_version.argtypes = []
    lib.megamoe_last_error.restype = ctypes.c_char_p
    lib.megamoe_last_error.argtypes = []
    lib.megamoe_status_name.restype = ctypes.c_char_p
    lib.megamoe_status_name.argtypes = [ctypes.c_int]
    lib.megamoe_reference_forward.restype = ctypes.c_int
    lib.megamoe_reference_forward.argtypes = [_PTR] * 6
    lib.megamoe_reference_backward.restype = ctypes.c_int
    lib.megamoe_reference_backward.argtypes = [_PTR] * 10
    lib.megamoe_cuda_device_count.restype = ctypes.c_int
    lib.megamoe_cuda_device_count.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    lib.megamoe_routing_counts.restype = ctypes.c_int
    lib.megamoe_routing_counts.argtypes = [_PTR, ctypes.c_int64, _PTR, _PTR, ctypes.c_void_p]
    lib.megamoe_fused_workspace_size.restype = ctypes.c_int
    lib.megamoe_fused_workspace_size.argtypes = [ctypes.c_int64] * 5 + [ctypes.POINTER(ctypes.c_size_t)]
    lib.megamoe_fused_forward.restype = ctypes.c_int
    lib.megamoe_fused_forward.argtypes = [_PTR] * 7 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.megamoe_fused_backward_workspace_size.restype = ctypes.c_int
    lib.megamoe_fused_backward_workspace_size.argtypes = (
        [ctypes.c_int64] * 5 + [ctypes.c_int32, ctypes.POINTER(ctypes.c_size_t)])
    lib.megamoe_ep_buffer_size.restype = ctypes.c_int
    lib.megamoe_ep_buffer_size.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.megamoe_ep_workspace_size.restype = ctypes.c_int
    lib.megamoe_ep_workspace_size.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.POINTER(ctypes.c_size_t)]
    lib.megamoe_ep_backward_workspace_size.restype = ctypes.c_int
    lib.megamoe_ep_backward_workspace_size.argtypes = [ctypes.c_void_p, ctypes.c_int64,
                                                       ctypes.c_int64, ctypes.c_int32,
                                                       ctypes.POINTER(ctypes.c_size_t)]
    lib.megamoe_ep_backward.restype = ctypes.c_int
    lib.megamoe_ep_backward.argtypes = [ctypes.c_void_p] + [_PTR] * 11 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.megamoe_ep_error_offset.restype = ctypes.c_int
    lib.megamoe_ep_error_offset.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.megamoe_ep_describe_error.restype = ctypes.c_int
    lib.megamoe_ep_describe_error.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    lib.megamoe_ep_forward.restype = ctypes.c_int
    lib.megamoe_ep_forward.argtypes = [ctypes.c_void_p] + [_PTR] * 7 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.megamoe_fused_backward.restype = ctypes.c_int
    lib.megamoe_fused_backward.argtypes = [_PTR] * 11 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


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


def library_version() -> str:
    return library().megamoe_version().decode()


def ref(desc: TensorDescriptor | None):
    """Pointer argument for an optional descriptor (NULL for None)."""
    return ctypes.byref(desc) if desc is not None else None
