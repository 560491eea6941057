"""megamoe as a transformers experts implementation (megamoe.integrations.transformers).

CPU: small random models through "megamoe" (reference and torch backends) against
transformers' own "grouped_mm" (and "eager" in float64, which grouped_mm does not take):
loss and the gradients of every parameter; a saved and reloaded checkpoint; other model
families; strided and mixed-dtype inputs; what megamoe cannot serve (an error that says why,
or transformers' implementation with a warning); configure()'s checks and precedence.
GPU (skipped without one): the fused and torch backends in bf16 against grouped_mm, both
backward modes, torch.compile, activation checkpointing, autocast over fp32 weights.
"""

import copy
import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.17",
                                   reason="needs transformers >= 5.17 (pip install '.[hf]')")

import megamoe  # noqa: E402
import megamoe.integrations.transformers as mt  # noqa: E402
from megamoe import MegaMoEError  # noqa: E402
from moe_testing import BASE_SEED, needs_cuda, rel_err  # noqa: E402
from transformers.integrations.moe import (ALL_EXPERTS_FUNCTIONS,  # noqa: E402
                                           grouped_mm_experts_forward)

VOCAB = 96
# Small enough for CI's slow cores; initializer_range 0.2 so the experts' outputs matter.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.2)


def _qwen3_config(**overrides):
    args = dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True)
    args.update(overrides)
    return transformers.Qwen3MoeConfig(**args)


# Families whose experts modules megamoe serves, each as (config, model class).
FAMILIES = {
    "qwen3_moe": lambda: (_qwen3_config(), transformers.Qwen3MoeForCausalLM),
    "mixtral": lambda: (transformers.MixtralConfig(**COMMON, head_dim=16, num_local_experts=8,
                                                   num_experts_per_tok=2),
                        transformers.MixtralForCausalLM),
    "olmoe": lambda: (transformers.OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2,
                                               eos_token_id=None, pad_token_id=None),
                      transformers.OlmoeForCausalLM),
    "qwen2_moe": lambda: (transformers.Qwen2MoeConfig(**COMMON, num_experts=8,
                                                      num_experts_per_tok=2,
                                                      moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=64),
                          transformers.Qwen2MoeForCausalLM),
    "deepseek_v3": lambda: (transformers.DeepseekV3Config(
        **COMMON, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
        topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1),
        transformers.DeepseekV3ForCausalLM),
    "qwen3_next": lambda: (transformers.Qwen3NextConfig(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"]),
        transformers.Qwen3NextForCausalLM),
}


def _model(family="qwen3_moe", dtype=torch.float32, seed=0, config=None, device="cpu"):
    default_config, cls = FAMILIES[family]()
    torch.manual_seed(BASE_SEED + seed)
    return cls(config or default_config).to(device=device, dtype=dtype)


def _tokens(seed=0, batch=2, length=16, device="cpu"):
    g = torch.Generator().manual_seed(BASE_SEED + 1000 + seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g).to(device)


def _experts(model):
    return [m for m in model.modules() if mt.is_experts_module(m)]


def _loss_and_grads(model, impl, tokens, forward=None):
    """The LM loss and the gradient of every parameter, under experts implementation impl."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = (forward if forward is not None else model)(input_ids=tokens, labels=tokens,
                                                      use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def _max_grad_error(grads, ref):
    assert grads.keys() == ref.keys()
    return max(rel_err(grads[n], ref[n]) for n in ref)


@pytest.fixture(autouse=True)
def _clean_options(monkeypatch):
    """Every test starts from the defaults (whatever MEGAMOE_* the shell has), with no
    fallback warning given yet."""
    monkeypatch.setattr(mt, "_ENVIRONMENT", {})
    mt.reset()
    mt._WARNED.clear()
    yield
    mt.reset()
    mt._WARNED.clear()


@pytest.fixture
def moe_calls(monkeypatch):
    """The backend of every megamoe.moe call the integration makes (proves it ran)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["backend"])
        return megamoe.moe(*args, **kwargs)

    monkeypatch.setattr(mt, "moe", spy)
    return calls


# -- registration and imports ------------------------------------------------------------

