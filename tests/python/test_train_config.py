"""Bad trainer configs fail at start-up with a message that names the key."""

from pathlib import Path

import pytest
import torch

from megamoe.train import config as config_mod
from megamoe.train import model as model_mod
from megamoe.train.config import ConfigError
from megamoe.train.trainer import main, parse_args

BASE = '[model]\npreset = "tiny"\n'


def load(extra: str = "", overrides=(), base: str = BASE):
    return config_mod.load("test.toml", list(overrides), text=base + extra)


@pytest.mark.parametrize("text, message", [
    ("[train]\nstpes = 3\n", r"train\.stpes: unknown key; did you mean 'train\.steps'\?"),
    ("[trian]\nsteps = 3\n", r"trian: unknown section; did you mean 'train'\?"),
    ("[model.moe.dispatch]\nkind = 'torch'\n", r"model\.moe\.dispatch\.kind: unknown key"),
    ("[train]\nsteps = 'ten'\n", r"train\.steps: expected int, got 'ten' \(str\)"),
    ("[train]\nsteps = 2.5\n", r"train\.steps: expected int, got 2\.5"),
    ("[train]\ncompile = 1\n", r"train\.compile: expected bool, got 1"),
    ("[train]\nsteps = true\n", r"train\.steps: expected int, got True"),
    ("[train]\nsteps = 0\n", r"train\.steps: must be >= 1"),
    ("[optim]\nbetas = [0.9, 'x']\n", r"optim\.betas\[1\]: expected float"),
    ("[optim]\nbetas = [0.9]\n", r"optim\.betas: expected two values"),
    ("[data]\npaths = 'a.txt'\n", r"data\.paths: expected a list of str"),
    ("[model.moe.dispatch]\ntype = 'megamoe'\n",
     r"model\.moe\.dispatch\.type: expected one of \['mega_moe', 'torch', 'hf'\], got 'megamoe'; "
     r"did you mean 'mega_moe'\?"),
    ("[model.moe.dispatch]\ntype = 'hf'\nprecision = 'fp8'\n",
     r"model\.moe\.dispatch\.precision: 'fp8' is not built for model\.moe\.dispatch\.type = 'hf'"),
    ("[model.moe.dispatch]\ntype = 'torch'\nprecision = 'fp8_bwd'\n",
     r"model\.moe\.dispatch\.precision: 'fp8_bwd' is not built for model\.moe\.dispatch\.type = 'torch'"),
    ("[model.moe.dispatch]\nprecision = 'mxfp8'\n", r"model\.moe\.dispatch\.precision: 'mxfp8' needs Blackwell"),
    ("[model.moe.dispatch]\nprecision = 'fp16'\n", r"model\.moe\.dispatch\.precision: expected one of"),
    ("[model.moe.dispatch]\nbackward_mode = 'keep'\n", r"model\.moe\.dispatch\.backward_mode: expected one of"),
    ("[data]\npaths = ['/no/such/corpus.txt']\n", r"data\.paths\[0\]: '/no/such/corpus.txt': no such file"),
    ("[data]\ntokenizer = 'gpt2'\n", r"data\.tokenizer: expected 'bytes', 'bpe' or the path"),
    ("[parallel]\nreshard_after_forward = 'sometimes'\n",
     r"parallel\.reshard_after_forward: expected one of \['default', 'always', 'never'\], "
     r"got 'sometimes'"),
    ("[parallel]\nreshard_after_forward = true\n",
     r"parallel\.reshard_after_forward: expected str, got True"),
    ("[train]\nloss_implementation = 'fused'\n",
     r"train\.loss_implementation: expected one of \['auto', 'compiled', 'eager'\]"),
    ("[checkpoint]\nresume = '/no/such/checkpoint'\n", r"checkpoint\.resume: .*no such directory"),
    ("[parallel]\ndp = 0\n", r"parallel\.dp: must be >= 1, or -1"),
    ("[train]\ncompile = true\ncompile_dense = true\n",
     r"train\.compile_dense: train\.compile already compiles each whole decoder layer"),
    ("[train]\ncompile_dense = true\ncheckpoint_save_attention = true\n",
     r"train\.compile_dense: not built with train\.checkpoint_save_attention = true"),
    ("[train]\nsteps = 10\n[log]\nprofile_step = 11\n",
     r"log\.profile_step: step 11 is past the run's last step \(train\.steps = 10\)"),
])
def test_bad_values_name_the_key(text, message):
    with pytest.raises(ConfigError, match=message):
        load(text)


