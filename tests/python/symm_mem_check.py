"""Platform probe for the expert-parallel Buffer (issue 4): torch symmetric memory with the
CUDA backend and NVLink multicast off gives every rank a table of peer pointers, and a
kernel on one rank can write another rank's buffer through them.

    torchrun --standalone --nproc-per-node 2 tests/python/symm_mem_check.py
"""
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        symm_mem.set_backend("CUDA")
        chosen = "set to CUDA"
    except RuntimeError as error:
        # torch 2.11 on the H200 machines: "does not find allocation backend CUDA" before the
        # first allocation; the default then resolves to CUDA anyway.
        chosen = f"default ({error})"
    buf = symm_mem.empty(1 << 20, dtype=torch.int32, device="cuda")
    buf.zero_()
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    ptrs = list(handle.buffer_ptrs)
    assert len(ptrs) == world and ptrs[rank] == buf.data_ptr(), (ptrs, buf.data_ptr())
    handle.barrier()
    # Rank r writes r + 1 into slot r of every peer's buffer.
    for peer in range(world):
        remote = handle.get_buffer(peer, (world,), torch.int32)
        remote[rank].fill_(rank + 1)
    torch.cuda.synchronize()
    handle.barrier()
    got = buf[:world].tolist()
    assert got == [r + 1 for r in range(world)], got
    print(f"rank {rank}: backend {chosen}, now {symm_mem.get_backend('cuda')}, multicast "
          f"{handle.has_multicast_support()}, peer pointers {[hex(p) for p in ptrs]}, "
          f"slots {got}: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