def test_importing_megamoe_leaves_transformers_out_and_reads_the_environment():
    code = (
        "import sys, megamoe, megamoe.integrations\n"
        "assert 'transformers' not in sys.modules, 'megamoe imported transformers'\n"
        "import megamoe.integrations.transformers as mt\n"
        "from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts\n"
        "from transformers import Qwen3MoeConfig\n"
        "e = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=2))\n"
        "o = mt.options(e)\n"
        "print(o.backend, o.precision, o.backward_mode, o.on_unsupported)\n")
    env = dict(os.environ, MEGAMOE_BACKEND="torch", MEGAMOE_PRECISION="bf16",
               MEGAMOE_BACKWARD_MODE="saved", MEGAMOE_ON_UNSUPPORTED="fallback",
               PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "bf16", "saved", "fallback"]


def test_environment_values_are_checked():
    assert mt._read_environment({"MEGAMOE_BACKEND": " reference ", "MEGAMOE_PRECISION": ""}) == {
        "backend": "reference"}
    for variable, value in (("MEGAMOE_BACKEND", "fuse"), ("MEGAMOE_PRECISION", "fp4"),
                            ("MEGAMOE_BACKWARD_MODE", "keep"), ("MEGAMOE_ON_UNSUPPORTED", "ignore")):
        with pytest.raises(MegaMoEError, match=rf"{variable}: expected one of .*got '{value}'"):
            mt._read_environment({variable: value})


def test_register_is_idempotent_and_keeps_other_names():
    assert ALL_EXPERTS_FUNCTIONS["megamoe"] is mt.experts_forward
    mt.register()
    mt.register("megamoe")
    assert ALL_EXPERTS_FUNCTIONS["megamoe"] is mt.experts_forward
    for taken in ("grouped_mm", "eager", "batched_mm"):
        with pytest.raises(MegaMoEError, match=f"name: '{taken}' is already an experts"):
            mt.register(taken)
    with pytest.raises(MegaMoEError, match="name: expected a non-empty string"):
        mt.register("")
    mt.register("megamoe_test_alias")
    try:
        model = _model()
        tokens = _tokens()
        loss, _ = _loss_and_grads(model, "megamoe_test_alias", tokens)
        ref, _ = _loss_and_grads(model, "grouped_mm", tokens)
        assert rel_err(loss, ref) < 1e-5
    finally:
        del type(ALL_EXPERTS_FUNCTIONS)._global_mapping["megamoe_test_alias"]


# -- against transformers' own implementations -------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_qwen3_moe_matches_grouped_mm(backend, moe_calls):
    model = _model(seed=1)
    tokens = _tokens(seed=1)
    ref_loss, ref_grads = _loss_and_grads(model, "grouped_mm", tokens)
    if backend != "reference":
        mt.configure(model, backend=backend)
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert moe_calls == [backend] * 2  # one call per MoE layer
    assert len(grads) == len(list(model.parameters()))  # every parameter got a gradient
    assert rel_err(loss, ref_loss) < 1e-6
    assert _max_grad_error(grads, ref_grads) < 1e-5


def test_qwen3_moe_float64_matches_eager():
    """float64 end to end (the C++ reference keeps float64; grouped_mm takes no float64)."""
    model = _model(dtype=torch.float64, seed=2)
    tokens = _tokens(seed=2)
    ref_loss, ref_grads = _loss_and_grads(model, "eager", tokens)
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert rel_err(loss, ref_loss) < 1e-12
    assert _max_grad_error(grads, ref_grads) < 1e-10


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_other_families_match_grouped_mm(family, moe_calls):
    model = _model(family, seed=3)
    tokens = _tokens(seed=3)
    ref_loss, ref_grads = _loss_and_grads(model, "grouped_mm", tokens)
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert len(moe_calls) == len(_experts(model)) > 0
    assert rel_err(loss, ref_loss) < 1e-6
    # fp32 on both sides: a small parameter whose gradient terms cancel reaches ~1e-5 (seen
    # at 1.1e-5 for qwen3_next); a wrong result is off by far more. The fp64 check below is
    # the exact one.
    assert _max_grad_error(grads, ref_grads) < 1e-4


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_other_families_float64_match_eager(family):
    model = _model(family, dtype=torch.float64, seed=3)
    tokens = _tokens(seed=3)
    ref_loss, ref_grads = _loss_and_grads(model, "eager", tokens)
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert rel_err(loss, ref_loss) < 1e-12
    assert _max_grad_error(grads, ref_grads) < 1e-10


