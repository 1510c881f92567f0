"""Gated Adapters recipe parts, with fakes: the classifiers and their report, the tables of
the evaluation stage (AVG / wAVG, misclassified subset, gate agreement, efficiency), the
frozen-parameter check and weight loading of the AD / GAD stages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from moe_train.errors import CheckpointError, ConfigError
from moe_train.stages import gad_efficiency
from moe_train.stages.classifier_core import EncoderClassifier, TfidfClassifier, domain_report
from moe_train.stages.common import load_matching
from moe_train.stages.gad import FrozenCheck
from moe_train.data.batching import eval_batches
from moe_train.stages.gad_eval import (domain_weights, efficiency_max_tokens, gate_agreement,
                                       score_system)

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeData:
    """Sources of token ids, domain ids and raw references (English to German)."""

    def __init__(self, srcs: list[list[int]], domains: list[int], refs: list[str]) -> None:
        self.srcs, self.domain_ids, self.refs = srcs, np.asarray(domains), refs
        self.tgt_lang_ids = np.ones(len(srcs), dtype=np.int64)
        self.manifest = {"langs": ["en", "de"]}

    def src(self, i: int) -> np.ndarray:
        return np.asarray(self.srcs[i], dtype=np.int64)

    def raw_tgt(self, i: int) -> str:
        return self.refs[i]


def _domain_data(n: int, seed: int) -> FakeData:
    """Three domains with their own word ids (10s, 20s, 30s) plus shared ids 1-5."""
    rng = np.random.default_rng(seed)
    srcs, doms = [], []
    for i in range(n):
        d = i % 3
        words = list(rng.integers(1, 6, size=3)) + list(10 * (d + 1) + rng.integers(0, 5, 2))
        srcs.append([int(w) for w in rng.permutation(words)])
        doms.append(d)
    return FakeData(srcs, doms, [""] * n)


def test_tfidf_classifier_learns_domains_and_round_trips(tmp_path):
    train, test = _domain_data(90, 0), _domain_data(30, 1)
    idx = np.arange(30)
    clf = TfidfClassifier.fit([" ".join(map(str, s)) for s in train.srcs], train.domain_ids,
                              num_domains=4, ngrams=2)
    probs = clf.predict_proba(test, idx)
    assert probs.shape == (30, 4) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert (probs[:, 3] == 0).all()  # a domain without training data gets no mass
    assert (probs.argmax(1) == test.domain_ids).mean() == 1.0
    clf.save(tmp_path / "clf.skops")
    np.testing.assert_array_equal(TfidfClassifier.load(tmp_path / "clf.skops")
                                  .predict_proba(test, idx), probs)


def test_tfidf_classifier_of_one_domain_is_one_line() -> None:
    """scikit-learn's logistic regression refuses one class: a config error, not a traceback."""
    with pytest.raises(ConfigError, match="tfidf needs sentences of at least two domains"):
        TfidfClassifier.fit(["1 2 3", "1 2 4"], np.array([0, 0]), num_domains=1, ngrams=1)


