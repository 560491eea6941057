"""One rank without FSDP2 (parallel.fsdp = 'auto', megamoe.train.mixed_precision): the same
numbers as FSDP2 on one rank, bitwise, with and without gradient accumulation; checkpoints
that either path resumes; the masters' names, dtypes, gradients and casts."""

import json

import pytest
import torch
from torch import nn

from megamoe.train import config as config_mod
from megamoe.train import model as model_mod
from megamoe.train.mixed_precision import MasterAdamW, MasterWeights, _place
from megamoe.train.trainer import main

COMMON = ["default-cpu", "--train.dtype", "bf16", "--log.plot", "false",
          "--optim.warmup_steps", "2"]


def _curve(log_dir):
    steps = json.loads((log_dir / "run.json").read_text())["steps"]
    return [(r["step"], r["loss"], r["aux_loss"], r["grad_norm"]) for r in steps]


@pytest.mark.parametrize("accum", [1, 2])
def test_one_rank_without_fsdp_equals_fsdp(tmp_path, accum):
    curves = {}
    for fsdp in ("auto", "always"):
        log_dir = tmp_path / fsdp
        assert main(COMMON + ["--train.steps", "5", "--train.grad_accum", str(accum),
                              "--parallel.fsdp", fsdp, "--log.dir", str(log_dir)]) == 0
        curves[fsdp] = _curve(log_dir)
    assert len(curves["auto"]) == 5
    assert curves["auto"] == curves["always"]  # bitwise: loss, aux loss, grad norm


@pytest.mark.parametrize("first, second", [("auto", "always"), ("always", "auto")])
def test_checkpoints_resume_across_the_two_paths(tmp_path, first, second):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(COMMON + ["--train.steps", "6", "--log.dir", str(straight)]) == 0
    assert main(COMMON + ["--train.steps", "3", "--optim.decay_steps", "6",
                          "--checkpoint.interval", "3", "--parallel.fsdp", first,
                          "--log.dir", str(split)]) == 0
    assert main(COMMON + ["--train.steps", "6", "--checkpoint.resume", "latest",
                          "--parallel.fsdp", second, "--log.dir", str(split)]) == 0
    assert _curve(straight) == _curve(split)


def _tiny_model():
    config = config_mod.load("default-cpu", [("data.seq_len", "16"),
                                             ("train.activation_checkpointing", "false")])
    hf_config = model_mod.load_hf_config(config)
    model = model_mod.build_model(config, hf_config, torch.device("cpu"))
    model_mod.apply_dispatch(model, config, torch.device("cpu"))
    return model, hf_config


def test_master_weights_layout_gradients_and_casts():
    model, hf_config = _tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    routers = [block.gate for block in model_mod.moe_blocks(model)]
    router_params = {id(p) for r in routers for p in r.parameters()}
    masters = MasterWeights(model, torch.bfloat16, routers, accumulate_in_fp32=True)

    # The masters carry the model's names (the checkpoint's keys) and its fp32 values.
    assert list(masters.module.state_dict()) == list(model.state_dict())
    for name, master in masters.module.named_parameters():
        assert master.dtype == torch.float32 and torch.equal(master, before[name])
    for _, param in model.named_parameters():
        expected = torch.float32 if id(param) in router_params else torch.bfloat16
        assert param.dtype == expected

    seen = {}

    def router_input(module, args):
        seen["router"] = args[0].dtype

    routers[0].register_forward_pre_hook(router_input)
    ids = torch.randint(0, hf_config.vocab_size, (1, 16))
    grads = []
    for _ in range(2):  # two micro-batches: their gradients add up in fp32
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        grads.append({n: m.grad.clone() for n, m in masters.module.named_parameters()
                      if m.grad is not None})
    assert seen["router"] == torch.float32
    assert all(p.grad is None for p, _ in masters.pairs)  # bf16 gradients freed at once
    name = "model.layers.0.self_attn.q_proj.weight"
    first, total = grads[0][name], grads[1][name]
    assert first.dtype == torch.float32 and first.abs().sum() > 0
    # The same micro-batch twice: the sum is exactly twice the first (fp32, no rounding).
    assert torch.equal(total, 2 * first)

    with torch.no_grad():
        for _, master in masters.pairs:
            master.add_(0.01)
    masters.copy_to_model()
    for param, master in masters.pairs:
        assert torch.equal(param, master.bfloat16())


def test_without_accumulation_the_gradients_stay_in_bf16():
    model, hf_config = _tiny_model()
    masters = MasterWeights(model, torch.bfloat16,
                            [block.gate for block in model_mod.moe_blocks(model)])
    optimizer = MasterAdamW(masters, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, hf_config.vocab_size, (1, 16))
    model(input_ids=ids).logits.float().square().mean().backward()
    for param, master in masters.pairs:
        assert master.grad is None and param.grad.dtype == torch.bfloat16
        assert optimizer.gradient(master) is param.grad
    before = [m.detach().clone() for _, m in masters.pairs]
    norm = optimizer.clip_and_step(1.0)
    assert norm > 0
    # The step moved every master and wrote its bf16 copy; zero_grad clears both sides.
    for (param, master), old in zip(masters.pairs, before):
        assert not torch.equal(master, old) and torch.equal(param, master.bfloat16())
    optimizer.zero_grad()
    assert all(p.grad is None and m.grad is None for p, m in masters.pairs)


def test_master_adamw_equals_torch_adamw_on_fp32_gradients():
    # The same parameters and gradients through torch's AdamW (+ clipping by the norm) and
    # MasterAdamW's clip_and_step, three steps: bitwise equal off CUDA.
    torch.manual_seed(0)
    values = [torch.randn(33, 7), torch.randn(5)]
    grads = [[torch.randn_like(v) * 3 for v in values] for _ in range(3)]
    model = nn.Module()
    model.a, model.b = nn.Parameter(values[0].clone()), nn.Parameter(values[1].clone())
    masters = MasterWeights(model, torch.bfloat16)
    ours = MasterAdamW(masters, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    theirs_params = [nn.Parameter(v.clone()) for v in values]
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, foreach=True)
    for step in grads:
        for (param, _), g in zip(masters.pairs, step):
            param.grad = g.bfloat16()
        for p, g in zip(theirs_params, step):
            p.grad = g.bfloat16().float()
        norm = ours.clip_and_step(1.0)
        expected = torch.nn.utils.clip_grad_norm_(theirs_params, 1.0, foreach=True)
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
        assert torch.allclose(norm, expected, rtol=1e-6)
    for (param, master), p in zip(masters.pairs, theirs_params):
        assert torch.allclose(master, p, rtol=1e-6, atol=1e-7)
        assert torch.equal(param, master.bfloat16())
    state = ours.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 3


def test_fp32_training_keeps_the_model_parameters():
    model, _ = _tiny_model()
    params = list(model.parameters())
    masters = MasterWeights(model, torch.float32)
    assert masters.pairs == [] and list(masters.module.parameters()) == params


def test_fsdp_key_is_checked():
    with pytest.raises(config_mod.ConfigError, match="parallel.fsdp"):
        config_mod.load("default-cpu", [("parallel.fsdp", "never")])


def test_place_builds_the_names_and_refuses_a_second_tensor_under_one():
    root = nn.Module()
    _place(root, "a.b.w", nn.Parameter(torch.zeros(2)), parameter=True)
    assert [n for n, _ in root.named_parameters()] == ["a.b.w"]
    with pytest.raises(KeyError):
        _place(root, "a.b.w", nn.Parameter(torch.zeros(2)), parameter=True)