def test_checkpoint_saved_and_reloaded(tmp_path, moe_calls):
    model = _model(seed=4)
    tokens = _tokens(seed=4)
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        expected = model(input_ids=tokens, use_cache=False).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="megamoe")
    assert reloaded.config._experts_implementation == "megamoe"
    with torch.no_grad():
        logits = reloaded(input_ids=tokens, use_cache=False).logits
    assert len(moe_calls) == 2
    assert rel_err(logits, expected) < 1e-6
    # The choice is not written into the checkpoint: a plain load gets transformers' default.
    assert transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path).config._experts_implementation != "megamoe"


def test_gradient_checkpointing_cpu():
    model = _model(seed=5)
    tokens = _tokens(seed=5)
    model.train()
    ref_loss, ref_grads = _loss_and_grads(model, "megamoe", tokens)
    model.gradient_checkpointing_enable()
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert torch.equal(loss, ref_loss)
    assert _max_grad_error(grads, ref_grads) < 1e-6


def test_compiled_model_cpu():
    """The whole model compiles without graph breaks around megamoe; a configure() after
    compiling takes effect (the compiled code guards the options)."""
    model = _model(seed=6, config=_qwen3_config(num_hidden_layers=1))
    tokens = _tokens(seed=6)
    ref_loss, ref_grads = _loss_and_grads(model, "megamoe", tokens)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, grads = _loss_and_grads(model, "megamoe", tokens, forward=compiled)
    assert rel_err(loss, ref_loss) < 1e-6
    assert _max_grad_error(grads, ref_grads) < 1e-5
    mt.configure(model, backend="fused")
    # fullgraph=True: dynamo reports the error (our message) as an exception leaving the graph.
    with pytest.raises((MegaMoEError, torch._dynamo.exc.Unsupported),
                       match="backend='fused' runs on CUDA tensors"):
        compiled(input_ids=tokens, use_cache=False)


# -- inputs the way models produce them -----------------------------------------------------

