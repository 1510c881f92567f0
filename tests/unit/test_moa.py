"""MoA pieces: Gumbel-Max routing, the shared sentence-level decision, adapter initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.config import load_config
from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.models.build import build_model
from moe_train.models.context import SENTENCE_REPR_KEY, ForwardContext
from moe_train.moe.adapters import AdapterSlot
from moe_train.moe.moa_router import GumbelMaxRouter, SharedRouter, gumbel_max_select
from moe_train.moe.registry import build_router, build_shared_router
from moe_train.moe.routing import RoutingContext
from moe_train.stages.adapters import _init_adapters, freeze_base as _freeze
from tests.conftest import ROOT

SCORES_E = torch.tensor([2.0, -1.0, 0.5, 1.5, -3.0, 1.0])  # top-4: experts 0, 3, 5, 2


def test_gumbel_max_frequencies_match_softmax_of_top_k_over_tau() -> None:
    n, k = 40000, 4
    for tau in (0.5, 1.0, 2.0):
        gen = torch.Generator().manual_seed(int(tau * 10))
        ids = gumbel_max_select(SCORES_E.expand(n, -1), k, tau, generator=gen)
        top, idx = SCORES_E.topk(k)
        want = torch.softmax(top / tau, -1)
        freq = torch.bincount(ids, minlength=6).double() / n
        for p, e in zip(want.tolist(), idx.tolist()):
            # 4.5 standard deviations of a binomial proportion: false alarm < 1e-5 per check
            tol = 4.5 * math.sqrt(p * (1 - p) / n)
            assert abs(freq[e].item() - p) <= tol, (tau, e, freq[e].item(), p, tol)
        assert set(ids.unique().tolist()) <= set(idx.tolist())  # only top-k candidates


def test_only_top_k_candidates_are_ever_chosen() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(500, 12, generator=gen)
    ids = gumbel_max_select(scores, 3, 10.0, generator=gen)  # hot: near-uniform over the 3
    top3 = scores.topk(3, -1).indices
    assert (top3 == ids[:, None]).any(-1).all()


def test_k1_and_tau_zero_are_argmax() -> None:
    scores = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(gumbel_max_select(scores, 1, 1.0), scores.argmax(-1))
    assert torch.equal(gumbel_max_select(scores, 4, 0.0), scores.argmax(-1))
    # tau -> 0: the sampled distribution collapses onto the best candidate
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(gumbel_max_select(scores, 4, 1e-4, generator=gen), scores.argmax(-1))


def _rctx(B: int, T: int, repr_BD: torch.Tensor) -> RoutingContext:
    return RoutingContext.from_batch(B, T, sentence_repr_BD=repr_BD, side="decoder")


def test_gumbel_router_trains_by_sampling_and_infers_top1_per_sentence() -> None:
    torch.manual_seed(0)
    router = GumbelMaxRouter(8, 6, RouterConfig(k=4, tau=1.0))
    repr_BD = torch.randn(50, 8)
    router.eval()
    r = router.route(torch.randn(50 * 3, 8), _rctx(50, 3, repr_BD))
    top1 = router.gate(repr_BD).argmax(-1)
    assert torch.equal(r.expert_ids_TK.view(50, 3), top1[:, None].expand(50, 3))
    assert torch.all(r.weights_TK == 1) and not r.aux_losses
    router.train()
    ids = router.route(torch.randn(50 * 3, 8), _rctx(50, 3, repr_BD)).expert_ids_TK.view(50, 3)
    assert torch.all(ids == ids[:, :1])  # one adapter per sentence
    top4 = router.gate(repr_BD).topk(4, -1).indices
    assert (top4 == ids[:, :1]).any(-1).all()


def test_gumbel_router_on_the_decoder_needs_the_sentence_representation() -> None:
    router = GumbelMaxRouter(8, 4, RouterConfig(k=2))
    rctx = RoutingContext.from_batch(2, 3, side="decoder")
    with pytest.raises(ConfigError, match="sentence_repr_BD"):
        router.route(torch.randn(6, 8), rctx)


def test_shared_router_makes_one_decision_per_forward() -> None:
    torch.manual_seed(0)
    shared = build_shared_router("gumbel", 8, 6, RouterConfig(k=4, tau=5.0)).train()
    repr_BD = torch.randn(40, 8)
    first = shared.route(torch.randn(80, 8), _rctx(40, 2, repr_BD))
    again = shared.route(torch.randn(80, 8), _rctx(40, 2, repr_BD))  # next layer, same pass
    assert torch.equal(first.expert_ids_TK, again.expert_ids_TK)
    fresh = shared.route(torch.randn(80, 8), _rctx(40, 2, repr_BD.clone()))  # next batch
    assert not torch.equal(first.expert_ids_TK, fresh.expert_ids_TK)  # resampled (tau 5)
    # aux losses of a learned sentence gate are counted once per pass
    sl = build_shared_router("sentence", 8, 6, RouterConfig(k=1, aux_loss_coef=0.01))
    assert sl.route(torch.randn(80, 8), _rctx(40, 2, repr_BD)).aux_losses
    assert not sl.route(torch.randn(80, 8), _rctx(40, 2, repr_BD)).aux_losses
    with pytest.raises(ConfigError, match="routes tokens"):
        build_shared_router("topk", 8, 6, RouterConfig(k=2))


def _moa_cfg(*extra: str):
    return load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                              "model.encoder_layers=2", "model.decoder_layers=3",
                              "adapters.dim=4", *extra])


MANIFEST = {"vocab_size": 30, "pad_id": 0}


def test_model_routes_every_decoder_adapter_layer_with_one_sentence_decision() -> None:
    torch.manual_seed(0)
    cfg = _moa_cfg("adapters.num_experts=5", "adapters.router=gumbel", "adapters.tau=3.0")
    model = build_model(cfg, MANIFEST).train()
    slots = [layer.adapter for layer in model.decoder_layers]
    assert all(isinstance(s, AdapterSlot) for s in slots)
    assert all(s.moe.router is slots[0].moe.router for s in slots)  # one router, shared
    assert model.encoder_layers[0].adapter is None  # sides: decoder
    seen = []
    hooks = [s.moe.register_forward_hook(lambda m, a, o: seen.append(
        m.tokens_per_expert_E.clone())) for s in slots]
    src = torch.randint(1, 30, (6, 7))
    tgt = torch.randint(1, 30, (6, 5))
    model(src, tgt, ForwardContext())
    for h in hooks:
        h.remove()
    assert len(seen) == 3 and all(torch.equal(seen[0], s) for s in seen)


@pytest.mark.parametrize("extra", [
    ("moe.num_experts=4", "moe.encoder_router=dense", "moe.decoder_router=sentence", "moe.k=1"),
    ("adapters.num_experts=4", "adapters.router=gumbel", "adapters.k=4"),
    ("adapters.num_experts=4", "adapters.router=sentence", "adapters.k=1",
     "adapters.aux_loss_coef=0.01"),
], ids=["switch-sl-ffn", "gumbel-adapters", "sentence-adapters"])
def test_shared_sentence_routers_under_activation_checkpointing(extra) -> None:
    """A checkpointed layer that made the shared decision is recomputed in backward with the
    memo already there: same gradients as without checkpointing (it used to raise)."""
    grads = []
    for checkpointing in (False, True):
        cfg = _moa_cfg("model.dropout=0.0", f"model.activation_checkpointing={checkpointing}",
                       *extra)
        torch.manual_seed(0)
        model = build_model(cfg, MANIFEST).train()
        src = torch.randint(1, 30, (3, 7), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        out = model(src, src, ForwardContext())
        (out.logits_BTV.square().mean() + sum(out.aux_losses.values())).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_encoder_output_is_the_decoder_sentence_representation() -> None:
    torch.manual_seed(0)
    model = build_model(_moa_cfg(), MANIFEST).eval()
    src = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    enc = model.encode(src)
    want = torch.stack([enc.states_BSD[0, :3].mean(0), enc.states_BSD[1, :2].mean(0)])
    torch.testing.assert_close(enc.sentence_repr_BD, want)
    captured = {}

    class Probe(torch.nn.Module):
        def forward(self, x, ctx):
            captured[ctx.side] = ctx.extras[SENTENCE_REPR_KEY]
            return x * 0, {}

    model.decoder_layers[0].ffn = Probe()
    model.encoder_layers[0].ffn = Probe()
    model(src, torch.tensor([[2, 5], [2, 6]]))
    torch.testing.assert_close(captured["decoder"], model.encode(src).sentence_repr_BD)
    emb = model.embed_tokens(src) * model.embed_scale
    torch.testing.assert_close(captured["encoder"][1], emb[1, :2].mean(0))


def test_k_adapters_start_equal_to_the_pre_injected_one_and_freezing() -> None:
    torch.manual_seed(0)
    backbone = build_model(_moa_cfg("adapters.num_experts=1"), MANIFEST)
    for p in backbone.parameters():
        torch.nn.init.normal_(p)
    state = backbone.state_dict()
    cfg = _moa_cfg("adapters.num_experts=4", "adapters.router=gumbel")
    model = build_model(cfg, MANIFEST)
    assert _init_adapters(model, state, pre_inject=True) == 3
    for i, layer in enumerate(model.decoder_layers):
        for name, p in layer.adapter.moe.experts.named_parameters():
            single = state[f"decoder_layers.{i}.adapter.moe.experts.{name}"][0]
            assert all(torch.equal(p[e], single) for e in range(4))
    _freeze(model, cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapter.moe.experts." in n for n in trainable)  # gate frozen
    unf = _moa_cfg("adapters.num_experts=4", "adapters.router=sentence", "adapters.k=1",
                   "moa.unfreeze_decoder=true")
    model = build_model(unf, MANIFEST)
    _freeze(model, unf)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".adapter.moe.router." in n for n in trainable)  # learned SL gate trains
    assert any(n.startswith("decoder_layers.0.self_attn") for n in trainable)  # Unf-D
    assert {"decoder_norm.weight", "decoder_norm.bias"} <= trainable  # the whole decoder
    assert not any(n.startswith("encoder") or "embed" in n for n in trainable)  # tied: shared
    untied = _moa_cfg("adapters.num_experts=4", "adapters.router=sentence", "adapters.k=1",
                      "moa.unfreeze_decoder=true", "model.tie_embeddings=false")
    model = build_model(untied, MANIFEST)
    _freeze(model, untied)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"tgt_embed_tokens.weight", "output_proj.weight"} <= trainable
    assert not any(n.startswith("encoder") or n.startswith("embed_tokens") for n in trainable)


def test_adapter_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"adapters\.sides: expected one of decoder, both"):
        _moa_cfg("adapters.sides=encoder")
    with pytest.raises(ConfigError, match=r"adapters\.num_experts: expected 0 or 1"):
        _moa_cfg("adapters.num_experts=3")
    with pytest.raises(ConfigError, match=r"adapters\.num_experts: expected a multiple of"):
        _moa_cfg("adapters.num_experts=3", "adapters.router=gumbel", "moe.ep_size=2")
    with pytest.raises(ConfigError, match=r"moa\.clusterer: expected one of gmm, kmeans"):
        _moa_cfg("moa.clusterer=dbscan")
    with pytest.raises(ConfigError, match=r"^moe\.k: expected at most"):
        build_router("gumbel", 8, 3, RouterConfig(k=4))
    assert isinstance(build_shared_router("single", 8, 1, RouterConfig()), SharedRouter)


@pytest.mark.parametrize("overrides, message", [
    (["moe.num_experts=8", "moe.encoder_num_experts=2", "moe.k=4"],
     r"^moe\.k: expected at most moe\.encoder_num_experts \(2\), got 4$"),
    (["adapters.num_experts=4", "adapters.router=gumbel", "adapters.k=8"],
     r"^adapters\.k: expected at most adapters\.num_experts \(4\), got 8$"),
    (["adapters.num_experts=4", "adapters.router=topk"], r"^adapters\.router: 'topk' routes"),
])
def test_router_errors_name_the_section_and_side_fields(overrides, message) -> None:
    """Routers name their settings as moe.* fields; built from adapters.* or a side's own
    expert count, the error names that field (it named moe.num_experts = 8 as 2)."""
    from moe_train.eval.params import count_parameters

    with pytest.raises(ConfigError, match=message):
        count_parameters(_moa_cfg(*overrides), 30)


def test_moa_recipe_checks_the_adapter_stage_before_the_backbone(tmp_path) -> None:
    """adapters.k = 4 over moa.num_clusters = 3 adapters: refused before the first stage."""
    from types import SimpleNamespace

    from moe_train.stages.adapters import check_recipe_config

    cfg = load_config(ROOT / "configs" / "moa-synthetic.yaml", ["moa.num_clusters=3"])
    ctx = SimpleNamespace(cfg=cfg, stage_dir=lambda stage: tmp_path / stage)
    with pytest.raises(ConfigError, match=r"adapters\.k: expected at most adapters\.num_experts "
                                          r"\(3\), got 4"):
        check_recipe_config(ctx)
    check_recipe_config(SimpleNamespace(cfg=load_config(ROOT / "configs" / "moa-synthetic.yaml"),
                                        stage_dir=ctx.stage_dir))
    assert not any(tmp_path.iterdir())  # nothing made
    both = load_config(ROOT / "configs" / "moa-synthetic.yaml", ["adapters.sides=both"])
    with pytest.raises(ConfigError, match=r"adapters\.sides: the distilled MoA gate reads the "
                                          r"final encoder output"):
        check_recipe_config(SimpleNamespace(cfg=both, stage_dir=ctx.stage_dir))


def test_label_free_features_refuse_tags_and_anchors_need_dev_sentences() -> None:
    """Domain tags would hand the label-free features their labels; an anchored domain without
    dev sentences (or an empty dev split) anchors nothing (it crashed in np.stack)."""
    from types import SimpleNamespace

    import numpy as np

    from moe_train.stages.features import anchor_indices, check_label_free

    with pytest.raises(ConfigError, match=r"^data\.domain_tags: prep starts every source"):
        check_label_free({"domain_tags": True}, "prep")
    check_label_free({"domain_tags": False}, "prep")
    dev = SimpleNamespace(domain_ids=np.array([0, 0, 1, 0]), prepared_dir="prep")
    assert anchor_indices(dev, ["it", "law"], [], 2).tolist() == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"holds no med sentence to anchor"):
        anchor_indices(dev, ["it", "law", "med"], [], 2)


def test_routing_recorder_counts_each_layer_of_a_shared_router_once() -> None:
    from moe_train.eval.routing_stats import RoutingRecorder

    torch.manual_seed(0)
    model = build_model(_moa_cfg("adapters.num_experts=5", "adapters.router=gumbel"),
                        MANIFEST).eval()
    src = torch.randint(1, 30, (4, 6))
    tgt = torch.randint(1, 30, (4, 5))
    tgt[0, 3:] = 0  # two padding positions
    ctx = ForwardContext(domain_ids_B=torch.tensor([0, 1, 1, 0]), src_lang_B=torch.zeros(4),
                         tgt_lang_B=torch.ones(4))
    with RoutingRecorder(model, num_domains=2, num_langs=2) as rec:
        rec.set_batch(ctx)
        model(src, tgt, ctx)
    tables = rec.tables()
    assert len(tables) == 3
    for counts in tables.values():
        assert int(counts.expert_domain_EN.sum()) == 4 * 5 - 2
        assert torch.equal(counts.expert_domain_EN, tables[next(iter(tables))].expert_domain_EN)


def test_random_router_is_a_fixed_arbitrary_choice_per_sentence() -> None:
    from moe_train.moe.moa_router import RandomSentenceRouter

    router = build_router("random", 8, 5, RouterConfig(k=1))
    assert isinstance(router, RandomSentenceRouter) and not list(router.parameters())
    repr_BD = torch.randn(400, 8)
    r = router.route(torch.randn(400 * 2, 8), _rctx(400, 2, repr_BD))
    ids = r.expert_ids_TK.view(400, 2)
    assert torch.all(ids == ids[:, :1]) and not r.aux_losses  # one adapter per sentence
    again = router.route(torch.randn(3 * 2, 8), _rctx(3, 2, repr_BD[[7, 7, 9]])).expert_ids_TK
    assert again.view(3, 2)[:, 0].tolist() == [ids[7, 0].item()] * 2 + [ids[9, 0].item()]
    counts = torch.bincount(ids[:, 0], minlength=5)
    assert counts.min() >= 50, counts  # spread over every expert, whatever the sentence says
    router.train()  # training and inference agree
    assert torch.equal(router.route(torch.randn(800, 8), _rctx(400, 2, repr_BD)).expert_ids_TK,
                       r.expert_ids_TK)


@pytest.mark.parametrize("kind", ["adapters", "ffn"])
def test_evaluation_finds_the_sentence_router_of_adapters_and_of_ffn_experts(kind) -> None:
    """The evaluate stage scores (and swaps for random routing) the model's own sentence gate:
    the adapters' for MoA / adapter baselines, the decoder MoE FFN's for Switch-SL / SGMoE-SL
    trained as FFN-expert models; a model without one has none."""
    from types import SimpleNamespace

    from moe_train.stages.evaluate import random_routing, sentence_router_labels, \
        sentence_routers

    torch.manual_seed(0)
    if kind == "adapters":
        cfg = _moa_cfg("adapters.num_experts=4", "adapters.router=sentence", "adapters.k=1")
    else:
        cfg = _moa_cfg("moe.num_experts=4", "moe.layers=all", "moe.encoder_router=dense",
                       "moe.decoder_router=sentence", "moe.k=2")
    model = build_model(cfg, MANIFEST).eval()
    routers = sentence_routers(model)
    assert len(routers) == 1 and routers[0].name == "sentence"  # one gate for all layers
    with torch.no_grad():
        for p in routers[0].inner.gate.parameters():
            p.zero_()
        gate = routers[0].inner.gate
        weight = next(p for n, p in gate.named_parameters() if n.endswith("weight"))
        weight[2, 0] = 10.0  # expert 2 when feature 0 is positive, else another one
    x_ND = torch.zeros(6, 16)
    x_ND[:3, 0], x_ND[3:, 0] = 1.0, -1.0
    inf = SimpleNamespace(model=model, cfg=cfg)
    labels = sentence_router_labels(inf, x_ND.numpy())
    assert labels.tolist()[:3] == [2, 2, 2] and 2 not in labels.tolist()[3:]
    inner = routers[0].inner
    x_TD = torch.randn(60, 16)
    rctx = RoutingContext.from_batch(60, 1, sentence_repr_BD=x_TD, side="decoder")
    learned = inner.route(x_TD, rctx)
    with random_routing(inf) as swapped:
        assert swapped and routers[0].inner.name == "random"
        rnd = routers[0].inner.route(x_TD, rctx)
    assert routers[0].inner is inner
    # only the experts change: the trained router's k and combine weights stay
    assert rnd.expert_ids_TK.shape == learned.expert_ids_TK.shape
    assert torch.equal(rnd.weights_TK, learned.weights_TK)
    assert not torch.equal(rnd.expert_ids_TK, learned.expert_ids_TK)
    assert all(len(set(row)) == len(row) for row in rnd.expert_ids_TK.tolist())  # distinct
    plain = build_model(_moa_cfg("adapters.num_experts=1"), MANIFEST)
    assert sentence_routers(plain) == []
    assert sentence_router_labels(SimpleNamespace(model=plain, cfg=cfg), x_ND.numpy()) is None

    # its input is the routed model's own pooled encoder output: the backbone's features only
    # when it is the backbone (encoder adapters, or a further-trained encoder, change it)
    from moe_train.stages.evaluate import learned_routing

    encoded = []

    def encode(m):
        encoded.append(m)
        return -x_ND.numpy()

    backbone = SimpleNamespace(model=plain, cfg=cfg)
    name, own, groups = learned_routing(inf, backbone, x_ND.numpy(), encode)
    assert name == "router_sentence" and encoded == [model]
    assert groups == 4  # adapters.num_experts or moe.num_experts: every row, used or not
    assert own.tolist()[3:] == [2, 2, 2] and 2 not in own.tolist()[:3]
    name, same, _ = learned_routing(inf, inf, x_ND.numpy(), encode)
    assert len(encoded) == 1 and same.tolist() == labels.tolist()
    assert learned_routing(backbone, backbone, x_ND.numpy(), encode) is None


def test_an_encoder_side_sentence_router_is_swapped_but_not_scored() -> None:
    """Its input is the pooled source embeddings, not the encoder output the routing table
    reads: random routing swaps it; the table leaves it out rather than score it on another
    input."""
    from types import SimpleNamespace

    from moe_train.stages.evaluate import random_routing, sentence_router_labels, \
        sentence_routers

    cfg = _moa_cfg("moe.num_experts=4", "moe.layers=all", "moe.encoder_router=sentence",
                   "moe.decoder_router=dense", "moe.k=1")
    model = build_model(cfg, MANIFEST).eval()
    inf = SimpleNamespace(model=model, cfg=cfg)
    assert len(sentence_routers(model)) == 1 and sentence_routers(model, encoder=False) == []
    assert sentence_router_labels(inf, torch.zeros(3, 16).numpy()) is None
    with random_routing(inf) as swapped:
        assert swapped


def test_rnd_withholds_the_domain_from_every_model_that_reads_it() -> None:
    """RND (seed 001 Table 2) shuffles the labels of any model that reads them when it
    translates: domain-routed adapters or FFN experts, THOR on the gold domain, or a domain tag
    in the source (DC-Tag); label-free models are scored once."""
    from moe_train.stages.evaluate import uses_domain_labels

    untagged, tagged = {"domain_tags": False}, {"domain_tags": True}
    reads = [_moa_cfg("adapters.num_experts=3", "adapters.router=task",
                      "adapters.task_source=domain", "adapters.k=1"),
             _moa_cfg("moe.num_experts=4", "moe.layers=all", "moe.encoder_router=dense",
                      "moe.decoder_router=task", "moe.decoder_task_source=domain")]
    for cfg in reads:
        assert uses_domain_labels(cfg, untagged)
    label_free = _moa_cfg("adapters.num_experts=4", "adapters.router=gumbel", "adapters.k=2")
    assert not uses_domain_labels(label_free, untagged)
    assert uses_domain_labels(label_free, tagged)  # its source says the domain
    thor = ROOT / "configs" / "thor-synthetic-cpu.yaml"  # routes by the predicted domain
    assert not uses_domain_labels(load_config(thor), untagged)
    assert uses_domain_labels(load_config(thor, ["thor.task_repr=gold"]), untagged)
