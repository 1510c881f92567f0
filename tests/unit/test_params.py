"""Parameter counting: seed 002's Table 1 / Sec. 4.3 figures from the configs, and exact counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_train.config import load_config
from moe_train.models import build as build_mod
from moe_train.eval.params import count_parameters, format_params, human
from moe_train.models.build import build_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
M, B = 10**6, 10**9

# Seed 002, Table 1 ("Effective No. of Parameters": Train All, Serving All, Serving Dec.), in
# millions. The hybrid rows leave Train All blank: all 32-expert models have the same size
# ("identical network size (32 experts, 533M parameters)", Sec. 4.2).
TABLE1_32_EXPERTS = {
    "moe32-base-token.yaml": (533, 533, 221),           # Token / Token
    "moe32-base-sentence.yaml": (533, 533, 221),        # Sentence / Sentence
    "moe32-base-task.yaml": (533, 155, 32),             # Language Pair / Language Pair
    "moe32-base-target.yaml": (533, 155, 32),           # Target / Target
    "moe32-base-langpair-token.yaml": (533, 338, 221),  # Language Pair / Token
    "moe32-base-target-token.yaml": (533, 338, 221),    # Target / Token
    "moe32-base-token-langpair.yaml": (533, 338, 32),   # Token / Language Pair
    "moe32-base-token-target.yaml": (533, 338, 32),     # Token / Target
}
# Table 1, dense rows: Multilingual Transformer-Base and Transformer-Big (millions).
TABLE1_BASE_DENSE = (142, 142, 25)
TABLE1_BIG_DENSE = (473, 473, 151)
# Sec. 4.3.2 / 4.3.3: 128-expert Transformer-Big, 13B parameters, 6.5B in the decoder, and the
# task-routed decoder serves 201M ("32.34 times less decoder parameters (201M vs 6.5B)").
BIG_TOTAL, BIG_DECODER, BIG_SERVING_DECODER = 13 * B, 6.5 * B, 201 * M


def _report(name: str, overrides: list[str] | None = None) -> dict:
    cfg = load_config(CONFIGS / name, overrides)
    return count_parameters(cfg, cfg.data.vocab_size)


def _close(ours: float, paper: float, rel: float = 0.02) -> bool:
    return abs(ours - paper) <= rel * paper


@pytest.mark.parametrize("name", sorted(TABLE1_32_EXPERTS))
def test_table1_32_expert_rows(name: str) -> None:
    train_all, serving_all, serving_dec = TABLE1_32_EXPERTS[name]
    report = _report(name)
    got = (report["total"] / M, report["serving_all"] / M, report["serving_decoder"] / M)
    assert _close(got[0], train_all) and _close(got[1], serving_all) \
        and _close(got[2], serving_dec), f"{name}: ours {got}, paper {TABLE1_32_EXPERTS[name]}"
    assert report["vocab_size"] == 64000
    assert report["encoder_moe_layers"] == report["decoder_moe_layers"] == 3


def test_table1_dense_baselines() -> None:
    """The MoE configs without experts are the paper's 142M Base and 473M Big (FFN 8192)."""
    for name, paper, extra in (("moe32-base-token.yaml", TABLE1_BASE_DENSE, []),
                               ("moe128-big.yaml", TABLE1_BIG_DENSE,
                                ["model.tie_embeddings=false"])):  # Table 1's Big is untied
        report = _report(name, ["moe.num_experts=0", *extra])
        got = (report["total"] / M, report["serving_all"] / M, report["serving_decoder"] / M)
        assert all(_close(g, p) for g, p in zip(got, paper)), f"{name}: {got} vs {paper}"
        assert report["encoder_router"] == report["decoder_router"] == "dense"


def test_128_expert_big() -> None:
    report = _report("moe128-big.yaml")
    # Sec. 4.3 ties the softmax and the input/output embeddings: 13.13B (+1.0% over "13B").
    assert _close(report["total"], BIG_TOTAL)
    assert report["embeddings"] == 64000 * 1024
    assert _close(report["decoder"], BIG_DECODER)
    assert _close(report["serving_decoder"], BIG_SERVING_DECODER)
    assert (report["encoder_router"], report["decoder_router"]) == ("gshard", "task")
    assert report["encoder_num_experts"] == report["decoder_num_experts"] == 128
    # Token-routed encoder: all experts are served; only the decoder shrinks.
    assert report["serving_encoder"] == report["encoder"]


