"""Expert parallelism check, run under torchrun (one process per GPU):

    torchrun --nproc-per-node 2 tests/python/ep_check.py [--backend torch] [--cpu]
    torchrun --nproc-per-node 2 tests/python/ep_check.py --backend fused [--graph] [--repeats 2000]
    torchrun --nproc-per-node 2 tests/python/ep_check.py --backend fused --precision fp8

Every rank draws the same global problem; rank r takes tokens [r*T, (r+1)*T) (in the
"uneven" cases, a count of its own: none on rank 0, T on the last) and experts
[r*E/W, (r+1)*E/W). The EP=W result, gathered, is compared with EP=1 on the whole problem
and both with the float64 reference. Exits non-zero on any failure; prints one line a case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megamoe  # noqa: E402
import moe_testing  # noqa: E402
from megamoe import reference  # noqa: E402
from moe_testing import make_problem, rel_err, run_with_grads  # noqa: E402

NAMES = ("x", "topk_weights", "w_gate_up", "w_down")
TOLERANCE = 1e-2          # against the float64 reference
FP8_TOLERANCE = 1e-1      # the FP8 precisions against it: e4m3's floor (docs/fp8.md)
EP_VS_EP1_TOLERANCE = 5e-3


def cases(world, on_gpu):
    # name, tokens per rank, H, I, E, k, extra make_problem arguments
    if not on_gpu:  # float32 on gloo: small shapes, same situations
        return [
            ("small", 64, 32, 16, 8, 2, dict(invalid_fraction=0.1)),
            ("k=1", 33, 32, 16, 8, 1, {}),
            ("rank-receives-nothing", 20, 32, 16, 8, 2, dict(skip_experts=range(8 - 8 // world, 8))),
            ("all-to-one-rank", 17, 32, 16, 8, 1, dict(one_expert=7)),
            ("uneven-tokens-rank-with-none", 24, 32, 16, 8, 2, dict(uneven=True)),
        ]
    return [
        ("qwen3-30b-a3b", 2048, 2048, 768, 128, 8, dict(invalid_fraction=0.01)),
        ("qwen3-235b-a22b", 1024, 4096, 1536, 128, 8, {}),
        ("k=1", 1000, 512, 256, 16, 1, {}),
        # rank W-1 owns no expert that any token picks: it receives nothing
        ("rank-receives-nothing", 777, 512, 256, 16, 4, dict(skip_experts=range(16 - 16 // world, 16))),
        ("all-to-one-rank", 500, 512, 256, 16, 1, dict(one_expert=15)),
        # rank 0 has no tokens (empty tensors) and still computes its experts' rows
        ("uneven-tokens-rank-with-none", 600, 512, 256, 16, 4, dict(uneven=True)),
    ]


def token_counts(world, T, uneven):
    """Every rank's tokens: T each, or (uneven) none on rank 0, T on the last, others between."""
    if not uneven:
        return [T] * world
    return [0 if r == 0 else T if r == world - 1 else 1 + (29 * r) % T for r in range(world)]


def draw(case, rank, world, device, seed, dtype):
    """The case's global problem (every rank draws the same), this rank's part of it and
    every rank's token count."""
    _, T, H, I, E, k, extra = case
    extra = dict(extra)
    counts = token_counts(world, T, extra.pop("uneven", False))
    p = make_problem(sum(counts), H, I, E, k, dtype=dtype, device=device, seed=seed, **extra)
    return p, local_slice(p, rank, world, counts, E), counts


def local_slice(p, rank, world, counts, E):
    E_local = E // world
    first = sum(counts[:rank])
    tokens = slice(first, first + counts[rank])
    experts = slice(rank * E_local, (rank + 1) * E_local)
    out = {n: p[n][tokens] for n in ("x", "topk_ids", "topk_weights", "dy")}
    out["w_gate_up"], out["w_down"] = p["w_gate_up"][experts], p["w_down"][experts]
    return {n: t.contiguous() for n, t in out.items()}


