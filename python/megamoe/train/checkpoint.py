"""Checkpoints through torch.distributed.checkpoint (DCP): the model (transformers' parameter
names), the AdamW state, the LR schedule, the step, the data position and every rank's RNG
states, one directory per saved step (`step-000100/`), written and read by all ranks.

Under expert parallelism each rank's experts parameters are its own E/ep experts, which
FSDP2 sees as one tensor of E/ep rows sharded over the dp ranks; saved as such, every EP rank
would write different experts under the same name. They are therefore saved through views
that place them in the whole [E, ...] tensor: a DTensor over an (ep, dp) mesh with both
dimensions splitting dim 0, ep outermost. The views share storage with the parameters and
optimizer states, so loading writes straight into them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Shard

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint (one whose .metadata was written) under root."""
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / ".metadata").exists()]
    return max(found)[1] if found else None


class Checkpointer:
    def __init__(self, root: Path, model, optimizer, scheduler, loader, *, rank: int,
                 expert_views=None, keep_last: int = 0):
        self.root, self.model, self.optimizer = root, model, optimizer
        self.scheduler, self.loader, self.rank = scheduler, loader, rank
        self.expert_views = expert_views  # ExpertViews under EP, else None
        self.keep_last = keep_last

    def _state(self, step: int) -> tuple[dict, dict, dict]:
        model_state = get_model_state_dict(self.model)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer)
        if self.expert_views is not None:
            saved_model = self.expert_views.model(model_state)
            saved_optim = self.expert_views.optimizer(optim_state)
        else:
            saved_model, saved_optim = model_state, optim_state
        state = {
            "model": saved_model,
            "optim": saved_optim,
            "train": {"step": step, "data": self.loader.state_dict(),
                      "scheduler": self.scheduler.state_dict()},
            f"rng_rank{self.rank}": _rng_state(),
        }
        return state, model_state, optim_state

    def save(self, step: int) -> Path:
        path = step_dir(self.root, step)
        state, _, _ = self._state(step)
        dcp.save(state, checkpoint_id=str(path))
        if self.rank == 0:
            self._prune()
        return path

    def load(self, path: Path) -> tuple[int, bool]:
        """Restores everything from `path`; returns the step it was saved at and whether
        this rank's RNG state was in it."""
        state, model_state, optim_state = self._state(0)
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        rng_key = f"rng_rank{self.rank}"
        has_rng = any(key.startswith(rng_key + ".") or key == rng_key for key in stored)
        if not has_rng:
            state.pop(rng_key)
        else:
            # Load only the generators the checkpoint holds: a process that had not used
            # CUDA when it saved has no CUDA state, and the one loading may have one.
            for generator in list(state[rng_key]):
                if f"{rng_key}.{generator}" not in stored:
                    del state[rng_key][generator]
        dcp.load(state, checkpoint_id=str(path))
        # The loads wrote into the live tensors (or their views); these calls put them back
        # through the state-dict API, which also restores the optimizer's param groups.
        set_model_state_dict(self.model, model_state)
        optim_state["param_groups"] = state["optim"]["param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, optim_state)
        train = state["train"]
        self.scheduler.load_state_dict(train["scheduler"])
        self.loader.load_state_dict(train["data"])
        if has_rng:
            _set_rng_state(state[rng_key])
        return int(train["step"]), has_rng

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        complete = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                          if (m := STEP_DIR.match(p.name)) and (p / ".metadata").exists())
        for _, path in complete[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class ExpertViews:
    """Rewrites EP-local experts tensors as views into the global [E, ...] tensor."""

    def __init__(self, expert_fqns: set[str], dp_ep_mesh, ep_size: int):
        from torch.distributed.device_mesh import DeviceMesh

        self.fqns, self.ep = expert_fqns, ep_size
        # The same ranks with the dimensions swapped, so that ep splits dim 0 first.
        self.mesh = DeviceMesh(dp_ep_mesh.device_type, dp_ep_mesh.mesh.transpose(0, 1).contiguous(),
                               mesh_dim_names=("ep", "dp"))

    def _view(self, value):
        if not isinstance(value, DTensor) or value.dim() == 0:
            return value
        shape = torch.Size([value.shape[0] * self.ep, *value.shape[1:]])
        return DTensor.from_local(value.to_local(), self.mesh, [Shard(0), Shard(0)],
                                  run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    def model(self, state: dict) -> dict:
        return {k: (self._view(v) if k in self.fqns else v) for k, v in state.items()}

    def optimizer(self, state: dict) -> dict:
        per_param = {fqn: ({name: self._view(v) for name, v in entry.items()}
                           if fqn in self.fqns else entry)
                     for fqn, entry in state["state"].items()}
        return {**state, "state": per_param}


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
