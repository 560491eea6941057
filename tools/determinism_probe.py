"""Finds where two runs of one training config stop being bitwise equal.

    python3 tools/determinism_probe.py record OUT.jsonl [--stop-after STEP] [megamoe-train args...]
    python3 tools/determinism_probe.py compare A.jsonl B.jsonl

`record` runs megamoe-train in this process and writes one JSON line per step: the step's
loss, an integer checksum of the output of every decoder layer, attention, MoE block,
router and experts call in the order they ran (the forward, then the recompute under
activation checkpointing), and a checksum of every parameter's gradient before clipping
and the optimizer. A checksum is the sum of the tensor's bit patterns read as integers, so
any changed bit changes it.

`compare` prints the first step at which two such logs differ and, within that step,
the first module call that differs (in the order the calls ran) and the gradients that
differ, in backward order (the parameters nearest the loss first). A loss that repeats
while some gradient does not points at the backward of the first module whose gradient
differs; a forward call that differs points at the forward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Module classes whose outputs are checksummed, by the end of their class name.
WATCHED = ("DecoderLayer", "Attention", "SparseMoeBlock", "Experts", "Router", "TopKRouter")


class Stop(Exception):
    pass


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the bit patterns as integers (int64 accumulation, no int64 copy)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.contiguous()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(bits).sum(dtype=torch.int64)


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def record(args, rest) -> int:
    from megamoe.train import optim as optim_mod
    from megamoe.train import trainer

    out = args.out.open("w")
    state = {"step": 0, "calls": []}

    def hook(module, inputs, output):
        kind = type(module).__name__
        if not kind.endswith(WATCHED):
            return
        tensor = first_tensor(output)
        if tensor is not None and tensor.is_floating_point():
            state["calls"].append((kind, checksum(tensor)))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    inner = optim_mod.clip_and_step

    def probed(optimizer, params, max_norm):
        params = list(params)
        state["step"] += 1
        step = state["step"]
        names = [f"param{i}:{tuple(p.shape)}" for i, p in enumerate(params)]
        # One rank without FSDP2 (megamoe.train.mixed_precision): the optimizer steps masters
        # named in its own module, whose gradients may sit in their bf16 copies.
        owner = getattr(getattr(optimizer, "weights", None), "module", None) or trainer_model[0]
        if owner is not None:
            by_id = {id(p): n for n, p in owner.named_parameters()}
            names = [by_id.get(id(p), names[i]) for i, p in enumerate(params)]
        gradient = getattr(optimizer, "gradient", lambda p: p.grad)
        grads = [checksum(g) if (g := gradient(p)) is not None
                 else torch.zeros((), dtype=torch.int64, device=params[0].device) for p in params]
        calls = torch.stack([c for _, c in state["calls"]]).tolist() if state["calls"] else []
        line = {"step": step,
                "calls": [[kind, value] for (kind, _), value in zip(state["calls"], calls)],
                "grads": [[n, v] for n, v in zip(names, torch.stack(grads).tolist())]}
        state["calls"] = []
        out.write(json.dumps(line) + "\n")
        out.flush()
        print(f"[probe] step {step}: {len(line['calls'])} calls, {len(grads)} gradients",
              flush=True)
        norm = inner(optimizer, params, max_norm)
        if step >= args.stop_after:
            raise Stop()
        return norm

    trainer_model = [None]
    inner_loop = trainer._train_loop

    def loop(config, run_state, setup, *a, **k):
        trainer_model[0] = setup.model
        return inner_loop(config, run_state, setup, *a, **k)

    optim_mod.clip_and_step = probed
    trainer._train_loop = loop
    try:
        trainer.main(rest)
    except Stop:
        print(f"[probe] stopped after step {args.stop_after}", flush=True)
    finally:
        handle.remove()
        optim_mod.clip_and_step = inner
        trainer._train_loop = inner_loop
        out.close()
    return 0


def compare(a_path: Path, b_path: Path) -> int:
    a = [json.loads(line) for line in a_path.open()]
    b = [json.loads(line) for line in b_path.open()]
    for ra, rb in zip(a, b):
        step = ra["step"]
        calls_equal = ra["calls"] == rb["calls"]
        grads_equal = ra["grads"] == rb["grads"]
        if calls_equal and grads_equal:
            continue
        print(f"first difference at step {step} (steps 1-{step - 1} bitwise equal: every "
              f"checked forward call and gradient)")
        for i, (ca, cb) in enumerate(zip(ra["calls"], rb["calls"])):
            if ca != cb:
                print(f"  first differing call: #{i} of {len(ra['calls'])} ({ca[0]})")
                break
        else:
            print(f"  every one of the {len(ra['calls'])} checked forward calls is equal")
        differing = [ga[0] for ga, gb in zip(ra["grads"], rb["grads"]) if ga != gb]
        print(f"  {len(differing)} of {len(ra['grads'])} gradients differ; nearest the loss "
              "first:")
        for name in reversed(differing[-12:]):
            print(f"    {name}")
        return 1
    print(f"bitwise equal for all {min(len(a), len(b))} steps compared")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode")
        parser.add_argument("a", type=Path)
        parser.add_argument("b", type=Path)
        args = parser.parse_args()
        return compare(args.a, args.b)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["record"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-after", type=int, default=50)
    args, rest = parser.parse_known_args()
    return record(args, rest)


if __name__ == "__main__":
    sys.exit(main())
