"""The trainer end to end on CPU: the tiny default trains (loss falls) with the reference
backend, a resumed run continues the same curve, the router runs in fp32 under bf16, a
non-finite loss or a failed EP call stops the run."""

import json

import pytest
import torch

from megamoe.train import config as config_mod
from megamoe.train import distributed
from megamoe.train import model as model_mod
from megamoe.train import trainer
from megamoe.train.trainer import main, run
from moe_testing import BASE_SEED


def _steps(log_dir):
    return json.loads((log_dir / "run.json").read_text())["steps"]


def test_tiny_default_trains(tmp_path):
    log_dir = tmp_path / "log"
    assert main(["default-cpu", "--train.steps", "12", "--log.dir", str(log_dir),
                 "--log.interval", "4", "--log.profile_step", "3"]) == 0
    record = json.loads((log_dir / "run.json").read_text())
    steps, summary = record["steps"], record["summary"]
    losses = [r["loss"] for r in steps]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert losses[0] == pytest.approx(torch.log(torch.tensor(320.0)).item(), abs=0.1)  # ~uniform
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert summary["dispatch"].startswith("megamoe backend=reference")
    assert summary["config"]["model"]["preset"] == "tiny" and summary["gpu"] == "cpu"
    assert summary["data"]["description"].startswith("the Python")
    assert summary["step_time_median_s"] > 0 and summary["tokens_per_step_per_gpu"] == 512
    assert all(r["grad_norm"] > 0 and r["lr"] > 0 for r in steps)
    assert (log_dir / "curves.png").stat().st_size > 0
    assert len((log_dir / "steps.jsonl").read_text().splitlines()) == 12
    # One step's per-operator table (torch.profiler), only of the step asked for.
    assert [p.name for p in log_dir.glob("profile-step*.txt")] == ["profile-step3.txt"]
    assert "Self CPU" in (log_dir / "profile-step3.txt").read_text()


