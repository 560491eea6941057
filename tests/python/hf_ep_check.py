"""Expert parallelism through megamoe.integrations.transformers, run under torchrun:

    torchrun --nproc-per-node 2 tests/python/hf_ep_check.py --cpu               # gloo, "torch"
    torchrun --nproc-per-node 2 tests/python/hf_ep_check.py --backend fused     # NCCL, bf16

Every rank builds the same small random Qwen3-MoE and runs its own tokens. The EP model
keeps only the rank's experts (shard_experts) and runs "megamoe" over the group (with a
megamoe.Buffer for "fused"); the reference is the whole model under transformers'
"grouped_mm" on the same tokens. The loss and the gradients of the replicated parameters
must match rank by rank; the experts' gradients, summed over the ranks' tokens, must match
the rank's slice. Exits non-zero on a mismatch; prints one line a rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megamoe  # noqa: E402
import megamoe.integrations.transformers as mt  # noqa: E402
from moe_testing import BASE_SEED, rel_err  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

VOCAB = 96


def build(on_gpu: bool, seed: int):
    # In bf16 one MoE layer (test_hf_integration.py's GPU_SHAPES says why); float32 takes two.
    shapes = (dict(hidden_size=256, moe_intermediate_size=128, head_dim=64, num_hidden_layers=1,
                   initializer_range=0.02) if on_gpu
              else dict(hidden_size=64, moe_intermediate_size=32, head_dim=16,
                        num_hidden_layers=2, initializer_range=0.2))
    config = Qwen3MoeConfig(vocab_size=VOCAB, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, max_position_embeddings=128, **shapes)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def loss_and_grads(model, impl, tokens):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tokens, labels=tokens, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32")
    parser.add_argument("--backend", default="torch", choices=["torch", "fused"])
    args = parser.parse_args()
    on_gpu = not args.cpu
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    group = dist.group.WORLD
    tol = 2e-2 if on_gpu else 1e-5

    # One seed for all: the same model on every rank (each draws its own BASE_SEED).
    seed = torch.tensor([BASE_SEED], device=device)
    dist.broadcast(seed, 0, group=group)
    seed = int(seed.item())
    full = build(on_gpu, seed).to(device=device, dtype=dtype)
    ep = copy.deepcopy(full)
    mt.shard_experts(ep, group)
    batch, length = 2, 64
    g = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own tokens
    tokens = torch.randint(0, VOCAB, (batch, length), generator=g).to(device)
    buffer = None
    if args.backend == "fused":
        c = full.config
        buffer = megamoe.Buffer(group, batch * length, c.hidden_size, c.moe_intermediate_size,
                                c.num_experts, c.num_experts_per_tok)
    mt.configure(ep, backend=args.backend, buffer=buffer)

    ref_loss, ref_grads = loss_and_grads(full, "grouped_mm", tokens)
    loss, grads = loss_and_grads(ep, "megamoe", tokens)
    errors = {"loss": rel_err(loss, ref_loss)}
    share = full.config.num_experts // world
    for name, grad in grads.items():
        want = ref_grads[name]
        if name.endswith(("gate_up_proj", "down_proj")):
            want = want.clone()
            dist.all_reduce(want, group=group)  # every rank's tokens reach these experts
            want = want[rank * share:(rank + 1) * share]
        errors[name] = rel_err(grad, want)
    worst = max(errors, key=errors.get)
    ok = all(e < tol for e in errors.values())
    print(f"rank {rank}/{world} backend={args.backend} seed={seed}: worst {worst} {errors[worst]:.2e} "
          f"({len(errors)} compared) {'ok' if ok else 'FAILED ' + str(errors)}", flush=True)
    if buffer is not None:
        torch.cuda.synchronize()
        buffer.check()
        buffer.close()
    verdict = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    if rank == 0:
        print("HF EP check: " + ("PASSED" if verdict.item() else "FAILED"), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if verdict.item() else 1)


if __name__ == "__main__":
    main()
