"""Built-in transformers model configs (model.preset).

"qwen3-30b-a3b" is the geometry of the released Qwen3-30B-A3B (48 layers there; the trainer's
configs set fewer with model.num_layers); "tiny" is a two-layer model of the same family that
trains in seconds on a CPU.
"""

from __future__ import annotations

# What the Qwen3-MoE presets share: every layer sparse, normalised top-k weights, untied
# embeddings, transformers' default load-balancing coefficient.
_QWEN3_MOE = dict(model_type="qwen3_moe", norm_topk_prob=True, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                  mlp_only_layers=[], attention_bias=False)

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0),
    "tiny": dict(
        _QWEN3_MOE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=4096,
        rope_theta=10_000.0),
}


def make_config(name: str):
    """The transformers config object of preset `name`."""
    from transformers import AutoConfig

    settings = dict(PRESETS[name])
    settings["mlp_only_layers"] = list(settings["mlp_only_layers"])  # not shared between configs
    model_type = settings.pop("model_type")
    rope_theta = settings.pop("rope_theta")
    config = AutoConfig.for_model(model_type, **settings)
    _set_rope_theta(config, rope_theta)
    return config


def _set_rope_theta(config, theta: float) -> None:
    # transformers 5 keeps RoPE settings in config.rope_parameters; older versions in
    # config.rope_theta.
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict):
        parameters["rope_theta"] = theta
    else:
        config.rope_theta = theta