def test_resume_continues_the_same_curve(tmp_path):
    common = ["default-cpu", "--log.plot", "false", "--optim.warmup_steps", "2",
              "--model.moe.dispatch.backward_mode", "recompute"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(common + ["--train.steps", "6", "--log.dir", str(straight)]) == 0
    # The first half stops at step 3 (its schedule is still the 6-step one) and saves;
    # the second resumes from that checkpoint.
    assert main(common + ["--train.steps", "3", "--optim.decay_steps", "6",
                          "--checkpoint.interval", "3", "--log.dir", str(split)]) == 0
    assert (split / "checkpoints" / "step-000003" / ".metadata").exists()
    assert main(common + ["--train.steps", "6", "--checkpoint.resume", "latest",
                          "--log.dir", str(split)]) == 0
    a, b = _steps(straight), _steps(split)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bitwise, every step
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    summary = json.loads((split / "run.json").read_text())["summary"]
    assert summary["resumed_from"].endswith("step-000003")


def _one_rank_fsdp_model(config, info, param_dtype, experts_unit, save_attention=None):
    """The config's model and its CausalLMTrainer under FSDP2 on a one-rank CPU mesh; with
    experts_unit, every experts module is its own unit (as under EP); save_attention: None
    for no activation checkpointing, else its checkpoint_save_attention."""
    hf_config = model_mod.load_hf_config(config)
    world_mesh, _ = distributed.meshes("cpu", 1, 1, 1)
    model = model_mod.build_model(config, hf_config, info.device)
    model_mod.apply_dispatch(model, config, info.device)
    if save_attention is not None:
        model_mod.apply_activation_checkpointing(model, save_attention)
    trainer = model_mod.CausalLMTrainer(model, 16, aux_loss_coef=0.01)
    model_mod.apply_fsdp(trainer, model, world_mesh, world_mesh if experts_unit else None,
                         param_dtype, 1, config.parallel.reshard_after_forward)
    return model, trainer


@pytest.mark.parametrize("experts_unit", [False, True], ids=["experts-in-layer", "experts-own-unit"])
def test_router_runs_in_fp32_under_bf16(experts_unit):
    config = config_mod.load("default-cpu", [("train.dtype", "bf16"), ("data.seq_len", "32"),
                                             ("train.activation_checkpointing", "false")])
    info = distributed.init("cpu")
    try:
        # Under EP the experts are their own FSDP unit (over the dp mesh; here one rank).
        model, trainer = _one_rank_fsdp_model(config, info, torch.bfloat16, experts_unit)
        seen = {}

        def experts_inputs(module, args):
            seen["hidden"], seen["ids"], seen["weights"] = (a.dtype for a in args)
            seen["expert_weight"] = module.gate_up_proj.dtype

        def router_inputs(module, args):
            seen["router_input"], seen["router_weight"] = args[0].dtype, module.weight.dtype

        block = model_mod.moe_blocks(model)[0]
        block.experts.register_forward_pre_hook(experts_inputs)
        block.gate.register_forward_pre_hook(router_inputs)
        ids = torch.randint(0, 257, (1, 32))
        ce, aux = trainer(ids, torch.roll(ids, -1, 1))
        (ce + aux).backward()
        assert seen["router_input"] == seen["router_weight"] == torch.float32
        assert seen["weights"] == torch.float32  # the fp32 top-k weights reach the experts
        assert seen["hidden"] == seen["expert_weight"] == torch.bfloat16
        grad = block.gate.weight.grad
        assert grad is not None and grad.dtype == torch.float32 and grad.to_local().abs().sum() > 0
    finally:
        distributed.shutdown(info)


def test_check_only_trains_nothing(tmp_path):
    config = config_mod.load("default-cpu", [("log.dir", str(tmp_path / "log"))])
    assert run(config, check_only=True) is None
    assert not (tmp_path / "log").exists()


def test_no_config_picks_the_machine_default(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trainer.default_config_name() == "default-cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trainer.default_config_name() == "default-gpu"
    assert config_mod.load("default-gpu").model.moe.dispatch.type == "mega_moe"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--print-config"]) == 0
    captured = capsys.readouterr()
    assert "running the embedded 'default-cpu' config" in captured.err
    assert json.loads(captured.out)["model"]["preset"] == "tiny"


def test_pretrained_weights_from_a_local_directory(tmp_path):
    # A model saved with save_pretrained and trained from model.path with init =
    # "pretrained" starts from those weights: here the preset's own seed-0 weights, so
    # the first loss equals a preset run's.
    config = config_mod.load("default-cpu")
    model = model_mod.build_model(config, model_mod.load_hf_config(config), torch.device("cpu"))
    model.save_pretrained(tmp_path / "tiny-model")
    common = ["--train.steps", "2", "--log.plot", "false", "--train.seed", "0"]
    assert main(["default-cpu", *common, "--log.dir", str(tmp_path / "preset")]) == 0
    assert main(["default-cpu", *common, "--log.dir", str(tmp_path / "loaded"),
                 "--model.preset", '""', "--model.path", str(tmp_path / "tiny-model"),
                 "--model.init", "pretrained"]) == 0
    preset, loaded = _steps(tmp_path / "preset"), _steps(tmp_path / "loaded")
    assert loaded[0]["loss"] == preset[0]["loss"]
    assert json.loads((tmp_path / "loaded" / "run.json").read_text())["summary"]["config"]["model"]["init"] == "pretrained"


@pytest.mark.parametrize("policy, resharded", [("default", [False, False]),
                                               ("always", [True, True]),
                                               ("never", [False, False])])
def test_reshard_after_forward_reaches_fsdp(policy, resharded):
    # One rank: 'default' keeps every layer's gathered parameters from the forward to the
    # backward. A resharded layer holds its sharded DTensor parameters again after the forward.
    from torch.distributed.tensor import DTensor

    config = config_mod.load("default-cpu", [("data.seq_len", "32"), ("model.num_layers", "2"),
                                             ("parallel.reshard_after_forward", f'"{policy}"')])
    info = distributed.init("cpu")
    try:
        model, trainer = _one_rank_fsdp_model(config, info, torch.float32, False)
        ids = torch.randint(0, 257, (1, 32))
        ce, aux = trainer(ids, torch.roll(ids, -1, 1))
        layers = model_mod.decoder_layers(model)
        after_forward = [isinstance(layer.self_attn.q_proj.weight, DTensor) for layer in layers]
        assert after_forward == resharded
        (ce + aux).backward()
        # After the backward every unit is sharded again, its gradients sharded DTensors.
        assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor)
                   for p in model.parameters() if p.requires_grad)
    finally:
        distributed.shutdown(info)


def test_checkpointing_keeps_the_attention_kernel_outputs():
    # Selective checkpointing: the backward's recompute of each layer reuses the forward's
    # attention kernel outputs (the kernel runs once per layer, not twice) and the
    # gradients are bitwise those of the full recompute.
    from torch.utils._python_dispatch import TorchDispatchMode

    kernels = set(model_mod.attention_kernels())

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in kernels
            return func(*args, **(kwargs or {}))

    config = config_mod.load("default-cpu", [("data.seq_len", "32"), ("model.num_layers", "2")])
    ids = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(BASE_SEED))
    results = {}
    for save in (False, True):
        info = distributed.init("cpu")
        try:
            model, trainer = _one_rank_fsdp_model(config, info, torch.float32, False, save)
            Count.calls = 0
            with Count():
                ce, aux = trainer(ids, torch.roll(ids, -1, 1))
                (ce + aux).backward()
            grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
            results[save] = (Count.calls, ce.item(), grads)
        finally:
            distributed.shutdown(info)
    layers = 2
    assert results[False][0] == 2 * layers and results[True][0] == layers
    assert results[True][1] == results[False][1]
    assert results[True][2].keys() == results[False][2].keys()
    assert all(torch.equal(results[True][2][n], g) for n, g in results[False][2].items())