def _routing(N, E, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(BASE_SEED + 2000 + seed)
    probs = torch.softmax(torch.randn(N, E, generator=g), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def _experts_call(fn, experts, hidden, ids, weights, dy):
    """fn's output and the gradients of <dy, out> for hidden, the router weights and the
    experts' weights (given tensors are cloned into fresh leaves of the same layout)."""
    hidden = hidden.detach().clone().requires_grad_(True) if hidden.is_contiguous() else (
        _same_layout_leaf(hidden))
    weights = weights.detach().clone().requires_grad_(True) if weights.is_contiguous() else (
        _same_layout_leaf(weights))
    experts.zero_grad(set_to_none=True)
    out = fn(experts, hidden, ids, weights)
    out.backward(dy)
    return out.detach(), [hidden.grad, weights.grad, experts.gate_up_proj.grad,
                          experts.down_proj.grad]


def _same_layout_leaf(t):
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    leaf.copy_(t)
    return leaf.requires_grad_(True)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_strided_bf16_router_weights_int64_ids(backend):
    """A transposed hidden_states, transposed-storage ids and bf16 router weights, and
    expert weights stored transposed (non-contiguous Parameters)."""
    model = _model(seed=7, config=_qwen3_config(num_hidden_layers=1))
    experts = _experts(model)[0]
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name).detach()
        setattr(experts, name, nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2)))
        assert not getattr(experts, name).is_contiguous()
    N, H = 40, 64
    g = torch.Generator().manual_seed(BASE_SEED + 7)
    hidden = torch.randn(H, N, generator=g).t()
    ids, weights = _routing(N, 8, 2, seed=7, dtype=torch.bfloat16)
    ids = ids.t().contiguous().t()
    weights = weights.t().contiguous().t()
    assert ids.dtype == torch.int64 and not hidden.is_contiguous() and not ids.is_contiguous()
    dy = torch.randn(N, H, generator=g)
    mt.configure(model, backend=backend)
    out, grads = _experts_call(mt.experts_forward, experts, hidden, ids, weights, dy)
    ref, ref_grads = _experts_call(grouped_mm_experts_forward, experts, hidden.contiguous(),
                                   ids.contiguous(), weights.contiguous(), dy)
    assert rel_err(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        # The router weights' gradient is bf16: one rounding step apart at most.
        tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
        assert got.dtype == want.dtype and rel_err(got, want) < tol


def test_float32_hidden_states_into_bf16_experts():
    """hidden_states in float32 with bf16 weights (as under autocast): computed from the
    input cast to the weights' dtype, returned in the input's dtype, like grouped_mm."""
    model = _model(seed=8, dtype=torch.bfloat16, config=_qwen3_config(num_hidden_layers=1))
    experts = _experts(model)[0]
    N = 33
    g = torch.Generator().manual_seed(BASE_SEED + 8)
    hidden = torch.randn(N, 64, generator=g)
    ids, weights = _routing(N, 8, 2, seed=8)
    dy = torch.randn(N, 64, generator=g)
    out, grads = _experts_call(mt.experts_forward, experts, hidden, ids, weights, dy)
    ref, ref_grads = _experts_call(grouped_mm_experts_forward, experts, hidden, ids, weights, dy)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 2e-2
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and rel_err(got, want) < 3e-2


def test_batched_hidden_states_and_sentinel_ids():
    """[B, S, H] inputs come back [B, S, H]; an id equal to the expert count (transformers'
    expert-parallel router's mark for a slot of another rank, weight 0) adds nothing."""
    model = _model(seed=9, config=_qwen3_config(num_hidden_layers=1))
    experts = _experts(model)[0]
    g = torch.Generator().manual_seed(BASE_SEED + 9)
    hidden = torch.randn(24, 64, generator=g)
    ids, weights = _routing(24, 8, 2, seed=9)
    ids[::3, 1] = 8
    weights[::3, 1] = 0.0
    dy = torch.randn(24, 64, generator=g)
    out, grads = _experts_call(mt.experts_forward, experts, hidden, ids, weights, dy)
    ref, ref_grads = _experts_call(grouped_mm_experts_forward, experts, hidden, ids, weights, dy)
    assert rel_err(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-5
    batched = mt.experts_forward(experts, hidden.view(4, 6, 64), ids.view(4, 6, 2),
                                 weights.view(4, 6, 2))
    assert batched.shape == (4, 6, 64) and rel_err(batched.reshape(24, 64), out) < 1e-6


# -- what megamoe cannot serve --------------------------------------------------------------

class _NotQuiteSiLU(nn.SiLU):
    def forward(self, x):
        return super().forward(x) * 1.5


def _set_act(experts, fn):
    """A plain function as act_fn (as Lfm2MoeExperts has F.silu), replacing the module."""
    delattr(experts, "act_fn")
    experts.act_fn = fn


def _float8(experts):
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach().to(torch.float8_e4m3fn),
                                        requires_grad=False)


def _extra_parameter(experts):
    experts.scale = nn.Parameter(torch.ones(8))


@pytest.mark.parametrize("change,pattern", [
    (lambda e: setattr(e, "has_bias", True), r"add biases \(has_bias=True\)"),
    (lambda e: setattr(e, "is_transposed", True), r"stored transposed \(is_transposed=True"),
    (lambda e: setattr(e, "is_concatenated", False), r"interleaved \(is_concatenated=False"),
    (lambda e: setattr(e, "has_gate", False), r"no gate \(has_gate=False"),
    (lambda e: setattr(e, "_apply_gate", lambda h: h[:, :32]), r"defines its own _apply_gate"),
    (lambda e: setattr(e, "act_fn", nn.GELU()), r"its activation is GELU, not SiLU"),
    (lambda e: setattr(e, "act_fn", _NotQuiteSiLU()), r"its activation is _NotQuiteSiLU, not SiLU"),
    (lambda e: _set_act(e, torch.sigmoid), r"its activation is sigmoid, not SiLU"),
    (_float8, r"gate_up_proj is torch.float8_e4m3fn"),
    (_extra_parameter, r"it holds \['scale'\] beside gate_up_proj and down_proj"),
])
def test_unsupported_experts_raise_saying_why(change, pattern):
    model = _model(seed=10, config=_qwen3_config(num_hidden_layers=1))
    model.set_experts_implementation("megamoe")
    change(_experts(model)[0])
    with pytest.raises(MegaMoEError, match=rf"megamoe cannot serve Qwen3MoeExperts: .*{pattern}"):
        model(input_ids=_tokens(), use_cache=False)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.functional.silu])