def float64_reference(p):
    """y and the gradients of the whole problem from the float64 reference."""
    args = [p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    ref = {"y": reference.forward(*args)}
    ref.update(zip(NAMES, reference.backward(p["dy"], *args)))
    return ref


def gather(t, world, group, counts=None):
    """Every rank's t in rank order; counts: each rank's rows of t, when they differ (the
    parts then travel padded to the largest)."""
    if counts is None:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    padded = t.new_zeros((max(counts),) + tuple(t.shape[1:]))
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def gather_outputs(y, grads, world, group, counts):
    """y and the gradients of every rank in rank order: the per-token ones (y, x,
    topk_weights) by each rank's token count, the per-expert ones whole."""
    out = {"y": gather(y, world, group, counts)}
    out.update({n: gather(grads[n], world, group, counts if n in ("x", "topk_weights") else None)
                for n in NAMES})
    return out


def tokens_per_rank(T, counts):
    return T if len(set(counts)) == 1 else counts


def run_case(case, rank, world, group, backend, seed, device):
    name, T = case[:2]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p, mine, counts = draw(case, rank, world, device, seed, dtype)
    y, grads = run_with_grads(megamoe.moe, mine, group=group, backend=backend)
    ep = gather_outputs(y, grads, world, group, counts)
    result = {"case": name, "tokens_per_rank": tokens_per_rank(T, counts), "ep": world}
    if rank == 0:
        y1, grads1 = run_with_grads(megamoe.moe, p, backend=backend)
        ep1 = {"y": y1, **grads1}
        ref = float64_reference(p)
        for n in ref:
            result[f"{n}_ep_vs_ref"] = rel_err(ep[n], ref[n])
            result[f"{n}_ep1_vs_ref"] = rel_err(ep1[n], ref[n])
            result[f"{n}_ep_vs_ep1"] = rel_err(ep[n], ep1[n])
            result[f"{n}_ep_bitwise_ep1"] = bool(torch.equal(ep[n], ep1[n]))
        result["ok"] = all(result[f"{n}_ep_vs_ref"] < TOLERANCE and
                           result[f"{n}_ep1_vs_ref"] < TOLERANCE and
                           result[f"{n}_ep_vs_ep1"] < EP_VS_EP1_TOLERANCE for n in ref)
    return result


def _fused_step(mine, group, buf, precision):
    return run_with_grads(megamoe.moe, mine, group=group, buffer=buf, backend="fused",
                          precision=precision)


def _graph_replay_matches_eager(mine, group, buf, eager, precision):
    """Captures forward + backward in one CUDA graph, replays it twice and compares y and the
    gradients with the eager call's, bit for bit."""
    leaves = {n: mine[n].detach().clone().requires_grad_(True) for n in NAMES}
    args = dict(mine, **leaves)

    def step():
        for leaf in leaves.values():
            leaf.grad = None
        y = megamoe.moe(args["x"], args["topk_ids"], args["topk_weights"], args["w_gate_up"],
                        args["w_down"], group=group, buffer=buf, backend="fused",
                        precision=precision)
        y.backward(mine["dy"])
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    same = True
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        same = same and torch.equal(y, eager[0]) and all(
            torch.equal(leaves[n].grad, eager[1][n]) for n in NAMES)
    return same


def _saved_mode_matches(mine, group, buf, first, precision):
    """backward_mode="saved" with fp32 weight-gradient accumulators: y, dx and d topk_weights
    bit for bit those of the recompute mode, the fp32 weight gradients within their bf16
    rounding (2^-9 relative) of its bf16 ones."""
    accs = tuple(torch.zeros(mine[n].shape, dtype=torch.float32, device=mine[n].device)
                 for n in ("w_gate_up", "w_down"))
    y, grads = run_with_grads(megamoe.moe, mine, group=group, buffer=buf, backend="fused",
                              backward_mode="saved", weight_grad_accumulators=accs,
                              precision=precision)
    return (torch.equal(y, first[0]) and torch.equal(grads["x"], first[1]["x"]) and
            torch.equal(grads["topk_weights"], first[1]["topk_weights"]) and
            grads["w_gate_up"] is None and grads["w_down"] is None and
            all(rel_err(acc, first[1][n]) < 2e-3 for acc, n in zip(accs, ("w_gate_up", "w_down"))))


def _switch(name):
    """An EP switch as the library reads it: on unless unset, "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def run_case_fused(case, rank, world, group, seed, device, repeats, graph, precision="bf16"):
    """backend="fused" over a megamoe.Buffer at `precision`, forward and backward: EP=W
    gathered must match the one-GPU fused layer at that precision (d topk_weights and the
    weight gradients bit for bit, y and dx within EP_VS_EP1_TOLERANCE, or bit for bit with
    MEGAMOE_EP_EPILOGUE_COMBINE) and the float64
    reference (FP8: within FP8_TOLERANCE); each rank's outputs must be
    the same on every one of `repeats` back-to-back calls on the same buffer, in saved mode
    with fp32 accumulators (_saved_mode_matches), and, with `graph`, from a CUDA-graph replay
    of forward + backward."""
    name, T, H, I, E, k, _ = case
    p, mine, counts = draw(case, rank, world, device, seed, torch.bfloat16)
    buf = megamoe.Buffer(group, T, H, I, E, k)
    first = _fused_step(mine, group, buf, precision)
    same = True
    for i in range(1, repeats):
        y, grads = _fused_step(mine, group, buf, precision)
        same = same and torch.equal(y, first[0]) and all(
            torch.equal(grads[n], first[1][n]) for n in NAMES)
        if repeats >= 100 and rank == 0 and (i + 1) % 500 == 0:
            print(f"  {name}: {i + 1}/{repeats} calls", flush=True)
    graph_same = _graph_replay_matches_eager(mine, group, buf, first, precision) if graph else None
    saved_same = _saved_mode_matches(mine, group, buf, first, precision)
    torch.cuda.synchronize()
    buf.check()
    buf.close()
    out = gather_outputs(first[0], first[1], world, group, counts)
    # Every rank's verdicts, so rank 0 fails if any rank's calls differed.
    flags = torch.tensor([same, graph_same is not False, saved_same], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    result = {"case": name, "tokens_per_rank": tokens_per_rank(T, counts), "ep": world,
              "backend": "fused", "precision": precision, "calls": repeats,
              "same_every_call": bool(flags[0])}
    if graph:
        result["graph_replay_equals_eager"] = bool(flags[1])
    result["saved_mode_and_fp32_accumulators_match"] = bool(flags[2])
    if rank == 0:
        y1, grads1 = run_with_grads(megamoe.moe, p, backend="fused", precision=precision)
        ep1 = {"y": y1, **grads1}
        ref = float64_reference(p)
        for n in ref:
            result[f"{n}_ep_vs_ref"] = rel_err(out[n], ref[n])
            result[f"{n}_ep_vs_ep1"] = rel_err(out[n], ep1[n])
            result[f"{n}_ep_bitwise_ep1"] = bool(torch.equal(out[n], ep1[n]))
        # y and dx add one bf16 rounding per owner rank (its partial sum), but with the
        # epilogue combine, which folds every slot's row on the token's rank as the one-GPU
        # layer does; the per-slot and per-expert gradients take the one-GPU path exactly.
        tolerance = TOLERANCE if precision == "bf16" else FP8_TOLERANCE
        rounded = set() if _switch("MEGAMOE_EP_EPILOGUE_COMBINE") else {"y", "x"}
        result["ok"] = bool(flags.all()) and all(
            result[f"{n}_ep_vs_ref"] < tolerance and
            (result[f"{n}_ep_vs_ep1"] < EP_VS_EP1_TOLERANCE if n in rounded
             else result[f"{n}_ep_bitwise_ep1"]) for n in ref)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU over gloo")
    parser.add_argument("--repeats", type=int, default=3,
                        help="fused: forward + backward calls per case on the same buffer "
                             "(default 3; 2000 for the stress run)")
    parser.add_argument("--graph", action="store_true",
                        help="fused: also a CUDA-graph replay of forward + backward per case")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8_bwd"),
                        help="fused: the layer's precision (default bf16)")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    # Every rank must draw the same global problem: share rank 0's fresh seed.
    seed = torch.tensor([moe_testing.BASE_SEED], dtype=torch.int64, device=device)
    dist.broadcast(seed, 0)
    moe_testing.BASE_SEED = int(seed.item())
    if rank == 0:
        print(f"seed {moe_testing.BASE_SEED} (MEGAMOE_TEST_SEED replays it)", flush=True)
    results = []
    for i, case in enumerate(cases(world, not args.cpu)):
        if args.backend == "fused":
            result = run_case_fused(case, rank, world, group, 1000 + i, device, args.repeats,
                                    args.graph, args.precision)
        else:
            result = run_case(case, rank, world, group, args.backend, 1000 + i, device)
        if rank == 0:
            print(json.dumps(result), flush=True)
            results.append(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = torch.tensor([all(r["ok"] for r in results) if rank == 0 else True], device=device)
    dist.broadcast(ok, 0)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    # Every rank leaves the last collective before any tears the group down: a gloo rank
    # that exits while its peer is still connected can abort the peer at shutdown.
    dist.barrier()
    dist.destroy_process_group()
    passed = bool(ok.item())
    if rank == 0:
        print("EP check:", "PASSED" if passed else "FAILED", flush=True)
    moe_testing.leave(passed)  # everything is reported by now


if __name__ == "__main__":
    main()
