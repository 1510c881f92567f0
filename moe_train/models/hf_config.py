"""Hugging Face Qwen2-MoE config.json <-> our config: the fields mapped, what is refused.

A config.json is checked before any weight is read: what our Qwen2-MoE does not implement
(scaled RoPE, sliding windows, another activation or head size, attention dropout) is a
one-line ConfigError naming the file and the key, instead of a model that converts cleanly and
computes another function than transformers' (models/hf_io.py converts the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_train.config.loader import config_from_dict
from moe_train.config.moe import MAX_LAYERS
from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError, MoeTrainError

HF_MAX_POSITIONS = 32768
"""transformers' Qwen2MoeConfig default max_position_embeddings (ours, Qwen1.5-MoE's, is 8192):
what a config.json without the key means."""


def config_from_hf(hf: dict[str, Any], source: Path) -> ExperimentConfig:
    """Our config of a Qwen2-MoE config.json (default topk router: Qwen's own routing)."""
    if hf.get("model_type") != "qwen2_moe":
        raise ConfigError(f"{source}: model_type is {hf.get('model_type')!r}; expected "
                          "'qwen2_moe' (a Hugging Face Qwen2-MoE model directory)")
    def integer(key: str, default: int) -> int:
        value = hf.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{source}: {key} is {value!r}; expected a non-negative integer")
        return value

    n = integer("num_hidden_layers", 0)
    if n > MAX_LAYERS:
        raise ConfigError(f"{source}: num_hidden_layers is {n}; expected at most {MAX_LAYERS}")
    step = integer("decoder_sparse_step", 1) or 1
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"{source}: mlp_only_layers is {dense!r}; expected a list of layer "
                          "indices")
    sparse = [i for i in range(n) if i not in set(dense) and (i + 1) % step == 0]
    if not sparse or not integer("num_experts", 0):
        raise ConfigError(f"{source}: no sparse MoE layer (num_experts "
                          f"{hf.get('num_experts')}); expected a Qwen2-MoE model")
    k = integer("num_experts_per_tok", 4)
    if k > hf["num_experts"]:
        raise ConfigError(f"{source}: num_experts_per_tok is {k}; expected at most "
                          f"num_experts ({hf['num_experts']})")
    # transformers 5 takes rope_scaling, when set, as the rope parameters (rope_theta included)
    scaling = hf.get("rope_scaling")
    rope_key = "rope_scaling" if isinstance(scaling, dict) and scaling else "rope_parameters"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: {rope_key} is {rope!r}; expected an object")
    _check_supported(hf, rope, source)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{source}: rope_theta is {theta!r}; expected a number")
    qwen = {key: hf[key] for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "shared_expert_intermediate_size", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings", "initializer_range", "qkv_bias") if key in hf}
    qwen.setdefault("max_position_embeddings", HF_MAX_POSITIONS)
    if not hf.get("num_key_value_heads"):  # as transformers: the attention heads' count
        from moe_train.config.qwen import QwenConfig

        qwen["num_key_value_heads"] = qwen.get("num_attention_heads",
                                               QwenConfig.num_attention_heads)
    else:
        qwen["num_key_value_heads"] = hf["num_key_value_heads"]
    qwen["rope_theta"] = float(theta)
    aux = hf.get("router_aux_loss_coef", 0.001)
    aux = 0.001 if aux is None else aux  # transformers' default
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not aux >= 0:
        raise ConfigError(f"{source}: router_aux_loss_coef is {aux!r}; expected a non-negative "
                          "number")
    from moe_train.models.hf_qwen2moe import aux_coef_from_hf

    moe = {"num_experts": hf["num_experts"], "k": k,
           "expert_ffn_dim": hf.get("moe_intermediate_size", 1408),
           "renormalize": bool(hf.get("norm_topk_prob", False)),
           "layers": "all" if len(sparse) == n else ",".join(map(str, sparse)),
           "encoder_router": "dense", "decoder_router": "topk",
           "aux_loss_coef": aux_coef_from_hf(aux, k, len(sparse)),
           "z_loss_coef": 0.0}
    try:
        return config_from_dict({"model": {"arch": "hf_qwen2_moe"}, "qwen": qwen, "moe": moe})
    except MoeTrainError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _check_supported(hf: dict[str, Any], rope: dict[str, Any], source: Path) -> None:
    """Refuse what our Qwen2-MoE does not implement (it would convert, then compute another
    function than transformers' model): scaled RoPE, sliding-window attention, another
    activation."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_scaling is {scaling!r}; expected an object or null")
    if not isinstance(hf.get("layer_types") or [], list):
        raise ConfigError(f"{source}: layer_types is {hf.get('layer_types')!r}; expected a "
                          "list of attention kinds")
    if rope_type != "default" or (scaling and scaling.get("rope_type",
                                                          scaling.get("type")) != "default"):
        raise ConfigError(f"{source}: rope scaling {scaling or rope!r}; expected the default "
                          "rotary embedding (scaled RoPE is not supported)")
    if hf.get("use_sliding_window") or any(t != "full_attention"
                                           for t in hf.get("layer_types") or []):
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window / "
                          "layer_types); expected full attention in every layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act is {hf.get('hidden_act')!r}; expected 'silu'")
    head_dim, hidden, heads = (hf.get(key) for key in ("head_dim", "hidden_size",
                                                       "num_attention_heads"))
    if (head_dim is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0
            and head_dim != hidden // heads):
        raise ConfigError(f"{source}: head_dim is {head_dim!r}; expected hidden_size // "
                          f"num_attention_heads ({hidden // heads}): another head size is not "
                          "supported")
    dropout = hf.get("attention_dropout") or 0.0
    if dropout != 0.0:
        raise ConfigError(f"{source}: attention_dropout is {dropout!r}; expected 0.0 (attention "
                          "dropout is not supported)")


SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
HF_SPECIAL_IDS = "hf_special_ids"
"""Manifest key of a converted model's special token ids as its config.json had them (lists
and nulls included), which `--to-hf` writes back: ours are derived for decoding (pad and bos
fall back to eos, a list of eos ids to its first) and would not round-trip."""


def hf_config_dict(cfg: ExperimentConfig, manifest: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """transformers' config.json content for our Qwen2-MoE config, with the special token ids
    of `manifest` (a trained export's tokenizer) where it has them."""
    from moe_train.models.hf_qwen2moe import qwen_hf_config

    ids = {f"{name}_token_id": manifest[f"{name}_id"] for name in ("bos", "eos", "pad")
           if manifest and isinstance(manifest.get(f"{name}_id"), int)}
    if manifest and isinstance(manifest.get(HF_SPECIAL_IDS), dict):  # converted: as they were
        ids = {**ids, **manifest[HF_SPECIAL_IDS]}
    return {**qwen_hf_config(cfg, **ids).to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}