def test_other_spellings_of_silu_are_served(act, moe_calls):
    model = _model(seed=11, config=_qwen3_config(num_hidden_layers=1))
    _set_act(_experts(model)[0], act)
    tokens = _tokens(seed=11)
    loss, _ = _loss_and_grads(model, "megamoe", tokens)
    ref, _ = _loss_and_grads(model, "grouped_mm", tokens)
    assert moe_calls == ["reference"] and rel_err(loss, ref) < 1e-6


def _fallback_case(name):
    """(model, experts implementation to compare with, pattern of the reason)."""
    if name == "gelu":
        config = _qwen3_config(num_hidden_layers=1, hidden_act="gelu_pytorch_tanh")
        return _model(seed=12, config=config), "grouped_mm", "its activation is GELUTanh"
    if name == "gpt_oss":
        config = transformers.GptOssConfig(**dict(COMMON, intermediate_size=32), head_dim=16,
                                           num_local_experts=8, num_experts_per_tok=2)
        torch.manual_seed(BASE_SEED + 12)
        return (transformers.GptOssForCausalLM(config), "grouped_mm",
                r"has_bias=True.*is_transposed=True.*is_concatenated=False.*_apply_gate")
    if name == "fused_on_cpu":
        model = _model(seed=12, config=_qwen3_config(num_hidden_layers=1))
        mt.configure(model, backend="fused")
        return model, "grouped_mm", "backend='fused' runs on CUDA tensors"
    if name == "torch_float64":  # grouped_mm takes no float64: the module's eager forward
        model = _model(seed=12, dtype=torch.float64, config=_qwen3_config(num_hidden_layers=1))
        mt.configure(model, backend="torch")
        return model, "eager", "backend='torch' on cpu runs torch._grouped_mm"
    if name == "fp8_not_built":
        model = _model(seed=12, config=_qwen3_config(num_hidden_layers=1))
        mt.configure(model, backend="torch", precision="fp8_bwd")
        return model, "grouped_mm", "precision='fp8_bwd' is not built yet"
    raise AssertionError(name)


FALLBACK_CASES = ["gelu", "gpt_oss", "fused_on_cpu", "torch_float64", "fp8_not_built"]


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_unsupported_raises_by_default(case):
    model, _, pattern = _fallback_case(case)
    model.set_experts_implementation("megamoe")
    with pytest.raises(MegaMoEError, match=rf"megamoe cannot serve \w+: .*{pattern}.*"
                                           r"on_unsupported='fallback'"):
        model(input_ids=_tokens(), use_cache=False)


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_fallback_runs_transformers_and_warns_once(case, moe_calls):
    model, impl, pattern = _fallback_case(case)
    mt.configure(model, on_unsupported="fallback")
    tokens = _tokens(seed=12)
    ref_loss, ref_grads = _loss_and_grads(model, impl, tokens)
    with pytest.warns(mt.MegaMoEFallbackWarning, match=rf"runs transformers' .* instead: .*{pattern}"):
        loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert moe_calls == []
    assert torch.equal(loss, ref_loss)
    assert _max_grad_error(grads, ref_grads) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", mt.MegaMoEFallbackWarning)
        _loss_and_grads(model, "megamoe", tokens)  # said once


def test_expert_parallel_group_of_one_rank(one_rank_group, moe_calls):
    model = _model(seed=13, config=_qwen3_config(num_hidden_layers=1))
    tokens = _tokens(seed=13)
    ref_loss, ref_grads = _loss_and_grads(model, "grouped_mm", tokens)
    mt.configure(model, group=one_rank_group, backend="torch")
    assert mt.options(_experts(model)[0]).group is one_rank_group
    loss, grads = _loss_and_grads(model, "megamoe", tokens)
    assert moe_calls == ["torch"]
    assert rel_err(loss, ref_loss) < 1e-6 and _max_grad_error(grads, ref_grads) < 1e-5