def test_missing_or_double_model_source():
    with pytest.raises(ConfigError, match=r"model\.preset: unknown preset 'qwen3-30b'; did you mean 'qwen3-30b-a3b'\?"):
        load("", base='[model]\npreset = "qwen3-30b"\n')
    with pytest.raises(ConfigError, match=r"model\.preset / model\.path: give exactly one"):
        load("", base="[train]\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"model\.init = 'pretrained' needs model\.path"):
        load("", base="[model]\npreset = 'tiny'\ninit = 'pretrained'\n")
    with pytest.raises(ConfigError, match=r"model\.path: no transformers config"):
        config = load("", base="[model]\npath = '/no/such/model'\n")
        model_mod.load_hf_config(config)


def test_not_toml_and_missing_file():
    with pytest.raises(ConfigError, match="not valid TOML"):
        load("[train\n")
    with pytest.raises(ConfigError, match="no file 'nowhere.toml', and no embedded config"):
        config_mod.load("nowhere.toml")


def test_overrides_are_checked_like_the_file():
    config = load(overrides=[("train.steps", "7"), ("optim.lr", "1e-3"), ("train.compile", "true"),
                             ("model.moe.dispatch.type", "torch"), ("data.paths", "[]")])
    assert (config.train.steps, config.optim.lr, config.train.compile) == (7, 1e-3, True)
    assert config.model.moe.dispatch.type == "torch"
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key; did you mean 'train\.steps'"):
        load(overrides=[("train.stepz", "7")])
    with pytest.raises(ConfigError, match=r"train\.steps: expected int, got 'many'"):
        load(overrides=[("train.steps", "many")])
    args, overrides = parse_args(["cfg.toml", "--train.steps", "3", "--log.dir=/tmp/x", "--check"])
    assert args.config == "cfg.toml" and args.check
    assert overrides == [("train.steps", "3"), ("log.dir", "/tmp/x")]


def test_model_config_overrides_are_attributes():
    config = load(overrides=[("model.config", "{vocab_size = 512}")])
    assert model_mod.load_hf_config(config).vocab_size == 512
    with pytest.raises(ConfigError, match=r"model\.config\.vocab_sise: Qwen3MoeConfig has no attribute "
                                          r"'vocab_sise'; did you mean 'vocab_size'\?"):
        model_mod.load_hf_config(load(overrides=[("model.config", "{vocab_sise = 512}")]))


@pytest.mark.parametrize("ep, world, local, message", [
    (3, 4, 8, r"parallel\.ep = 3 does not divide the world size 4"),
    (3, 6, 8, r"parallel\.ep = 3 does not divide the model's 8 experts"),
    (4, 8, 2, r"parallel\.ep = 4: an EP group lives inside one node"),
])
def test_expert_parallel_sizes(ep, world, local, message):
    config = load(f"[parallel]\nep = {ep}\n[model.moe.dispatch]\ntype = 'torch'\n")
    hf_config = model_mod.load_hf_config(config)
    with pytest.raises(ConfigError, match=message):
        model_mod.check_runtime(config, hf_config, world, torch.device("cpu"), local)


def test_runtime_dispatch_and_length_checks():
    hf_ep = load("[parallel]\nep = 2\n[model.moe.dispatch]\ntype = 'hf'\n")
    with pytest.raises(ConfigError, match=r"parallel\.ep > 1 with model\.moe\.dispatch\.type = 'hf'"):
        model_mod.check_runtime(hf_ep, model_mod.load_hf_config(hf_ep), 2, torch.device("cpu"), 2)
    cpu_ep = load("[parallel]\nep = 2\n")
    with pytest.raises(ConfigError, match=r"'mega_moe' needs CUDA"):
        model_mod.check_runtime(cpu_ep, model_mod.load_hf_config(cpu_ep), 2, torch.device("cpu"), 2)
    dp_ep = load("[parallel]\nep = 2\ndp = 3\n[model.moe.dispatch]\ntype = 'torch'\n",
                 overrides=[("data.seq_len", "256")])
    with pytest.raises(ConfigError, match=r"parallel\.dp = 3 x parallel\.ep = 2 must equal the world size 4"):
        model_mod.check_runtime(dp_ep, model_mod.load_hf_config(dp_ep), 4, torch.device("cpu"), 4)
    long = load("[data]\nseq_len = 5000\n")
    with pytest.raises(ConfigError, match=r"data\.seq_len = 5000 is longer than the model's "
                                          r"max_position_embeddings = 4096"):
        model_mod.check_runtime(long, model_mod.load_hf_config(long), 1, torch.device("cpu"), 1)
    assert model_mod.check_runtime(dp_ep, model_mod.load_hf_config(dp_ep), 6, torch.device("cpu"), 8) == (3, 2)


def test_start_up_errors_exit_before_training(capsys, tmp_path):
    # Through the command line: the config error is printed with the key, exit status 2,
    # nothing trained (no log directory made).
    log_dir = tmp_path / "log"
    common = ["default-cpu", "--check", "--log.dir", str(log_dir)]
    assert main(common + ["--train.stpes", "3"]) == 2
    assert "train.stpes: unknown key; did you mean 'train.steps'?" in capsys.readouterr().err
    assert main(common + ["--parallel.ep", "2"]) == 2
    assert "parallel.ep = 2 does not divide the world size 1" in capsys.readouterr().err
    assert main(common + ["--model.config", "{vocab_size = 100}"]) == 2
    assert "data.tokenizer: its vocabulary (257) is larger than the model's vocab_size (100)" \
        in capsys.readouterr().err
    assert not log_dir.exists()


def test_embedded_configs_are_valid():
    names = config_mod.embedded_configs()
    assert {"default-cpu", "default-gpu", "bench-qwen3-30b-a3b"} <= set(names)
    for name in names:
        config = config_mod.load(name)
        model_mod.moe_geometry(model_mod.load_hf_config(config))
    bench = config_mod.load("bench-qwen3-30b-a3b")
    hf = model_mod.load_hf_config(bench)
    assert (hf.hidden_size, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok) == (2048, 768, 128, 8)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (32, 4, 128, 151936)
    assert bench.data.seq_len == 16384 and bench.train.activation_checkpointing


def test_every_key_is_documented():
    rows = config_mod.describe_keys()
    keys = {key for key, *_ in rows}
    assert {"model.moe.dispatch.type", "train.steps", "parallel.ep", "checkpoint.resume"} <= keys
    assert all(doc for *_, doc in rows)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    table = docs.split("<!-- keys:begin -->\n", 1)[1].split("\n<!-- keys:end -->", 1)[0]
    assert table == config_mod.markdown_table(), "docs/training.md's key table is out of date"


def test_data_errors_are_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for path, message in ((bad, "bad.jsonl:1: expected an object with a string field 'text'"),
                          (short, "data.seq_len: the corpus has 10 tokens")):
        assert main(["default-cpu", "--check", "--data.paths", f'["{path}"]']) == 2
        assert message in capsys.readouterr().err


def test_reshard_after_forward_policy():
    policy = model_mod.reshard_after_forward
    # default: reshard only units sharded over several ranks, never the last layer.
    assert policy("default", 1) is False and policy("default", 8) is True
    assert policy("default", 8, last_layer=True) is False
    assert all(policy("always", n, last_layer=last) for n in (1, 8) for last in (False, True))
    assert not any(policy("never", n, last_layer=last) for n in (1, 8) for last in (False, True))
    with pytest.raises(ConfigError, match=r"parallel\.reshard_after_forward: expected one of"):
        policy("sometimes", 1)


@pytest.mark.parametrize("policy,precision,device,world,expected", [
    ("default", "fp8", "cuda", 1, "always"), ("default", "fp8_bwd", "cuda", 1, "always"),
    ("default", "bf16", "cuda", 1, "default"), ("default", "fp8", "cuda", 2, "default"),
    ("default", "fp8", "cpu", 1, "default"), ("never", "fp8", "cuda", 1, "never")])
def test_fp8_on_one_gpu_reshards_by_default(policy, precision, device, world, expected):
    config = load(overrides=[("parallel.reshard_after_forward", f'"{policy}"'),
                             ("model.moe.dispatch.precision", f'"{precision}"')])
    applied, why = model_mod.reshard_policy(config, torch.device(device), world)
    assert applied == expected and bool(why) == (applied != policy)


@pytest.mark.parametrize("save_attention", [False, True])
def test_checkpoint_recompute_skips_expert_outputs(save_attention):
    """train.checkpoint_skip_expert_outputs: the checkpoint's recompute context (and only
    it) is inside megamoe.skip_expert_outputs(), with or without the selective policy."""
    from megamoe import _fused_op

    class Model:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs):
            self.kwargs = gradient_checkpointing_kwargs

    for skip in (False, True):
        model = Model()
        model_mod.apply_activation_checkpointing(model, save_attention, skip)
        assert model.kwargs["use_reentrant"] is False
        if not skip and not save_attention:
            assert "context_fn" not in model.kwargs
            continue
        forward, recompute = model.kwargs["context_fn"]()
        with forward:
            assert _fused_op._outputs_wanted()
        with recompute:
            assert _fused_op._outputs_wanted() is not skip
        assert _fused_op._outputs_wanted()
