"""A peer that dies between calls of the fused EP layer, under torchrun on two GPUs:

    torchrun --nproc-per-node 2 tests/python/ep_dead_peer_check.py [--timeout-s 2]

Both ranks make a megamoe.Buffer with a short timeout and run one forward + backward,
which must pass buffer.check(). Then rank 1 exits at once with no clean-up (os._exit, as a
killed process leaves its peers: torchrun tears the job down only on a non-zero exit) and
rank 0, once rank 1's process is gone, calls the layer twice more, a forward and a forward
+ backward. Each call must come back (its stream synchronizes) within one timeout instead
of hanging: the first wait for the dead rank times out, and then every wait of the group
gives up at once (its failure word; otherwise each phase of each call would wait a whole
timeout, 3 in a forward, up to 7 in a forward + backward). buffer.check() must then raise
the error naming rank 1 and the phase 'counts', and the call's output (y; dx after the
backward) must be all NaN. Rank 0 prints one line a call and "dead peer check: PASSED" or
FAILED.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megamoe  # noqa: E402
import moe_testing  # noqa: E402
from megamoe.errors import MegaMoEError  # noqa: E402
from moe_testing import make_problem  # noqa: E402

T, H, I, E, K = 256, 512, 256, 16, 4
NAMES = ("x", "topk_weights", "w_gate_up", "w_down")


def is_gone(pid: int) -> bool:
    """True once the process has exited (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def call(mine, group, buf, backward: bool) -> tuple[float, torch.Tensor]:
    """One call of the layer on this rank: its seconds up to the stream's end, and its last
    output (y, or with the backward dx)."""
    leaves = {n: mine[n].detach().clone().requires_grad_(backward) for n in NAMES}
    start = time.monotonic()
    y = megamoe.moe(leaves["x"], mine["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
                    leaves["w_down"], group=group, buffer=buf, backend="fused")
    if backward:
        y.backward(mine["dy"])
    torch.cuda.synchronize()
    return time.monotonic() - start, (leaves["x"].grad if backward else y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=2.0,
                        help="the buffer's timeout_s (default 2)")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"ep_dead_peer_check.py runs on two ranks, got {world}")
    group = dist.group.WORLD
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    # Every rank draws the same global problem: rank 0's fresh seed.
    seed = [moe_testing.BASE_SEED]
    dist.broadcast_object_list(seed, 0, group=group)
    moe_testing.BASE_SEED = seed[0]
    if rank == 0:
        print(f"seed {moe_testing.BASE_SEED} (MEGAMOE_TEST_SEED replays it)", flush=True)
    p = make_problem(T * world, H, I, E, K, dtype=torch.bfloat16, device=device, seed=7)
    tokens, experts = slice(rank * T, (rank + 1) * T), slice(rank * E // 2, (rank + 1) * E // 2)
    mine = {n: p[n][tokens].contiguous() for n in ("x", "topk_ids", "topk_weights", "dy")}
    mine["w_gate_up"] = p["w_gate_up"][experts].contiguous()
    mine["w_down"] = p["w_down"][experts].contiguous()
    buf = megamoe.Buffer(group, T, H, I, E, K, timeout_s=args.timeout_s)

    call(mine, group, buf, backward=True)
    buf.check()  # both ranks alive: no error
    dist.barrier(group=group)
    if rank == 1:  # exit 0 with no clean-up: the buffer, the group and the CUDA context just go
        moe_testing.leave(True)

    deadline = time.monotonic() + 60
    while not is_gone(pids[1]):
        if time.monotonic() > deadline:
            print("rank 1 did not exit within 60 s", flush=True)
            moe_testing.leave(False)
        time.sleep(0.05)
    expected = "rank 1 did not arrive in phase 'counts' within the timeout"
    passed = True
    for what, backward in (("forward", False), ("forward + backward", True)):
        seconds, out = call(mine, group, buf, backward)
        try:
            buf.check()
            message = "no error"
        except MegaMoEError as e:
            message = str(e)
        # The first wait names the dead rank; the call's outputs are NaN.
        ok = (expected in message and seconds < args.timeout_s + 10 and
              bool(torch.isnan(out).all()))
        passed = passed and ok
        print(f"rank 1 dead, {what}: returned in {seconds:.2f} s; {message}; output all NaN: "
              f"{bool(torch.isnan(out).all())} ({'ok' if ok else 'WRONG'})", flush=True)
    print("dead peer check:", "PASSED" if passed else "FAILED", flush=True)
    moe_testing.leave(passed)


if __name__ == "__main__":
    main()