def test_expert_parallel_never_falls_back(one_rank_group, monkeypatch):
    """Under a group of several ranks each holds only its experts: transformers'
    implementations would give a wrong result, so there is no fallback, and a module that
    holds all experts is refused."""
    monkeypatch.setattr(mt, "_world_size", lambda group: 2)
    model, _, _ = _fallback_case("gelu")
    mt.configure(model, group=one_rank_group, on_unsupported="fallback")
    model.set_experts_implementation("megamoe")
    with pytest.raises(MegaMoEError, match="its activation is GELUTanh.*cannot fall back.*2 ranks"):
        model(input_ids=_tokens(), use_cache=False)
    model = _model(seed=14, config=_qwen3_config(num_hidden_layers=1))
    mt.configure(model, group=one_rank_group, backend="torch")
    model.set_experts_implementation("megamoe")
    with pytest.raises(MegaMoEError, match=r"holds 8 experts of 8; .*2 ranks each rank must "
                                           r"hold its 4: rank r keeps experts \[r\*4, \(r\+1\)\*4\)"):
        model(input_ids=_tokens(), use_cache=False)


def test_shard_experts(one_rank_group, monkeypatch):
    model = _model(seed=15, config=_qwen3_config(num_hidden_layers=1))
    with pytest.raises(MegaMoEError, match="group: expected the expert-parallel ProcessGroup"):
        mt.shard_experts(model, None)
    experts = _experts(model)[0]
    full = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    monkeypatch.setattr(mt, "_world_size", lambda group: 2)  # rank 0 of 2
    mt.shard_experts(model, one_rank_group)
    assert torch.equal(experts.gate_up_proj, full[0][:4])
    assert torch.equal(experts.down_proj, full[1][:4])
    assert isinstance(experts.gate_up_proj, nn.Parameter) and experts.gate_up_proj.requires_grad
    assert mt.options(experts).group is one_rank_group
    with pytest.raises(MegaMoEError, match="holds 4 of 8 experts; it is sharded already"):
        mt.shard_experts(model, one_rank_group)


def test_sliced_experts_without_a_group_are_refused():
    """A module sliced for expert parallelism but run without its group would read global
    ids as local ones."""
    model = _model(seed=16, config=_qwen3_config(num_hidden_layers=1))
    experts = _experts(model)[0]
    for name in ("gate_up_proj", "down_proj"):
        setattr(experts, name, nn.Parameter(getattr(experts, name).detach()[:4].clone()))
    model.set_experts_implementation("megamoe")
    with pytest.raises(MegaMoEError, match="holds 4 experts but counts num_experts=8: .*"
                                           r"configure\(group=...\)"):
        model(input_ids=_tokens(), use_cache=False)


def _run_hf_ep_check(*extra):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_ep_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", script, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    print(proc.stdout[-20000:])
    print(proc.stderr[-5000:], file=sys.stderr)
    assert proc.returncode == 0 and "HF EP check: PASSED" in proc.stdout


def test_expert_parallel_two_ranks_cpu():
    """shard_experts + the torch backend over gloo, two processes, against grouped_mm."""
    _run_hf_ep_check("--cpu")


# -- configure() and options() -----------------------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    (dict(backend="cutlass"), r"backend: expected one of \('auto', 'fused', 'torch', 'reference'\)"),
    (dict(precision="fp4"), r"precision: expected one of .*'bf16'.*got 'fp4'"),
    (dict(backward_mode="keep"), r"backward_mode: expected one of \('recompute', 'saved'\)"),
    (dict(on_unsupported="ignore"), r"on_unsupported: expected one of \('error', 'fallback'\)"),
    (dict(group="world"), r"group: expected a torch.distributed ProcessGroup, got str"),
    (dict(buffer=object()), r"buffer: expected a megamoe.Buffer, got object"),
    (dict(check_ids="yes"), r"check_ids: expected True or False, got 'yes'"),
])
def test_configure_checks_its_arguments(kwargs, pattern):
    with pytest.raises(MegaMoEError, match=pattern):
        mt.configure(**kwargs)
    with pytest.raises(MegaMoEError, match=pattern):
        mt.configure(_model(config=_qwen3_config(num_hidden_layers=1)), **kwargs)


def test_configure_needs_a_model_with_experts():
    with pytest.raises(MegaMoEError, match="model: expected a torch.nn.Module or None, got int"):
        mt.configure(42, backend="torch")
    with pytest.raises(MegaMoEError, match="model: Linear contains no transformers experts module"):
        mt.configure(nn.Linear(2, 2), backend="torch")
    with pytest.raises(MegaMoEError, match="module: expected a transformers experts module"):
        mt.options(nn.Linear(2, 2))