def test_counting_uses_the_meta_device(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []

    def spy(cfg, manifest):
        model = build_model(cfg, manifest)
        built.append(model)
        return model

    monkeypatch.setattr(build_mod, "build_model", spy)
    _report("moe128-big.yaml")  # a real 13B build would not fit this machine's memory
    assert len(built) == 1 and all(p.device.type == "meta" for p in built[0].parameters())


def _small_cfg(extra: list[str]):
    base = ["model.d_model=8", "model.n_heads=2", "model.ffn_dim=16", "model.encoder_layers=2",
            "model.decoder_layers=2", "model.max_positions=32"]
    return load_config(None, base + extra)


@pytest.mark.parametrize("tie", [True, False])
def test_dense_counts_equal_a_real_model(tie: bool) -> None:
    cfg = _small_cfg([f"model.tie_embeddings={str(tie).lower()}"])
    report = count_parameters(cfg, 10)
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": 10, "pad_id": 0})
    numel = lambda *mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    assert report["total"] == sum(p.numel() for p in model.parameters())
    assert report["encoder"] == numel(model.encoder_layers, model.encoder_norm)
    assert report["decoder"] == numel(model.decoder_layers, model.decoder_norm)
    assert report["embeddings"] == (1 if tie else 3) * 10 * 8
    assert report["serving_all"] == report["active_all"] == report["total"]
    assert report["serving_decoder"] == report["decoder"]
    assert report["encoder_experts"] == report["decoder_experts"] == 0


def test_small_moe_hand_computed() -> None:
    """D=8, F=16, E=4, k=2, 2+2 layers; layer 1 of each side is MoE; V=10, tied embeddings.

    Encoder MoE layer: token top-2 router (D x E gate). Decoder MoE layer: learned task router
    over 3 tasks (3 x D task embedding + D x E gate).
    """
    cfg = _small_cfg(["moe.num_experts=4", "moe.k=2", "moe.encoder_router=topk",
                      "moe.decoder_router=task", "moe.num_tasks=3"])
    report = count_parameters(cfg, 10)
    D, F, E = 8, 16, 4
    attn = 4 * (D * D + D)            # q, k, v, out with biases: 288
    ffn = D * F + F + F * D + D       # one dense FFN or one expert: 280
    norm = 2 * D                      # 16
    topk_router, task_router = D * E, 3 * D + D * E  # 32, 56
    enc = (attn + ffn + 2 * norm) + (attn + E * ffn + topk_router + 2 * norm) + norm
    dec = (2 * attn + ffn + 3 * norm) + (2 * attn + E * ffn + task_router + 3 * norm) + norm
    assert (enc, dec) == (2088, 2720)
    assert report["embeddings"] == 80
    assert report["encoder"] == enc and report["decoder"] == dec
    assert report["total"] == 80 + enc + dec == 4888
    assert report["encoder_experts"] == report["decoder_experts"] == E * ffn
    assert (report["encoder_routers"], report["decoder_routers"]) == (32, 56)
    # Serving: the token-routed encoder keeps all 4 experts and its router; the task-routed
    # decoder keeps its k=2 experts and drops the other 2 and the (now constant) task router.
    assert report["serving_encoder"] == enc
    assert report["serving_decoder"] == dec - 2 * ffn - task_router == 2104
    assert report["serving_all"] == 80 + 2088 + 2104
    # Per token: k=2 experts per MoE layer on both sides, routers included.
    assert report["active_encoder"] == enc - 2 * ffn == 1528
    assert report["active_decoder"] == dec - 2 * ffn == 2160
    assert report["active_all"] == 80 + 1528 + 2160
    # The meta-device count is the real model's count.
    model = build_model(cfg, {"vocab_size": 10, "pad_id": 0})
    assert report["total"] == sum(p.numel() for p in model.parameters())


def test_format_and_json() -> None:
    assert [human(n) for n in (999, 49_152, 533_089_280, 13_266_045_952)] == \
        ["999", "49.2K", "533.1M", "13.27B"]
    report = _report("moe32-base-token-target.yaml")
    text = format_params(report)
    assert "encoder: 3 MoE layers x 32 experts, router gshard" in text
    assert "decoder: 3 MoE layers x 32 experts, router task" in text
    line = next(l for l in text.splitlines() if l.startswith("  serving decoder"))  # noqa: E741
    assert line.split()[-2:] == [human(report["serving_decoder"]),
                                 f"{report['serving_decoder']:,}"]
    assert json.loads(json.dumps(report)) == report
    # a decoder-only model has no encoder, not a dense one: no encoder rows
    tiny = load_config(CONFIGS / "qwen-moe-tiny-cpu.yaml")
    qwen = format_params(count_parameters(tiny, tiny.qwen.vocab_size))
    assert qwen.splitlines()[0] == "encoder: none (decoder-only model)"
    assert not [line for line in qwen.splitlines()[1:] if "encoder" in line]
    assert "encoder: dense" in format_params(_report("debug-cpu.yaml"))


# ------------------------------------------------------------------------------------ THOR-MoE
# Transformer-Base (D 512, FFN 2048, 6+6 layers, tied 32k vocabulary) with 32 experts in layers
# 1, 3, 5 of each side, every MoE layer routed by thor (configs/thor-base-multilingual.yaml).
D_BASE, F_BASE, E_BASE, V_BASE, MOE_LAYERS = 512, 2048, 32, 32000, 6
EXPERT_BASE = 2 * D_BASE * F_BASE + F_BASE + D_BASE          # one expert FFN: 2,099,712
CONTEXT_GATE_BASE = 2 * D_BASE * D_BASE + D_BASE             # W^g 2D x D + b^g: 524,800
ROUTER_BASE = 2 * E_BASE * D_BASE + CONTEXT_GATE_BASE        # token + task gate + context gate
# The dense Transformer-Base of the same config: tied embeddings, encoder layers (attention,
# FFN, 2 norms) + final norm, decoder layers (2 attentions, FFN, 3 norms) + final norm.
ATTN_BASE = 4 * (D_BASE * D_BASE + D_BASE)
DENSE_BASE = (V_BASE * D_BASE + 6 * (ATTN_BASE + EXPERT_BASE + 4 * D_BASE) + 2 * D_BASE
              + 6 * (2 * ATTN_BASE + EXPERT_BASE + 6 * D_BASE) + 2 * D_BASE)


def test_thor_base_multilingual_hand_computed() -> None:
    assert CONTEXT_GATE_BASE == 524_800  # seed notes OD-6: "0.52M per MoE layer"
    assert DENSE_BASE == 60_524_544
    assert _report("thor-base-multilingual.yaml", ["moe.num_experts=0"])["total"] == DENSE_BASE
    report = _report("thor-base-multilingual.yaml")
    K = 17  # the non-English language of the pair: 17 language ids (task_source other_lang)
    predictor, cls = 2 * K * D_BASE, D_BASE  # W^p K x D and EMB1 K x D; the [CLS] vector
    assert (report["thor_num_tasks"], report["thor_predictor"], report["thor_cls"]) == \
        (K, 17_408, 512)
    assert report["thor_context_gates"] == MOE_LAYERS * CONTEXT_GATE_BASE == 3_148_800
    assert report["thor_task_gates"] == report["thor_token_gates"] == MOE_LAYERS * 32 * 512
    assert report["encoder_routers"] == report["decoder_routers"] == 3 * ROUTER_BASE \
        == 1_672_704
    assert report["other"] == predictor + cls
    total = DENSE_BASE + MOE_LAYERS * ((E_BASE - 1) * EXPERT_BASE + ROUTER_BASE) \
        + predictor + cls
    assert report["total"] == total == 454_434_304
    # Every expert may be any sentence's candidate: nothing can be left out when serving.
    assert report["serving_all"] == report["total"]
    # Top-p inside |S^t| = 8: data-dependent, counted at its bound (8 of the 32 experts).
    assert report["encoder_experts_per_token"] == report["decoder_experts_per_token"] == 8
    assert not report["encoder_experts_per_token_exact"]
    assert report["active_all"] == total - MOE_LAYERS * (E_BASE - 8) * EXPERT_BASE
    top2 = _report("thor-base-multilingual-top2.yaml")
    assert top2["total"] == total and top2["decoder_experts_per_token_exact"]
    assert top2["active_all"] == total - MOE_LAYERS * (E_BASE - 2) * EXPERT_BASE == 76_486_144
    # The multi-domain variant differs only in K = 5 domains.
    domain = _report("thor-base-multidomain.yaml")
    assert domain["thor_predictor"] == 2 * 5 * D_BASE
    assert domain["total"] == total - predictor + 2 * 5 * D_BASE


@pytest.mark.parametrize("gate, hierarchy, routing", [
    ("vector", True, "topp"), ("scalar", True, "topk"), ("vector", False, "topk"),
    ("scalar", False, "topp")])
def test_small_thor_hand_computed(gate: str, hierarchy: bool, routing: str) -> None:
    """D=8, F=16, E=4, 2+2 layers (layer 1 of each side routed by thor), K=3 tasks, |S^t|=2,
    V=10 tied; the meta-device count is the real model's."""
    cfg = _small_cfg(["moe.num_experts=4", "moe.k=1", "moe.encoder_router=thor",
                      "moe.decoder_router=thor", "thor.num_tasks=3", "thor.num_candidates=2",
                      f"thor.context_gate={gate}", f"thor.hierarchy={str(hierarchy).lower()}",
                      f"thor.token_routing={routing}"])
    report = count_parameters(cfg, 10)
    D, F, E, K = 8, 16, 4, 3
    expert = D * F + F + F * D + D                                  # 280
    context = 2 * D * D + D if gate == "vector" else 2 * D + 1      # 136 or 17
    task_gate = E * D if hierarchy else 0                           # no candidate sets: none
    router = E * D + task_gate + context
    assert report["encoder_routers"] == report["decoder_routers"] == router
    assert report["thor_context_gates"] == 2 * context
    assert report["thor_task_gates"] == 2 * task_gate
    assert report["thor_predictor"] == 2 * K * D and report["thor_cls"] == D
    attn, norm = 4 * (D * D + D), 2 * D
    enc = (attn + expert + 2 * norm) + (attn + E * expert + router + 2 * norm) + norm
    dec = (2 * attn + expert + 3 * norm) + (2 * attn + E * expert + router + 3 * norm) + norm
    assert report["total"] == 10 * D + enc + dec + 2 * K * D + D
    model = build_model(cfg, {"vocab_size": 10, "pad_id": 0})
    assert report["total"] == sum(p.numel() for p in model.parameters())
    # Experts a token uses: k=1 inside the set (top-k), or the set / all E (top-p bound).
    space = 2 if hierarchy else E
    per_token = 1 if routing == "topk" else space
    assert report["encoder_experts_per_token"] == per_token
    assert report["encoder_experts_per_token_exact"] == (routing == "topk")
    assert report["active_encoder"] == enc - (E - per_token) * expert


def test_thor_table_says_top_p_is_a_bound() -> None:
    text = format_params(_report("thor-base-multilingual.yaml"))
    assert "encoder: 3 MoE layers x 32 experts, router thor: top-p p=0.5 inside |S^t|=8 of " \
           "32, experts per token data-dependent (at most 8" in text
    assert "active per token (upper bound)" in text
    assert "THOR task predictor (W^p, EMB1)" in text
    text = format_params(_report("thor-base-multilingual-top2.yaml"))
    assert "top-2 inside |S^t|=8 of 32, 2 experts per token" in text
    assert "(upper bound)" not in text


def test_thor_without_num_tasks_is_a_config_error() -> None:
    from moe_train.errors import ConfigError

    with pytest.raises(ConfigError, match="thor.num_tasks: 0 takes K from the prepared data"):
        _report("thor-synthetic-cpu.yaml", ["thor.num_tasks=0"])


def test_moa_gumbel_adapters_use_one_adapter_per_sentence() -> None:
    """MoA's Gumbel-Max router draws one adapter among its k best: one per token, not k."""
    report = _report("moa-synthetic.yaml", ["adapters.num_experts=5"])
    assert (report["encoder_router"], report["decoder_router"]) == ("dense", "gumbel")
    assert report["decoder_experts_per_token"] == 1 and report["decoder_experts_per_token_exact"]
    per_adapter = report["decoder_experts"] // (2 * 5)
    assert report["active_decoder"] == report["decoder"] - 2 * 4 * per_adapter
    assert "router gumbel: 1 of the top-4 (Gumbel-Max), 1 expert per token" in \
        format_params(report)


def test_a_side_with_ffn_experts_and_adapters_lists_both() -> None:
    """Top-2 FFN experts beside soft-gated adapters on each side: the summary line gave the
    FFN layers' count and the adapters' 4 experts per token, as if one kind of layer."""
    report = _report("gad-synthetic.yaml", ["moe.num_experts=8", "moe.k=2", "moe.layers=all",
                                            "moe.encoder_router=topk", "moe.decoder_router=topk"])
    assert report["decoder_layer_groups"] == [
        {"kind": "MoE", "layers": 2, "num_experts": 8, "routing": "top-2",
         "experts_per_token": 2, "exact": True},
        {"kind": "adapter", "layers": 2, "num_experts": 4, "routing": "all 4 (soft gate)",
         "experts_per_token": 4, "exact": True}]
    assert "decoder: 2 MoE layers x 8 experts, top-2, 2 per token; 2 adapter layers x 4 " \
        "experts, all 4 (soft gate), 4 per token" in format_params(report)
    assert json.loads(json.dumps(report)) == report
