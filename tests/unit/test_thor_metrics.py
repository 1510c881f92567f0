"""THOR metrics against hand counts: experts per token, task accuracy and confusion, expert x
task tables, candidate sets and their usage, the files routing-stats writes, and the routing
metrics `evaluate` adds."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from moe_train.config import load_config
from moe_train.data.batching import eval_batches
from moe_train.eval.decode import batch_context
from moe_train.eval.evaluate import add_routing_metrics, format_table
from moe_train.eval.routing_stats import (RoutingStats, collect_routing_stats, task_names,
                                          write_routing_stats)
from moe_train.models.build import build_model, moe_layers
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_PROBS_KEY, TASK_REPR_KEY, ThorRouter
from moe_train.parallel.runtime import ParallelRuntime
from tests.unit.test_routing_stats import MANIFEST, PAD, V, FakeDataset

ENC, DEC = "encoder_layers.1.ffn", "decoder_layers.1.ffn"
THOR = ["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "moe.num_experts=8",
        "moe.encoder_router=thor", "moe.decoder_router=thor", "thor.num_tasks=4",
        "thor.num_candidates=4"]
E, Q = 8, 4
MAX_TOKENS = 40


def _thor(*extra: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = load_config(overrides=THOR + list(extra))
    return build_model(cfg, {"vocab_size": V, "pad_id": PAD, "domains": MANIFEST["domains"],
                             "langs": MANIFEST["langs"]}).eval()


@pytest.fixture(scope="module")
def dataset() -> FakeDataset:
    return FakeDataset([4, 3, 5])


@torch.no_grad()
def _hand_counts(model: torch.nn.Module, ds: FakeDataset) -> dict:
    """The same forwards, counted token by token in Python from what the routers returned."""
    names = {id(layer.router): name for name, layer in moe_layers(model)}
    calls: list[tuple] = []

    def hook(module, args, kwargs, routing):
        calls.append((names[id(module)], module, routing.expert_ids_TK, args[1]))

    handles = [layer.router.register_forward_hook(hook, with_kwargs=True)
               for _, layer in moe_layers(model)]
    h = {"slots": {ENC: 0, DEC: 0}, "tokens": {ENC: 0, DEC: 0}, "router_ept": {ENC: 0.0, DEC: 0.0},
         "gold_EQ": {ENC: np.zeros((E, Q), int), DEC: np.zeros((E, Q), int)},
         "pred_EQ": {ENC: np.zeros((E, Q), int), DEC: np.zeros((E, Q), int)},
         "cand_EQ": {ENC: np.zeros((E, Q), int), DEC: np.zeros((E, Q), int)},
         "pairs": {ENC: 0, DEC: 0}, "used": {ENC: 0, DEC: 0},
         "confusion": np.zeros((Q, Q), int)}
    for batch in eval_batches(ds, MAX_TOKENS, PAD, 2, 3):
        calls.clear()
        ctx = batch_context(batch, PAD, len(MANIFEST["langs"]))
        out = model(batch.src_tokens_BS, batch.tgt_in_BT, ctx)
        pred = out.extras[TASK_PROBS_KEY].argmax(-1).tolist()
        gold = out.extras[GOLD_TASK_KEY].tolist()
        assert gold == batch.domain_ids_B.tolist()  # thor.task_source domain
        for p, g in zip(pred, gold):
            h["confusion"][p, g] += 1
        for name, router, ids_TK, rctx in calls:
            layer = dict(moe_layers(model))[name]
            pad = rctx.pad_mask_T.tolist()
            sid = rctx.sentence_ids_T.tolist()
            real = pad.count(False)
            h["router_ept"][name] += float(layer.scalar_stats["experts_per_token"]) * real
            _, cand_BC, _ = router.candidate_sets(rctx.extras[TASK_REPR_KEY])
            hit = set()
            for t, row in enumerate(ids_TK.tolist()):
                if pad[t]:
                    continue
                h["tokens"][name] += 1
                for e in row:
                    if e >= 0:
                        h["slots"][name] += 1
                        h["gold_EQ"][name][e, gold[sid[t]]] += 1
                        h["pred_EQ"][name][e, pred[sid[t]]] += 1
                        hit.add((sid[t], e))
            for b, cands in enumerate(cand_BC.tolist()):
                for e in cands:
                    h["cand_EQ"][name][e, gold[b]] += 1
                    h["pairs"][name] += 1
                    h["used"][name] += (b, e) in hit
    for handle in handles:
        handle.remove()
    return h


@pytest.fixture(scope="module")
def topp(dataset: FakeDataset) -> tuple[RoutingStats, dict]:
    model = _thor()
    return (collect_routing_stats(model, dataset, MANIFEST, ParallelRuntime(), MAX_TOKENS),
            _hand_counts(model, dataset))


def test_experts_per_token_is_used_slots_over_real_tokens(topp, dataset) -> None:
    stats, hand = topp
    src = (stats.layers[ENC].tokens_domain, stats.layers[DEC].tokens_domain)
    ds = dataset
    # encoder: [CLS] + tokens + eos; decoder: bos + tokens
    np.testing.assert_array_equal(src[0], np.bincount(ds.domain_ids, ds.src_lengths + 2))
    np.testing.assert_array_equal(src[1], np.bincount(ds.domain_ids, ds.tgt_lengths + 1))
    values = []
    for name in (ENC, DEC):
        t = stats.layers[name]
        assert t.tokens == hand["tokens"][name]
        ept = hand["slots"][name] / hand["tokens"][name]
        assert t.experts_per_token == pytest.approx(ept)
        # the router's own per-batch statistic, weighted by each batch's real tokens
        assert hand["router_ept"][name] / hand["tokens"][name] == pytest.approx(ept)
        assert 1.0 <= ept <= 4.0 and ept != int(ept)  # top-p inside S^t: varies per token
        values.append(ept)
    summary = stats.summary()
    assert summary["experts_per_token"] == pytest.approx(
        {"all": sum(values) / 2, "encoder": values[0], "decoder": values[1]})
    assert summary["layers"][DEC]["experts_per_token"] == pytest.approx(values[1])


def test_task_accuracy_and_tables_match_hand_counts(topp) -> None:
    stats, hand = topp
    tp = stats.task_prediction
    assert stats.pred_tasks == ["it", "law", "med"]  # task 3 neither gold nor predicted
    np.testing.assert_array_equal(tp.confusion, hand["confusion"][:3, :3])
    assert hand["confusion"][3].sum() == 0 and hand["confusion"][:, 3].sum() == 0
    assert tp.accuracy == pytest.approx(np.trace(hand["confusion"]) / 12)
    assert tp.sentences == 12
    task = stats.summary()["task_prediction"]
    assert task["accuracy"] == tp.accuracy and task["source"] == "domain"
    for d, name in enumerate(stats.domains):  # task = domain: per-task == per-domain accuracy
        expected = hand["confusion"][d, d] / hand["confusion"][:, d].sum()
        assert task["accuracy_by_task"][name] == pytest.approx(expected)
        assert task["accuracy_by_domain"][name] == pytest.approx(expected)
    for name in (ENC, DEC):
        t = stats.layers[name]
        np.testing.assert_array_equal(t.expert_gold_task, hand["gold_EQ"][name][:, :3])
        np.testing.assert_array_equal(t.expert_pred_task, hand["pred_EQ"][name][:, :3])
        np.testing.assert_array_equal(t.expert_gold_task, t.expert_domain)  # task = domain
        np.testing.assert_array_equal(t.candidate_gold_task, hand["cand_EQ"][name][:, :3])
        np.testing.assert_array_equal(t.candidates_per_expert, hand["cand_EQ"][name].sum(1))
        assert t.set_size == 4 and t.candidate_gold_task.sum() == 4 * 12
        assert t.candidate_usage == pytest.approx(hand["used"][name] / hand["pairs"][name])
        assert stats.summary()["layers"][name]["candidate_usage"] == t.candidate_usage


def test_uniform_predictor_gives_accuracy_and_tables_from_the_data(dataset) -> None:
    # W^p = 0: P^t uniform, argmax task 0 for every sentence; E_p equal for all sentences, so
    # every sentence has the same S^t. Top-2 inside S^t: exactly 2 experts per real token.
    model = _thor("thor.token_routing=topk", "moe.k=2")
    predictor = next(m for m in model.modules() if hasattr(m, "task_embed_KD"))
    predictor.proj.weight.data.zero_()
    stats = collect_routing_stats(model, dataset, MANIFEST, ParallelRuntime(), MAX_TOKENS)
    per_domain = [4, 3, 5]
    np.testing.assert_array_equal(stats.task_prediction.confusion,
                                  [per_domain, [0, 0, 0], [0, 0, 0]])
    assert stats.task_prediction.accuracy == pytest.approx(4 / 12)
    for name in (ENC, DEC):
        t = stats.layers[name]
        assert t.experts_per_token == 2.0
        np.testing.assert_array_equal(t.experts_per_token_by("domain"), [2.0, 2.0, 2.0])
        assert (t.expert_pred_task[:, 1:] == 0).all()  # everything predicted "it"
        in_set = t.candidates_per_expert > 0
        assert in_set.sum() == 4 and (t.candidates_per_expert[in_set] == 12).all()
        np.testing.assert_array_equal(t.candidate_gold_task[in_set], [per_domain] * 4)
        assert (t.candidate_gold_task[~in_set] == 0).all()
        assert (t.expert_domain[~in_set] == 0).all()  # no slot outside S^t
    groups = stats.group_metrics()
    assert groups["domains"]["it"] == {"experts_per_token": 2.0, "task_accuracy": 1.0}
    assert groups["domains"]["law"]["task_accuracy"] == 0.0
    assert groups["pairs"]["de-en"]["task_accuracy"] == 1.0  # corpus 0 = domain it


def test_thor_files(topp, tmp_path) -> None:
    stats, hand = topp
    out = tmp_path / "routing"
    paths = write_routing_stats(stats, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    per_layer = [f"{layer}.{kind}.{ext}" for layer in (ENC, DEC) for kind in
                 ("expert_domain", "expert_task", "expert_tgt_lang", "expert_gold_task",
                  "expert_pred_task", "candidate_gold_task") for ext in ("csv", "png")]
    assert sorted(p.name for p in paths) == sorted(
        per_layer + ["task_confusion.csv", "task_confusion.png", "all_layers.csv",
                     "layers.csv", "summary.json"])
    for kind, table in (("expert_gold_task", hand["gold_EQ"]), ("expert_pred_task",
                                                                hand["pred_EQ"]),
                        ("candidate_gold_task", hand["cand_EQ"])):
        with open(out / f"{DEC}.{kind}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["expert", "it", "law", "med"]
        assert [r[0] for r in rows[1:]] == [str(e) for e in range(E)]
        np.testing.assert_array_equal(np.array(rows[1:], dtype=np.int64)[:, 1:],
                                      table[DEC][:, :3])
    with open(out / "task_confusion.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["predicted task", "it", "law", "med"]
    assert [r[0] for r in rows[1:]] == ["it", "law", "med"]
    np.testing.assert_array_equal(np.array(rows[1:])[:, 1:].astype(int), hand["confusion"][:3, :3])
    with open(out / "layers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer"] for r in rows] == [ENC, DEC] and [r["side"] for r in rows] == \
        ["encoder", "decoder"]
    for r in rows:
        layer = r["layer"]
        assert float(r["experts_per_token"]) == pytest.approx(
            hand["slots"][layer] / hand["tokens"][layer], rel=1e-5)
        assert float(r["candidate_usage"]) == pytest.approx(
            hand["used"][layer] / hand["pairs"][layer], rel=1e-5)
        assert int(r["tokens"]) == hand["tokens"][layer]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_prediction"]["confusion_pred_x_gold"] == hand["confusion"][:3, :3].tolist()
    assert summary["layers"][ENC]["candidate_set_size"] == 4
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_gets_routing_metrics(topp) -> None:
    stats, hand = topp
    score = {"sentences": 4, "bleu": 1.0, "chrf": 2.0}
    metrics = {"all": dict(score, sentences=12), "domains": {d: dict(score) for d in
                                                            ("it", "law", "med")},
               "pairs": {"de-en": dict(score)}}
    add_routing_metrics(metrics, stats)
    acc = np.trace(hand["confusion"]) / 12
    assert metrics["all"]["task_accuracy"] == pytest.approx(acc)
    ept = [hand["slots"][n] / hand["tokens"][n] for n in (ENC, DEC)]
    assert metrics["all"]["experts_per_token"] == pytest.approx(sum(ept) / 2)
    routing = metrics["routing"]
    assert routing["layers"][ENC]["experts_per_token"] == pytest.approx(ept[0])
    assert routing["task_prediction"]["accuracy"] == pytest.approx(acc)
    assert set(routing["candidate_usage"]) == {"all", "encoder", "decoder"}
    law = hand["confusion"][1, 1] / hand["confusion"][:, 1].sum()
    assert metrics["domains"]["law"]["task_accuracy"] == pytest.approx(law)
    assert metrics["domains"]["law"]["bleu"] == 1.0  # the scores are kept
    table = format_table(metrics)
    assert "exp/tok" in table.splitlines()[0] and "taskacc" in table.splitlines()[0]
    assert len(table.splitlines()) == 5
    json.dumps(metrics)  # serialisable


def test_non_thor_model_has_no_task_tables(dataset) -> None:
    model = _thor("moe.encoder_router=topp", "moe.decoder_router=topk", "moe.k=2")
    assert not any(isinstance(layer.router, ThorRouter) for _, layer in moe_layers(model))
    stats = collect_routing_stats(model, dataset, MANIFEST, ParallelRuntime(), MAX_TOKENS)
    assert stats.task_prediction is None and stats.pred_tasks is None
    assert stats.layers[DEC].experts_per_token == 2.0
    assert stats.layers[ENC].candidate_usage is None
    summary = stats.summary()
    assert "task_prediction" not in summary and "candidate_usage" not in summary
    assert "candidate_usage" not in summary["layers"][ENC]
    assert stats.table_kinds(ENC) == ("expert_domain", "expert_task", "expert_tgt_lang")


def test_ranks_sum_to_the_whole(topp, dataset) -> None:
    stats, _ = topp
    parts = [collect_routing_stats(_thor(), dataset, MANIFEST,
                                   ParallelRuntime(rank=r, world_size=2), MAX_TOKENS)
             for r in (0, 1)]
    np.testing.assert_array_equal(sum(p.task_prediction.confusion for p in parts),
                                  stats.task_prediction.confusion)
    for name in (ENC, DEC):
        for field in ("expert_gold_task", "expert_pred_task", "candidate_gold_task"):
            np.testing.assert_array_equal(sum(getattr(p.layers[name], field) for p in parts),
                                          getattr(stats.layers[name], field))
        assert sum(p.layers[name].candidate_used for p in parts) == \
            stats.layers[name].candidate_used


def test_infuse_has_task_tables_but_no_candidate_sets(dataset, tmp_path) -> None:
    stats = collect_routing_stats(_thor("thor.task_repr=infuse"), dataset, MANIFEST,
                                  ParallelRuntime(), MAX_TOKENS)
    assert stats.task_prediction.sentences == 12
    for name in (ENC, DEC):
        t = stats.layers[name]
        assert t.candidate_gold_task is None and t.candidate_usage is None
        np.testing.assert_array_equal(t.expert_gold_task, t.expert_domain)
        assert stats.table_kinds(name)[-2:] == ("expert_gold_task", "expert_pred_task")
    names = {p.name for p in write_routing_stats(stats, tmp_path / "r")}
    assert f"{ENC}.expert_pred_task.png" in names and "task_confusion.csv" in names
    assert not any("candidate" in n for n in names)


def test_task_names() -> None:
    m = {"domains": ["it", "law"], "langs": ["de", "en"]}
    assert task_names("domain", 3, m) == ["it", "law", "task2"]
    assert task_names("tgt_lang", 2, m) == ["de", "en"]
    assert task_names("lang_pair", 4, m) == ["de-de", "de-en", "en-de", "en-en"]
