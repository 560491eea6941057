"""Bitwise A/B of the fused layer's outputs between two builds of libmegamoe, for a change
that must not change results (a refactor): the same fixed-seed problems through each build,
every output saved, then compared bit for bit.

One GPU:
    MEGAMOE_LIBRARY=old/libmegamoe.so python3 tools/ab_outputs.py dump old.pt
    MEGAMOE_LIBRARY=new/libmegamoe.so python3 tools/ab_outputs.py dump new.pt
    python3 tools/ab_outputs.py compare old.pt new.pt
Expert parallel (one process per GPU; each rank writes PATH.rankR):
    MEGAMOE_LIBRARY=... torchrun --standalone --nproc-per-node 2 tools/ab_outputs.py dump old-ep.pt --ep
    python3 tools/ab_outputs.py compare old-ep.pt.rank0 new-ep.pt.rank0   (and rank1)

Cases: both presets' shapes at 16384 (30b) and 4096 (235b) tokens, and small awkward ones
(k = 1, I = 384, -1 ids, an expert without tokens, one token); modes: recompute and saved,
bf16 weight gradients and fp32 accumulators, bf16 router weights (forward only, one GPU).
`--precisions bf16,fp8,fp8_bwd` adds the FP8 layer's outputs (one GPU; every case, all of
whose sizes are multiples of 128), for a change to the FP8 kernels that must keep their bits.

A dump holds each output's fingerprint, not the output: its shape, dtype, a SHA-256 of its
bytes and a strided sample of at most SAMPLE values (small outputs whole). The outputs of
all cases and precisions are tens of GB (the 235b weight gradients and their fp32
accumulators alone are 15 GB per precision), more than the GPU machine's disk holds; the
digest decides equality, the sample shows how far apart differing outputs are.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
import moe_testing  # noqa: E402
from moe_testing import make_problem, run_with_grads  # noqa: E402

import megamoe  # noqa: E402

NAMES = ("x", "topk_weights", "w_gate_up", "w_down")
SAMPLE = 1 << 16  # values kept of each output (all of a smaller one)
_CHUNK = 64 << 20  # bytes hashed per thread
_POOL = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1))
# name, tokens (per rank with --ep), H, I, E, k, make_problem arguments
CASES = [
    ("30b", 16384, 2048, 768, 128, 8, dict(invalid_fraction=0.01)),
    ("235b", 4096, 4096, 1536, 128, 8, {}),
    ("k=1,I=384", 129, 256, 384, 4, 1, dict(invalid_fraction=0.1)),
    ("unused-expert", 300, 256, 128, 8, 2, dict(invalid_fraction=0.1, skip_experts=[7])),
    ("one-token", 1, 128, 128, 8, 8, {}),
]


def outputs(problem, prefix, **kwargs):
    """y and every gradient in three modes: recompute, saved, saved with fp32 accumulators."""
    out = {}
    for mode in ("recompute", "saved"):
        y, grads = run_with_grads(megamoe.moe, problem, backward_mode=mode, **kwargs)
        out[f"{prefix}/{mode}/y"] = y
        out.update({f"{prefix}/{mode}/d{n}": g for n, g in grads.items()})
    accs = tuple(torch.full(problem[n].shape, 0.25, dtype=torch.float32,
                            device=problem[n].device) for n in ("w_gate_up", "w_down"))
    y, grads = run_with_grads(megamoe.moe, problem, backward_mode="saved",
                              weight_grad_accumulators=accs, **kwargs)
    out[f"{prefix}/fp32acc/y"] = y
    out[f"{prefix}/fp32acc/dx"] = grads["x"]
    out[f"{prefix}/fp32acc/dtopk_weights"] = grads["topk_weights"]
    out[f"{prefix}/fp32acc/acc_gate_up"], out[f"{prefix}/fp32acc/acc_down"] = accs
    return out


def fingerprint(t: torch.Tensor) -> dict:
    """Shape, dtype, SHA-256 of the bytes (over 64 MB chunks hashed in threads: hashlib
    releases the GIL) and a strided sample, as float64 on the CPU."""
    t = t.detach().contiguous()
    data = t.cpu().view(-1).view(torch.uint8).numpy()
    chunks = [data[i:i + _CHUNK] for i in range(0, data.size, _CHUNK)] or [data]
    digests = list(_POOL.map(lambda c: hashlib.sha256(c).digest(), chunks))
    step = max(1, -(-t.numel() // SAMPLE))
    return {"shape": tuple(t.shape), "dtype": str(t.dtype),
            "sha256": hashlib.sha256(b"".join(digests)).hexdigest(),
            "sample_step": step, "sample": t.view(-1)[::step].to(torch.float64).cpu()}


def fingerprints(out: dict) -> dict:
    return {n: fingerprint(t) for n, t in out.items()}


def dump_one_gpu(seed, precisions=("bf16",)):
    out = {}
    for i, (name, T, H, I, E, k, extra) in enumerate(CASES):
        p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=seed + i,
                         **extra)
        bf16_weights = dict(p, topk_weights=p["topk_weights"].to(torch.bfloat16))
        for precision in precisions:
            if precision != "bf16" and (H % 128 or I % 128):
                continue  # the FP8 recipe's 128-blocks
            # bf16 keeps its keys unprefixed, so dumps of older builds still compare.
            prefix = name if precision == "bf16" else f"{precision}/{name}"
            out.update(fingerprints(outputs(p, prefix, backend="fused", precision=precision)))
            with torch.no_grad():
                out[f"{prefix}/bf16-weights/y"] = fingerprint(megamoe.moe(
                    *(bf16_weights[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up",
                                                 "w_down")), backend="fused", precision=precision))
            print(f"{prefix}: done", flush=True)
    return out


def dump_ep(seed):
    import torch.distributed as dist
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    out = {}
    for i, (name, T, H, I, E, k, extra) in enumerate(CASES):
        if E % world:
            continue
        p = make_problem(T * world, H, I, E, k, dtype=torch.bfloat16, device=device,
                         seed=seed + i, **extra)
        E_local = E // world
        tokens, experts = slice(rank * T, (rank + 1) * T), slice(rank * E_local, (rank + 1) * E_local)
        mine = {n: p[n][tokens].contiguous() for n in ("x", "topk_ids", "topk_weights", "dy")}
        mine.update({n: p[n][experts].contiguous() for n in ("w_gate_up", "w_down")})
        buf = megamoe.Buffer(group, T, H, I, E, k)
        out.update(fingerprints(outputs(mine, name, group=group, buffer=buf, backend="fused")))
        torch.cuda.synchronize()
        buf.check()
        buf.close()
        if rank == 0:
            print(f"{name}: done", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return out, rank


def compare(a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    if a.keys() != b.keys():
        print("different outputs:", sorted(a.keys() ^ b.keys()))
        return 1
    def identity(f):
        return f["shape"], f["dtype"], f["sha256"]

    differ = [n for n in a if identity(a[n]) != identity(b[n])]
    for n in a:
        line = f"{'SAME ' if n not in differ else 'DIFF '} {n} {a[n]['shape']} {a[n]['dtype']}"
        x, y = a[n]["sample"], b[n]["sample"]
        if n in differ and x.shape == y.shape:
            line += (f" (every {a[n]['sample_step']}th value: max |a - b| "
                     f"{(x - y).abs().max().item():.3e}, {(x != y).sum().item()} of {x.numel()} "
                     f"differ, max |a| {x.abs().max().item():.3e})")
        print(line)
    print(f"{len(a) - len(differ)} of {len(a)} outputs bitwise equal")
    return 1 if differ else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="run the cases with this MEGAMOE_LIBRARY, save the outputs")
    d.add_argument("path")
    d.add_argument("--ep", action="store_true", help="expert parallel, under torchrun")
    d.add_argument("--seed", type=int, default=20261201)
    d.add_argument("--precisions", default="bf16",
                   help="comma-separated: bf16, fp8, fp8_bwd (one GPU; default bf16)")
    c = sub.add_parser("compare", help="compare two dumps bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args()
    if args.command == "compare":
        sys.exit(compare(args.a, args.b))
    moe_testing.BASE_SEED = args.seed
    precisions = tuple(v for v in args.precisions.split(",") if v)
    unknown = [v for v in precisions if v not in ("bf16", "fp8", "fp8_bwd")]
    if unknown or not precisions:
        parser.error(f"--precisions: expected bf16, fp8 or fp8_bwd, got {args.precisions!r}")
    if args.ep:
        if precisions != ("bf16",):
            parser.error("--precisions: the expert-parallel layer runs bf16 only")
        out, rank = dump_ep(0)
        path = f"{args.path}.rank{rank}"
    else:
        out, path = dump_one_gpu(0, precisions), args.path
    torch.save(out, path)
    print(f"wrote the fingerprints of {len(out)} outputs to {path}", flush=True)


if __name__ == "__main__":
    main()