def test_encoder_classifier_head_round_trips_and_refuses_other_files(tmp_path):
    head = nn.Linear(8, 3)
    EncoderClassifier(nn.Identity(), head, None, 0).save(tmp_path / "head.pt")
    loaded = EncoderClassifier.load_head(tmp_path / "head.pt")
    assert torch.equal(loaded.weight, head.weight) and torch.equal(loaded.bias, head.bias)
    torch.save({"w": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a linear classifier head"):
        EncoderClassifier.load_head(tmp_path / "other.pt")


def test_the_configured_classifier_kind_is_loaded_not_a_leftover_file(tmp_path):
    """A TF-IDF run killed after saving tfidf.skops, then the stage rerun with the encoder
    classifier: gad evaluate must load the encoder head (the TF-IDF file used to win)."""
    from types import SimpleNamespace

    from moe_train.stages.classifier import HEAD, TFIDF, load_classifier

    train = _domain_data(40, 0)
    TfidfClassifier.fit([" ".join(map(str, s)) for s in train.srcs], train.domain_ids,
                        num_domains=4, ngrams=1).save(tmp_path / TFIDF)
    EncoderClassifier(nn.Identity(), nn.Linear(8, 4), None, 0).save(tmp_path / HEAD)

    def ctx(kind):
        return SimpleNamespace(require=lambda stage, by: tmp_path, cfg=SimpleNamespace(
            gated=SimpleNamespace(classifier=kind), data=SimpleNamespace(max_tokens=100)))

    assert load_classifier(ctx("encoder"), "gad_evaluate", nn.Identity()).kind == "encoder"
    assert load_classifier(ctx("tfidf"), "gad_evaluate").kind == "tfidf"


def test_domain_report_micro_f1_and_confusion():
    true = np.array([0, 0, 1, 1, 2, 2])
    pred = np.array([0, 1, 1, 1, 2, 0])
    r = domain_report(pred, true, ["a", "b", "c"])
    assert r["micro_f1"] == pytest.approx(4 / 6) and r["misclassified"] == 2
    assert r["confusion"]["matrix"] == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    assert r["f1"]["b"] == pytest.approx(0.8)


def test_domain_weights_are_training_shares():
    manifest = {"domains": ["a", "b"], "corpora": [{"domain_id": 0}, {"domain_id": 1},
                                                   {"domain_id": 0}],
                "splits": {"train": {"corpus_sizes": [10, 20, 10]}}}
    np.testing.assert_allclose(domain_weights(manifest), [0.5, 0.5])


def test_score_system_avg_wavg_and_misclassified_subset():
    refs = ["the cat sat on the mat", "a dog ran far away", "blue sky over the hills",
            "we eat bread every day"]
    data = FakeData([[1]] * 4, [0, 0, 1, 1], refs)
    hyps = {0: refs[0], 1: refs[1], 2: "nothing alike here", 3: "completely other words"}
    idx, weights = np.arange(4), np.array([0.75, 0.25])
    out = score_system(hyps, data, idx, np.array([2, 3]), ["a", "b"], weights)
    a, b = out["domains"]["a"]["bleu"], out["domains"]["b"]["bleu"]
    assert a == 100.0 and b < 5
    assert out["avg"]["bleu"] == pytest.approx((a + b) / 2, abs=0.01)
    assert out["wavg"]["bleu"] == pytest.approx(0.75 * a + 0.25 * b, abs=0.01)
    assert out["misclassified"]["sentences"] == 2 and out["misclassified"]["bleu"] == b
    assert out["signatures"]["bleu"].startswith("nrefs:1")


def test_gate_agreement_uses_the_layer_mean():
    gates = np.array([[[0.6, 0.4], [0.2, 0.8]],     # layer 0
                      [[0.9, 0.1], [0.7, 0.3]]])    # layer 1; mean rows: [.75 .25], [.45 .55]
    out = gate_agreement(gates, pred_N=np.array([0, 0]), gold_N=np.array([0, 1]))
    assert out["with_classifier"] == 0.5 and out["with_gold"] == 1.0
    assert out["per_layer_with_classifier"] == [0.5, 1.0]


def test_efficiency_table_keeps_each_fastest_round_and_sums_domains(monkeypatch):
    clock = [0.0]
    cost = {"AD_ORACLE": 1.0, "AD_CLF": 2.0, "GAD": 1.5}
    calls = []

    def system(name):
        def run(ids):
            calls.append(name)
            slow = 1.0 if len(calls) == 1 else 0.0  # the first call of the run is slow
            clock[0] += cost[name] * len(ids) + slow
        return run

    monkeypatch.setattr(gad_efficiency.time, "perf_counter", lambda: clock[0])
    by_domain = {"a": np.array([0, 1]), "b": np.array([2])}
    tokens = np.array([10, 10, 5])
    out = gad_efficiency.efficiency_table({n: system(n) for n in cost}, by_domain, tokens, 2)
    gad = out["systems"]["GAD"]
    assert gad["seconds"] == 4.5 and gad["sentences"] == 3 and gad["tokens"] == 25
    assert gad["sentences_per_s"] == round(3 / 4.5, 2)
    assert gad["domains"]["b"]["tokens_per_s"] == round(5 / 1.5, 1)
    assert out["systems"]["AD_ORACLE"]["seconds"] == 3.0  # the slow first call is not kept
    assert out["sentences_per_s_ratios"]["GAD/AD_CLF"] == round((3 / 4.5) / (3 / 6), 3)
    assert calls[:3] == ["AD_ORACLE"] * 2 + ["AD_CLF"]  # round 0 starts with AD_ORACLE
    assert calls[6:8] == ["AD_CLF"] * 2  # round 1 rotates the order

    # one round: the untimed warm-up batch takes the first call's cost off AD_ORACLE
    calls.clear()
    out = gad_efficiency.efficiency_table({n: system(n) for n in cost}, by_domain, tokens, 1,
                                          warmup=np.array([0]))
    assert calls[:3] == ["AD_ORACLE", "AD_CLF", "GAD"] and len(calls) == 3 + 3 * 2
    assert out["systems"]["AD_ORACLE"]["seconds"] == 3.0


def test_frozen_check_reports_a_changed_frozen_parameter():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    check = FrozenCheck(model)
    with torch.no_grad():
        model[1].weight.add_(1.0)  # trainable: may change
    assert check.report(model)["frozen_unchanged"]
    with torch.no_grad():
        model[0].bias.add_(1e-7)
    report = check.report(model)
    assert not report["frozen_unchanged"] and report["frozen_changed"] == ["0.bias"]
    assert report["frozen_parameters"] == 6


def test_load_matching_allows_only_the_named_new_parameters(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    weights = {k: torch.ones_like(v) for k, v in model.state_dict().items() if k.startswith("0.")}
    load_matching(model, weights, tmp_path, new={"1.weight", "1.bias"})
    assert torch.equal(model[0].weight, torch.ones(2, 2))
    with pytest.raises(CheckpointError, match="missing"):
        load_matching(model, weights, tmp_path, new={"1.weight"})
    with pytest.raises(CheckpointError, match="other shapes"):
        load_matching(model, weights | {"1.weight": torch.ones(2, 2)}, tmp_path,
                      new={"1.bias"})


def test_probe_refuses_a_batch_smaller_than_the_ranks():
    from types import SimpleNamespace

    from moe_train.errors import ConfigError
    from moe_train.stages.probe import fit_probe

    rt = SimpleNamespace(dp_world=4, dp_rank=0, device="cpu")
    with pytest.raises(ConfigError, match="3 rows per step cannot be shared by 4 ranks"):
        fit_probe(nn.Linear(2, 2), np.zeros((3, 2), np.float32), np.zeros(3), 1, 0.1, 8, 0, rt)


class _Lengths:
    """Held-out pairs longer than training's data.max_len (100): 40 of 150 tokens."""

    def __init__(self, n: int) -> None:
        self.src_lengths = np.full(n, 150)
        self.tgt_lengths = np.arange(n) % 40 + 110
        self.domain_ids = self.src_lang_ids = self.tgt_lang_ids = self.corpus_ids = np.zeros(n)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def src(self, i: int) -> np.ndarray:
        return np.full(self.src_lengths[i], 5)

    def tgt(self, i: int) -> np.ndarray:
        return np.full(self.tgt_lengths[i], 6)


def test_efficiency_batches_hold_the_recorded_number_of_sentences():
    data, idx = _Lengths(140), np.arange(3, 140)
    budget = efficiency_max_tokens(data, idx, 64)
    sizes = [len(b.indices_B) for b in eval_batches(data, budget, 0, 1, 2, max_sentences=64,
                                                    indices=idx)]
    assert sizes == [64, 64, 9]
