"""`megamoe.Buffer`: the communication buffer of the fused expert-parallel backend, one per
EP group, created once and reused by every layer and call.

It lives in torch symmetric memory (NVLink multicast off), so every rank's kernels can
store into every other rank's buffer through a table of peer pointers. Sizes are fixed at
creation: `max_tokens_per_rank` tokens per call, `max_recv_rows` (token, expert) rows a
rank can receive per call (default: every token of every rank, k times). `num_comm_sms`
sets how many SMs the kernels that move rows between ranks use (default: all of them, as
this version runs those kernels between the GEMMs rather than beside them).
"""

from __future__ import annotations

import ctypes
import itertools
import os

import torch
import torch.distributed as dist

from . import _lib
from .errors import MegaMoEError

MAX_RANKS = _lib.MAX_RANKS
_BUFFERS: dict[int, "Buffer"] = {}  # by id, for the custom op (it takes ints, not objects)
_IDS = itertools.count(1)
# The environment switches of the EP layer's paths that every rank must agree on.
_SWITCHES = ("MEGAMOE_EP_EPILOGUE_COMBINE", "MEGAMOE_EP_OVERLAP_DISPATCH",
             "MEGAMOE_EP_FP8_BF16_DISPATCH", "MEGAMOE_EP_OVERLAP_BACKWARD")


class Buffer:
    """Communication buffer of one expert-parallel group (collective: every rank of `group`
    creates it with the same arguments, before any layer uses it, outside any checkpointed
    region)."""

    def __init__(self, group, max_tokens_per_rank: int, hidden: int, intermediate: int,
                 num_experts: int, topk: int, *, max_recv_rows: int | None = None,
                 timeout_s: float = 10.0, num_comm_sms: int | None = None):
        if group is None:
            raise MegaMoEError("Buffer: group is None; a buffer belongs to an expert-parallel "
                               "process group")
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if not 1 <= world <= MAX_RANKS:
            raise MegaMoEError(f"Buffer: EP groups of 1..{MAX_RANKS} ranks (one node), got {world}")
        for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                            ("intermediate", intermediate), ("num_experts", num_experts),
                            ("topk", topk)):
            if not isinstance(value, int) or value < 1:
                raise MegaMoEError(f"Buffer: {name} must be a positive int, got {value!r}")
        if num_experts % world:
            raise MegaMoEError(f"Buffer: num_experts={num_experts} is not divisible by the group "
                               f"size {world}")
        if max_recv_rows is None:
            max_recv_rows = world * max_tokens_per_rank * topk
        if timeout_s <= 0:
            raise MegaMoEError(f"Buffer: timeout_s must be > 0, got {timeout_s}")
        if num_comm_sms is not None and (not isinstance(num_comm_sms, int) or num_comm_sms < 1):
            raise MegaMoEError(f"Buffer: num_comm_sms must be a positive int or None (every SM), "
                               f"got {num_comm_sms!r}")
        settings = (max_tokens_per_rank, hidden, intermediate, num_experts, topk, max_recv_rows)
        # The layer's path switches (docs/expert-parallel.md, "Forward overlap", "Backward
        # overlap" and "Blockwise FP8 under EP"): the C library reads them from the
        # environment, and ranks that disagree would lay out, send and expect rows
        # differently.
        switches = tuple(os.environ.get(name, "") not in ("", "0") for name in _SWITCHES)
        gathered = [None] * world
        dist.all_gather_object(gathered, (settings, switches), group=group)
        for other, (theirs, their_switches) in enumerate(gathered):
            if theirs != settings:
                raise MegaMoEError(f"Buffer: rank {rank} has (max_tokens_per_rank, hidden, "
                                   f"intermediate, num_experts, topk, max_recv_rows) = {settings}, "
                                   f"rank {other} has {theirs}; every rank must agree")
            if their_switches != switches:
                raise MegaMoEError(f"Buffer: rank {rank} has ({', '.join(_SWITCHES)}) = "
                                   f"{switches}, rank {other} has {their_switches}; every "
                                   "rank must agree")
        self.group, self.rank, self.world_size = group, rank, world
        self.max_tokens_per_rank, self.hidden, self.intermediate = settings[:3]
        self.num_experts, self.topk, self.max_recv_rows = settings[3:]
        self.num_comm_sms = num_comm_sms
        self._struct = _lib.EpGroupStruct(rank=rank, world_size=world, num_experts=num_experts,
                                     max_tokens_per_rank=max_tokens_per_rank, topk=topk,
                                     hidden=hidden, max_recv_rows=max_recv_rows,
                                     timeout_ns=int(timeout_s * 1e9),
                                     num_comm_sms=num_comm_sms or 0)
        size = _lib.call_for_size("megamoe_ep_buffer_size", ctypes.byref(self._struct))
        self._error_offset = _lib.call_for_size("megamoe_ep_error_offset",
                                                ctypes.byref(self._struct))

        import torch.distributed._symmetric_memory as symm_mem

        device = torch.device("cuda", torch.cuda.current_device())
        self._memory = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self._memory.zero_()  # the control area's generations and signals start at 0, once
        self._handle = symm_mem.rendezvous(self._memory, group)
        self._handle.barrier()
        self._struct.buffer_bytes = size
        for r, ptr in enumerate(self._handle.buffer_ptrs):
            self._struct.buffers[r] = ptr
        self.device = device
        self.id = next(_IDS)
        _BUFFERS[self.id] = self

    def check(self) -> None:
        """Raises MegaMoEError if a call on this buffer failed on this rank since the last
        check (a peer that did not arrive, another rank's such timeout, or the receive
        capacity), naming the first such failure, or if the last call failed; a failed
        call's outputs are NaN. After a timeout anywhere in the group every later call on
        its buffers fails on every rank, and a late peer may still write into them: make a
        new buffer on every rank before going on. Waits for the current stream."""
        words = self._memory[self._error_offset:self._error_offset + 8].view(torch.int32)
        last, first = (int(v) for v in words.tolist())
        if first:
            words[1].zero_()  # the next check names the next failure
        code = first or last
        if code:
            message = ctypes.create_string_buffer(256)
            _lib.call("megamoe_ep_describe_error", code, message, 256)
            raise MegaMoEError(f"expert-parallel call failed on rank {self.rank}: "
                               f"{message.value.decode()}")

    def close(self) -> None:
        _BUFFERS.pop(self.id, None)

    def __repr__(self):
        return (f"megamoe.Buffer(rank {self.rank} of {self.world_size}, E={self.num_experts}, "
                f"H={self.hidden}, I={self.intermediate}, k={self.topk}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, "
                f"max_recv_rows={self.max_recv_rows})")


def get(buffer_id: int) -> Buffer:
    try:
        return _BUFFERS[buffer_id]
    except KeyError:
        raise MegaMoEError(f"no open megamoe.Buffer with id {buffer_id}") from None