def test_compile_dense_still_compiles_after_the_parts_are_timed():
    # --time-parts times a one-layer copy first, its compiled attention once under a
    # dispatch mode; the run's own compiled modules must still compile afterwards (they
    # ran eagerly, unnoticed, before the parts reset Dynamo).
    from torch._dynamo.utils import counters

    from megamoe.train import parts

    config = config_mod.load("default-cpu", [("data.seq_len", "32"), ("model.num_layers", "1"),
                                             ("train.checkpoint_save_attention", "false"),
                                             ("train.compile_dense", "true")])
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    info = distributed.init("cpu")
    try:
        hf_config = model_mod.load_hf_config(config)
        parts.time_parts(config, hf_config, info.device, say=lambda _: None, iterations=1,
                         warmup=1)
        torch.manual_seed(BASE_SEED)
        model = model_mod.build_model(config, hf_config, info.device)
        model_mod.apply_dispatch(model, config, info.device)
        model_mod.apply_activation_checkpointing(model, False)
        model_mod.apply_compile_dense(model)
        trainer_ = model_mod.CausalLMTrainer(model, 16, aux_loss_coef=0.01)
        ids = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(BASE_SEED))
        counters.clear()
        ce, aux = trainer_(ids, torch.roll(ids, -1, 1))
        (ce + aux).backward()
        assert counters["stats"]["unique_graphs"] > 0
    finally:
        distributed.shutdown(info)


def test_compile_dense_compiles_all_but_the_moe_blocks():
    # torch.compile (C++ code on the CPU) of each layer's attention block and norms and of
    # the final norm; the MoE blocks stay eager. The same loss and gradients as eager up to
    # the compiled code's rounding (float32), and the compiled code is what ran.
    from torch._dynamo.utils import counters

    config = config_mod.load("default-cpu", [("data.seq_len", "32"), ("model.num_layers", "2"),
                                             ("train.checkpoint_save_attention", "false")])
    ids = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(BASE_SEED))
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    info = distributed.init("cpu")
    results = {}
    try:
        for compiled in (False, True):
            hf_config = model_mod.load_hf_config(config)
            torch.manual_seed(BASE_SEED)
            model = model_mod.build_model(config, hf_config, info.device)
            model_mod.apply_dispatch(model, config, info.device)
            model_mod.apply_activation_checkpointing(model, False)
            names = model_mod.apply_compile_dense(model) if compiled else []
            trainer = model_mod.CausalLMTrainer(model, 16, aux_loss_coef=0.01)
            counters.clear()
            ce, aux = trainer(ids, torch.roll(ids, -1, 1))
            (ce + aux).backward()
            graphs = counters["stats"]["unique_graphs"]
            results[compiled] = (ce.item(), {n: p.grad for n, p in model.named_parameters()},
                                 names, graphs)
    finally:
        distributed.shutdown(info)
    names = results[True][2]
    assert names == ["layers.0.self_attn", "layers.0.input_layernorm",
                     "layers.0.post_attention_layernorm", "layers.1.self_attn",
                     "layers.1.input_layernorm", "layers.1.post_attention_layernorm", "model.norm"]
    # The layers share the attention's and the norm's graphs (no recompilation per layer).
    assert results[False][3] == 0 and 0 < results[True][3] <= 3
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    eager, compiled = results[False][1], results[True][1]
    assert eager.keys() == compiled.keys()
    for name, grad in eager.items():
        assert torch.allclose(compiled[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max()), name


class _FailedEpBuffer:
    """Stands in for a megamoe.Buffer on which a call timed out."""

    def check(self):
        from megamoe.errors import MegaMoEError

        raise MegaMoEError("expert-parallel call failed on rank 0: rank 1 did not arrive in "
                           "phase 'counts' within the timeout")


@pytest.mark.parametrize("failure", ["nan_loss", "failed_ep_call"])
def test_a_non_finite_loss_or_a_failed_ep_call_stops_training(tmp_path, monkeypatch, failure):
    # A NaN loss stops the run at that step; a failed EP call stops it at the step's end
    # with that call's error (the buffer is checked every step), whatever the loss.
    from megamoe.errors import MegaMoEError

    setup_training = trainer._setup_training

    def broken(*args, **kwargs):
        setup = setup_training(*args, **kwargs)
        if failure == "nan_loss":
            step = setup.trainer

            def nan_loss(input_ids, labels):
                ce, aux = step(input_ids, labels)
                return ce * float("nan"), aux
            setup.trainer = nan_loss
        else:
            setup.ep_buffer = _FailedEpBuffer()
        return setup

    monkeypatch.setattr(trainer, "_setup_training", broken)
    expected = {"nan_loss": (FloatingPointError, "step 1: loss nan"),
                "failed_ep_call": (MegaMoEError, "rank 1 did not arrive")}[failure]
    log_dir = tmp_path / "log"
    with pytest.raises(expected[0], match=expected[1]):
        main(["default-cpu", "--train.steps", "3", "--log.dir", str(log_dir),
              "--log.plot", "false"])
    assert len((log_dir / "steps.jsonl").read_text().splitlines()) == 1  # stopped at step 1
