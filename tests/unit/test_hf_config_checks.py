"""A Hugging Face config.json is read as transformers reads it, and what our Qwen2-MoE cannot
compute (wrong types, scaled RoPE, sliding windows, another head size) is one line naming the
file and the key, never a traceback or a model that computes another function."""

from __future__ import annotations

import pytest

from moe_train.errors import ConfigError
from moe_train.models.hf_config import config_from_hf

HF = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 32, "moe_intermediate_size": 8,
      "shared_expert_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
      "max_position_embeddings": 32}


@pytest.mark.parametrize("key, value, needle", [
    ("num_hidden_layers", "two", "num_hidden_layers is 'two'; expected a non-negative integer"),
    ("decoder_sparse_step", "x", "decoder_sparse_step is 'x'"),
    ("mlp_only_layers", 5, "mlp_only_layers is 5; expected a list of layer indices"),
    ("mlp_only_layers", "x", "mlp_only_layers is 'x'"),
    ("rope_parameters", [1], "rope_parameters is [1]; expected an object"),
    ("rope_parameters", {"rope_theta": "x"}, "rope_theta is 'x'; expected a number"),
    ("num_experts_per_tok", 9, "num_experts_per_tok is 9; expected at most num_experts (4)"),
    # converted, these would compute another function than transformers' model
    ("rope_parameters", {"rope_type": "linear", "factor": 4.0}, "scaled RoPE is not supported"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "scaled RoPE is not supported"),
    ("use_sliding_window", True, "sliding-window attention"),
    ("rope_scaling", "linear", "rope_scaling is 'linear'; expected an object or null"),
    ("layer_types", 3, "layer_types is 3; expected a list of attention kinds"),
    ("hidden_act", "gelu", "hidden_act is 'gelu'; expected 'silu'"),
    ("head_dim", 4, "head_dim is 4; expected hidden_size // num_attention_heads (8)"),
    ("attention_dropout", 0.1, "attention_dropout is 0.1; expected 0.0"),
    ("router_aux_loss_coef", "0.001", "router_aux_loss_coef is '0.001'; expected a "
                                      "non-negative number"),
    ("router_aux_loss_coef", -1.0, "router_aux_loss_coef is -1.0"),
])
def test_hf_config_types_name_the_file_and_key(tmp_path, key, value, needle) -> None:
    source = tmp_path / "config.json"
    assert config_from_hf(HF, source).moe.num_experts == 4
    with pytest.raises(ConfigError) as err:
        config_from_hf({**HF, key: value}, source)
    assert str(err.value).startswith(f"{source}: ") and needle in str(err.value)
    assert "\n" not in str(err.value)


def test_hf_rope_theta_and_aux_coefficient_read_as_transformers_reads_them(tmp_path) -> None:
    """transformers 5 takes rope_scaling, when set, as the rope parameters (its rope_theta
    included); a null router_aux_loss_coef is its default 0.001; head_dim equal to the
    default head size is accepted."""
    source = tmp_path / "config.json"
    scaled = {**HF, "rope_scaling": {"rope_type": "default", "rope_theta": 500000.0},
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
    assert config_from_hf(scaled, source).qwen.rope_theta == 500000.0
    assert config_from_hf({**HF, "rope_theta": 7.0}, source).qwen.rope_theta == 7.0
    default = config_from_hf(HF, source).moe.aux_loss_coef
    assert config_from_hf({**HF, "router_aux_loss_coef": None}, source).moe.aux_loss_coef == default
    assert config_from_hf({**HF, "head_dim": 8, "attention_dropout": 0.0}, source)


def test_hf_head_counts_default_as_transformers_does(tmp_path) -> None:
    """No num_key_value_heads: the attention heads' count; neither: Qwen2-MoE's default 16."""
    source = tmp_path / "config.json"
    no_kv = {k: v for k, v in HF.items() if k != "num_key_value_heads"}
    assert config_from_hf({**no_kv, "num_attention_heads": 4}, source).qwen.num_key_value_heads == 4
    neither = {k: v for k, v in no_kv.items() if k != "num_attention_heads"}
    qwen = config_from_hf(neither, source).qwen
    assert qwen.num_attention_heads == qwen.num_key_value_heads == 16
    # no max_position_embeddings: transformers' 32768, not our Qwen1.5-MoE default (8192)
    no_positions = {k: v for k, v in HF.items() if k != "max_position_embeddings"}
    assert config_from_hf(no_positions, source).qwen.max_position_embeddings == 32768
    assert config_from_hf(HF, source).qwen.max_position_embeddings == 32