def test_options_precedence(monkeypatch):
    """module settings > process-wide settings > environment > defaults."""
    model = _model(config=_qwen3_config(num_hidden_layers=2))
    first, second = _experts(model)
    assert mt.options(first) == mt.Options()
    assert mt.options(first) == mt.Options(backend="auto", precision="bf16",
                                           backward_mode="recompute", group=None, buffer=None,
                                           on_unsupported="error", check_ids=False)
    monkeypatch.setattr(mt, "_ENVIRONMENT", {"backend": "torch", "backward_mode": "saved"})
    assert mt.options(first).backend == "torch"
    mt.configure(backend="reference")
    assert (mt.options(first).backend, mt.options(first).backward_mode) == ("reference", "saved")
    mt.configure(model, backend="fused")
    mt.configure(model, on_unsupported="fallback")  # keeps the backend set before
    assert (mt.options(second).backend, mt.options(second).on_unsupported) == ("fused", "fallback")
    assert mt.options(copy.deepcopy(model).model.layers[1].mlp.experts) == mt.options(second)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mt.options(first).backend = "torch"
    mt.reset(model)
    assert mt.options(first).backend == "reference"
    mt.reset()
    assert mt.options(first).backend == "torch"


def test_ids_go_unchecked_unless_asked(monkeypatch):
    """The router's ids are not range-checked per call (a host sync per layer) unless
    configure(check_ids=True) asks for it; then an out-of-range id is an error naming it."""
    model = _model(config=_qwen3_config(num_hidden_layers=1))
    experts = _experts(model)[0]
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["check_ids"])
        return megamoe.moe(*args, **kwargs)

    monkeypatch.setattr(mt, "moe", spy)
    hidden = torch.randn(5, experts.gate_up_proj.shape[2])
    ids, weights = _routing(5, experts.gate_up_proj.shape[0], 2, seed=3)
    mt.experts_forward(experts, hidden, ids, weights)
    assert seen == [False]
    mt.configure(model, check_ids=True)
    bad = ids.clone()
    bad[4, 1] = experts.gate_up_proj.shape[0] + 3
    with pytest.raises(MegaMoEError, match=r"topk_ids: expected ids in \[-1, 8\).*token 4, slot 1"):
        mt.experts_forward(experts, hidden, bad, weights)
    assert seen == [False, True]


# -- GPU -------------------------------------------------------------------------------------

# One MoE layer: its router sees the same input under every implementation. A second
# layer's router would see the first one's bf16 rounding and flip near-tied top-k choices,
# which moves the gradients far beyond bf16 noise between two bf16 implementations.
# transformers' default init scale.
GPU_SHAPES = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=1, max_position_embeddings=256,
                  initializer_range=0.02)
BF16_TOL = 2e-2


def _gpu_model(seed=20, dtype=torch.bfloat16):
    config = _qwen3_config(**GPU_SHAPES)
    return _model(seed=seed, dtype=dtype, config=config, device="cuda")


def _bf16_errors(loss, grads, ref_loss, ref_grads):
    errors = {"loss": rel_err(loss, ref_loss)}
    errors.update({n: rel_err(grads[n], ref_grads[n]) for n in ref_grads})
    worst = max(errors, key=errors.get)
    print(f"worst relative error: {worst} {errors[worst]:.2e}")
    return errors


def _assert_close(loss, grads, ref_loss, ref_grads, tol=BF16_TOL):
    assert grads.keys() == ref_grads.keys()
    errors = _bf16_errors(loss, grads, ref_loss, ref_grads)
    bad = {n: e for n, e in errors.items() if not e < tol}
    assert not bad, bad


def _gpu_against_grouped_mm(seed, backend, backward_mode, setup=None, steps=1,
                            setup_reference=False):
    """A bf16 model's loss and gradients through "megamoe" against "grouped_mm"; `setup`
    prepares the model after the reference ran (before it, with setup_reference) and
    returns the forward to use (or None)."""
    model = _gpu_model(seed=seed)
    tokens = _tokens(seed=seed, batch=4, length=128, device="cuda")
    forward = setup(model) if setup is not None and setup_reference else None
    ref = _loss_and_grads(model, "grouped_mm", tokens, forward=forward)
    if setup is not None and not setup_reference:
        forward = setup(model)
    mt.configure(model, backend=backend, backward_mode=backward_mode)
    for _ in range(steps):
        got = _loss_and_grads(model, "megamoe", tokens, forward=forward)
    _assert_close(*got, *ref)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend,backward_mode", [("fused", "recompute"), ("fused", "saved"),
                                                   ("auto", "recompute"), ("torch", "recompute")])
