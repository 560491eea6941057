"""megamoe-train on one GPU: two layers of Qwen3-30B-A3B geometry, 4096-token sequences.
The three experts implementations start from the same weights and data, so their losses
agree to bf16 rounding; two deterministic mega_moe runs agree bitwise."""

import pytest
import torch

from megamoe.train import config as config_mod
from megamoe.train.trainer import run
from moe_testing import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]


def _losses(tmp_path, name, *overrides):
    settings = [("model.num_layers", "2"), ("data.seq_len", "4096"), ("data.tokenizer", '"bytes"'),
                ("train.steps", "4"), ("optim.warmup_steps", "1"), ("optim.lr", "2e-4"),
                ("log.plot", "false"), ("log.dir", f'"{tmp_path / name}"'), *overrides]
    summary = run(config_mod.load("default-gpu", settings))
    assert summary["peak_memory_gib"] > 0
    assert summary["mfu"] is None or 0 < summary["mfu"] < 1
    return [r["loss"] for r in summary["steps"]]


def test_backends_agree_and_mega_moe_is_deterministic(tmp_path):
    deterministic = ("train.deterministic", "true")
    runs = {"mega_moe": _losses(tmp_path, "mega_moe", deterministic)}
    for kind in ("torch", "hf"):
        runs[kind] = _losses(tmp_path, kind, ("model.moe.dispatch.type", f'"{kind}"'))
    for kind, losses in runs.items():
        assert all(torch.isfinite(torch.tensor(losses))), (kind, losses)
        assert losses[0] == pytest.approx(runs["mega_moe"][0], rel=2e-3), kind
        assert losses == pytest.approx(runs["mega_moe"], rel=1e-2), kind
    assert runs["mega_moe"][-1] < runs["mega_moe"][0]
    # torch.use_deterministic_algorithms names any kernel without a deterministic version.
    again = _losses(tmp_path, "again", deterministic)
    assert again == runs["mega_moe"]  # bitwise


def test_recompute_mode_and_grad_accumulation(tmp_path):
    losses = _losses(tmp_path, "recompute", ("model.moe.dispatch.backward_mode", '"recompute"'),
                     ("train.grad_accum", "2"), ("train.activation_checkpointing", "false"))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_compiled_loss_matches_eager_at_the_bench_vocabulary():
    # The fused (Triton, through torch.compile) softmax + gradient of the chunked loss at the
    # benchmark's vocabulary, a partial last chunk and ignored rows, against the eager ops.
    from megamoe.train.loss import IGNORE_INDEX, chunked_linear_cross_entropy
    from moe_testing import BASE_SEED, rel_err

    generator = torch.Generator(device="cuda").manual_seed(BASE_SEED)
    tokens, H, V = 4096 + 100, 2048, 151936
    hidden = torch.randn(tokens, H, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=generator) * 0.02).bfloat16()
    labels = torch.randint(0, V, (tokens,), device="cuda", generator=generator)
    labels[::9] = IGNORE_INDEX
    results = {}
    for kind in ("eager", "compiled"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = chunked_linear_cross_entropy(h, w, labels, 2048, implementation=kind)
        loss.backward()
        results[kind] = (loss.item(), h.grad, w.grad)
    (l_e, dh_e, dw_e), (l_c, dh_c, dw_c) = results["eager"], results["compiled"]
    assert l_c == pytest.approx(l_e, rel=1e-5)
    assert rel_err(dh_c, dh_e) < 2**-10 and rel_err(dw_c, dw_e) < 2**-10
    assert torch.equal(dh_c[::9], torch.zeros_like(dh_c[::9]))


def test_one_rank_paths_agree_on_gpu(tmp_path):
    # No FSDP2 (the one-pass AdamW kernel over masters and bf16 copies) against FSDP2 on one
    # rank: the same step arithmetic up to the norm's reduction order and the kernel's fp32
    # rounding, so the losses agree closely, not bitwise.
    deterministic = ("train.deterministic", "true")
    ours = _losses(tmp_path, "auto", deterministic)
    fsdp = _losses(tmp_path, "fsdp", deterministic, ("parallel.fsdp", '"always"'))
    assert ours[0] == fsdp[0]  # the same weights and data before any step
    assert ours == pytest.approx(fsdp, rel=2e-3)


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_master_adamw_kernel_matches_torch_adamw(max_norm):
    from torch import nn

    from megamoe.train.mixed_precision import MasterAdamW, MasterWeights

    torch.manual_seed(0)
    shapes = [(3, 2053), (7,), (128, 64), (1,)]  # sizes that are not multiples of a block
    model = nn.Module()
    for i, shape in enumerate(shapes):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, device="cuda")))
    model.router = nn.Linear(16, 4, bias=False, device="cuda")  # kept fp32: its own master
    reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    masters = MasterWeights(model, torch.bfloat16, [model.router])
    ours = MasterAdamW(masters, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    theirs = torch.optim.AdamW(reference, lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, foreach=True)
    params = list(model.parameters())
    for _ in range(4):
        grads = [torch.randn_like(r) * 2 for r in reference]
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        for r, p in zip(reference, params):
            r.grad = p.grad.float()
        for param, _ in masters.pairs:
            param.data.fill_(float("nan"))  # every element of the copies must be written
        norm = ours.clip_and_step(max_norm)
        expected = torch.nn.utils.clip_grad_norm_(reference, max_norm if max_norm else 1e30)
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    for master, r in zip(masters.module.parameters(), reference):
        torch.testing.assert_close(master, r, rtol=1e-5, atol=1e-6)
    for param, master in masters.pairs:
        assert torch.equal(param, master.bfloat16())
