"""The shipped THOR-MoE configs: every configs/thor-*.yaml loads, routes by thor and is counted
by `moe-train params`; the 003 settings of the Transformer-Base configs are what seed 003 (and
the seed notes' open decisions) say."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_train.config import load_config
from moe_train.eval.params import count_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
THOR_CONFIGS = sorted(CONFIGS.glob("thor-*.yaml"))


def test_there_are_thor_configs() -> None:
    names = {p.name for p in THOR_CONFIGS}
    assert {"thor-base-multilingual.yaml", "thor-base-multilingual-top2.yaml",
            "thor-base-multidomain.yaml", "thor-synthetic-cpu.yaml",
            "thor-opus-de-en-cpu.yaml"} <= names


@pytest.mark.parametrize("path", THOR_CONFIGS, ids=lambda p: p.name)
def test_thor_config_loads_and_is_counted(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.uses_thor
    assert cfg.moe.encoder_router == cfg.moe.decoder_router == "thor"
    assert cfg.thor.num_tasks > 0  # `params` cannot read K from data
    report = count_parameters(cfg, cfg.data.vocab_size)
    assert report["thor_num_tasks"] == cfg.thor.num_tasks
    assert report["thor_predictor"] == 2 * cfg.thor.num_tasks * cfg.model.d_model
    assert report["encoder_moe_layers"] == report["decoder_moe_layers"] > 0
    bound = cfg.thor.num_candidates if cfg.thor.candidate_sets else cfg.moe.num_experts
    expected = cfg.moe.k if cfg.thor.token_routing == "topk" else bound
    assert report["encoder_experts_per_token"] == expected


def test_multilingual_base_is_003_table_2() -> None:
    cfg = load_config(CONFIGS / "thor-base-multilingual.yaml")
    m, moe, thor = cfg.model, cfg.moe, cfg.thor
    assert (m.encoder_layers, m.decoder_layers, m.d_model, m.ffn_dim, m.n_heads) == \
        (6, 6, 512, 2048, 8)
    assert moe.num_experts == 32
    assert [i for i in range(6) if moe.is_moe_layer("encoder", i, 6)] == [1, 3, 5]  # OD-5
    assert [i for i in range(6) if moe.is_moe_layer("decoder", i, 6)] == [1, 3, 5]
    assert cfg.data.temperature == 1.5 and cfg.data.lang_tags
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.max_steps) == (5e-4, 4000, 35000)
    assert (thor.token_routing, moe.top_p, thor.num_candidates) == ("topp", 0.5, 8)  # OD-11/3
    assert (thor.alpha, thor.beta, thor.gamma, thor.delta) == (1e-2, 5e-2, 5e-2, 1e-4)
    assert (thor.task_repr, thor.hierarchy, thor.context, thor.context_gate) == \
        ("mixed", True, True, "vector")
    assert (thor.task_source, thor.pivot_lang, thor.num_tasks) == ("other_lang", "en", 17)  # OD-2
    top2 = load_config(CONFIGS / "thor-base-multilingual-top2.yaml")
    assert (top2.thor.token_routing, top2.moe.k) == ("topk", 2)
    assert top2.to_dict() | {"thor": None, "moe": None} == cfg.to_dict() | {"thor": None,
                                                                              "moe": None}


def test_multidomain_base_uses_003_multidomain_coefficients() -> None:
    cfg = load_config(CONFIGS / "thor-base-multidomain.yaml")
    thor = cfg.thor
    assert (thor.task_source, thor.num_tasks) == ("domain", 5)
    assert (thor.alpha, thor.beta, thor.gamma, thor.delta) == (1e-2, 1e-2, 1e-2, 1e-4)
    assert cfg.data.pairs == ["de-en"] and not cfg.data.lang_tags
    assert (cfg.model.d_model, cfg.moe.num_experts, thor.num_candidates) == (512, 32, 8)
    top2 = load_config(CONFIGS / "thor-base-multidomain-top2.yaml")
    assert (top2.thor.token_routing, top2.moe.k, top2.thor.task_source) == ("topk", 2, "domain")


@pytest.mark.parametrize("name, tasks", [("thor-synthetic-cpu.yaml", 5),
                                         ("thor-opus-de-en-cpu.yaml", 7)])
def test_cpu_configs(name: str, tasks: int) -> None:
    cfg = load_config(CONFIGS / name)
    assert (cfg.thor.task_source, cfg.thor.num_tasks) == ("domain", tasks)
    assert (cfg.moe.num_experts, cfg.thor.num_candidates, cfg.moe.top_p) == (8, 4, 0.5)
    assert (cfg.thor.alpha, cfg.thor.beta, cfg.thor.gamma, cfg.thor.delta) == \
        (1e-2, 1e-2, 1e-2, 1e-4)
    assert cfg.optim.zero_stage == 0 and cfg.optim.precision == "fp32"


def test_candidate_sets_and_k_are_checked_against_each_sides_own_experts() -> None:
    """A side with fewer experts (moe.decoder_num_experts) would cap |S^t| at all of them,
    silently switching the task-guided restriction off there: refused, naming the side."""
    from moe_train.errors import ConfigError

    path = CONFIGS / "thor-synthetic-cpu.yaml"  # 8 experts, |S^t| = 4
    load_config(path, ["moe.decoder_num_experts=4"])  # |S^t| = 4 of 4 is the user's choice
    with pytest.raises(ConfigError, match=r"thor.num_candidates: expected at most the "
                                          r"decoder's experts \(3\), got 4$"):
        load_config(path, ["moe.decoder_num_experts=3"])
    with pytest.raises(ConfigError, match=r"thor.num_candidates: expected at most the "
                                          r"encoder's experts \(8\), got 9$"):
        load_config(path, ["thor.num_candidates=9"])
    with pytest.raises(ConfigError, match=r"moe.k: expected at most 2 \(the experts THOR's "
                                          r"token router chooses from on the decoder side\)"):
        load_config(path, ["moe.decoder_num_experts=2", "thor.hierarchy=false",
                           "thor.token_routing=topk", "moe.k=3", "moe.encoder_num_experts=4"])