def test_gpu_bf16_matches_grouped_mm(backend, backward_mode, moe_calls):
    _gpu_against_grouped_mm(20, backend, backward_mode)
    assert moe_calls == ["torch" if backend == "torch" else "fused"]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backward_mode", ["recompute", "saved"])
def test_gpu_compiled_model(backward_mode):
    # Against the compiled grouped_mm: inductor fuses the dense layers' bf16 elementwise
    # work and skips some of eager's intermediate roundings, which moves their gradients by
    # ~3% in bf16 on its own. Two steps: the second runs the compiled code without tracing.
    _gpu_against_grouped_mm(21, "fused", backward_mode, setup=torch.compile, steps=2,
                            setup_reference=True)


def _checkpointed(model):
    model.train()
    model.gradient_checkpointing_enable()
    return None


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backward_mode", ["recompute", "saved"])
def test_gpu_gradient_checkpointing(backward_mode):
    _gpu_against_grouped_mm(22, "fused", backward_mode, setup=_checkpointed)


@needs_cuda
@pytest.mark.gpu
def test_gpu_autocast_over_float32_weights(moe_calls):
    """fp32 master weights under torch.autocast(bfloat16): the fused backend computes in
    bf16 and the gradients reach the fp32 weights; compared with transformers' "eager"
    experts under the same autocast (whose F.linear calls autocast to bf16 too)."""
    model = _gpu_model(seed=23, dtype=torch.float32)
    tokens = _tokens(seed=23, batch=4, length=128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _loss_and_grads(model, "eager", tokens)
        got = _loss_and_grads(model, "megamoe", tokens)
    assert moe_calls == ["fused"]
    assert all(g.dtype == torch.float32 for g in got[1].values())
    _assert_close(*got, *ref)
    with pytest.raises(MegaMoEError, match="computes in bf16.*load the model with "
                                           "dtype=torch.bfloat16, or run it under torch.autocast"):
        _loss_and_grads(model, "megamoe", tokens)  # no autocast: fp32 weights, fused refuses


@needs_cuda
@pytest.mark.gpu
def test_gpu_fused_limits_fall_back():
    """H = 64 is no multiple of 128: "fused" refuses it; the fallback is grouped_mm's result."""
    model = _model(seed=24, dtype=torch.bfloat16, device="cuda",
                   config=_qwen3_config(num_hidden_layers=1))
    tokens = _tokens(seed=24, device="cuda")
    model.set_experts_implementation("megamoe")
    with pytest.raises(MegaMoEError, match="backend='fused' needs H and I to be multiples of 128"):
        model(input_ids=tokens, use_cache=False)
    ref = _loss_and_grads(model, "grouped_mm", tokens)
    mt.configure(model, on_unsupported="fallback")
    with pytest.warns(mt.MegaMoEFallbackWarning, match="multiples of 128"):
        got = _loss_and_grads(model, "megamoe", tokens)
    _assert_close(*got, *ref, tol=1e-3)  # the same implementation (up to CUDA atomics)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_gpu_strided_inputs_into_experts(backend):
    """Strided hidden_states, ids and bf16 router weights through the experts module."""
    model = _gpu_model(seed=25)
    experts = _experts(model)[0]
    N, H = 300, 256
    g = torch.Generator(device="cuda").manual_seed(BASE_SEED + 25)
    hidden = torch.randn(H, N, device="cuda", generator=g).to(torch.bfloat16).t()
    ids, weights = _routing(N, 8, 2, seed=25, dtype=torch.bfloat16)
    ids, weights = ids.cuda().t().contiguous().t(), weights.cuda().t().contiguous().t()
    dy = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    mt.configure(model, backend=backend)
    out, grads = _experts_call(mt.experts_forward, experts, hidden, ids, weights, dy)
    ref, ref_grads = _experts_call(grouped_mm_experts_forward, experts, hidden.contiguous(),
                                   ids.contiguous(), weights.contiguous(), dy)
    assert rel_err(out, ref) < BF16_TOL
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two or more CUDA GPUs")
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_gpu_expert_parallel_two_gpus(backend):
    _run_hf_ep_check("--backend", backend)
