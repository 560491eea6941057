"""Process group and device meshes. Under torchrun the environment gives rank and world;
launched plainly (python -m megamoe.train, megamoe-train) the trainer makes a one-rank
group itself (an in-process store, no port), so the same FSDP2 code runs either way: NCCL
on GPU, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    owned: bool          # this process created the group (and destroys it at the end)
    launcher: str | None  # "torchrun" when started by it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device_type: str) -> Dist:
    """Initialises (or joins an initialised) default process group and picks the device."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owned = False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        extra = {"device_id": device} if device_type == "cuda" else {}
        if launched:
            dist.init_process_group(backend, **extra)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    **extra)
        owned = True
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else None
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                local_world_size=local_world, device=device, owned=owned, launcher=launcher)


def shutdown(info: Dist) -> None:
    if info.owned and dist.is_initialized():
        dist.destroy_process_group()


def meshes(device_type: str, world_size: int, dp: int, ep: int):
    """(world mesh [all ranks], dp x ep mesh or None without expert parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    if ep == 1:
        return world, None
    return world, init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor
