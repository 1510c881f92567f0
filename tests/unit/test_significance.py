"""Paired bootstrap between two systems: exact corpus scores, a deterministic interval, and
p-values that tell a clearly better system from an identical one."""

from __future__ import annotations

import pytest
from sacrebleu.metrics import BLEU, CHRF

from moe_train.eval.significance import paired_bootstrap

REFS = [f"the cat number {i} sat on the mat near door {i % 7}" for i in range(60)]
GOOD = list(REFS)
BAD = [r.replace("sat", "stood").replace("mat", "rug") if i % 2 else r
       for i, r in enumerate(REFS)]


def test_corpus_scores_are_sacrebleus():
    out = paired_bootstrap(BAD, GOOD, REFS, samples=50)
    assert out["bleu"]["a"] == round(BLEU().corpus_score(BAD, [REFS]).score, 2)
    assert out["chrf"]["b"] == round(CHRF().corpus_score(GOOD, [REFS]).score, 2)
    assert out["bleu"]["delta"] == round(out["bleu"]["a"] - out["bleu"]["b"], 2)


def test_chinese_targets_use_corpus_metrics_tokenizer():
    """Without spaces between words 13a sees each sentence as one token: the better system
    would score as the worse one (0.0 / 0.0)."""
    from moe_train.eval.metrics import corpus_metrics

    refs = ["我今天去学校上课了。", "这只猫坐在垫子上。"] * 5
    good, bad = ["我今天去学校上课。", "这只猫坐在桌子上。"] * 5, ["我去学校。", "猫在桌子上。"] * 5
    for lang in ("zh", "zh_CN", "zh-TW"):
        out = paired_bootstrap(good, bad, refs, samples=100, tgt_lang=lang)["bleu"]
        assert out["a"] == corpus_metrics(good, refs, lang)["bleu"] == 71.13
        assert out["b"] == corpus_metrics(bad, refs, lang)["bleu"]
        # B never wins: the smallest p-value 100 resamples support, 1 / 101, not 0
        assert out["p_a_not_better"] == round(1 / 101, 4) and "tok:zh" in out["signature"]
    assert "tok:13a" in paired_bootstrap(GOOD, BAD, REFS, samples=10)["bleu"]["signature"]


def test_better_system_is_significant_and_interval_excludes_zero():
    out = paired_bootstrap(GOOD, BAD, REFS, samples=300)
    bleu = out["bleu"]
    assert bleu["delta"] > 0
    assert 0 < bleu["ci95"][0] <= bleu["delta"] <= bleu["ci95"][1]
    assert bleu["p_a_not_better"] < 0.01 and bleu["p_b_not_better"] > 0.99
    reverse = paired_bootstrap(BAD, GOOD, REFS, samples=300)["bleu"]
    assert reverse["ci95"][1] < 0 and reverse["p_a_not_better"] > 0.99


def test_identical_systems_never_differ():
    out = paired_bootstrap(BAD, BAD, REFS, samples=100)
    for metric in ("bleu", "chrf"):
        assert out[metric]["delta"] == 0 and out[metric]["ci95"] == [0.0, 0.0]
        assert out[metric]["p_a_not_better"] == 1.0 == out[metric]["p_b_not_better"]


def test_deterministic_for_a_seed_and_seed_matters():
    mixed = [g if i % 3 else b for i, (g, b) in enumerate(zip(GOOD, BAD))]
    one = paired_bootstrap(mixed, BAD, REFS, samples=200, seed=1)
    assert one == paired_bootstrap(mixed, BAD, REFS, samples=200, seed=1)
    assert one["bleu"]["ci95"] != paired_bootstrap(mixed, BAD, REFS, samples=200,
                                                   seed=2)["bleu"]["ci95"]


@pytest.mark.parametrize("args, match", [
    ((GOOD[:-1], BAD, REFS), "one hypothesis of each system per reference"),
    (([], [], []), "at least one sentence"),
])
def test_mismatched_or_empty_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(*args)
    with pytest.raises(ValueError, match="samples"):
        paired_bootstrap(GOOD, BAD, REFS, samples=0)


def test_interval_is_the_2_5_and_97_5_percentiles_of_sacrebleu_deltas():
    """The resamples are numpy's default_rng(seed) draws; each delta is sacreBLEU's corpus
    score on the drawn sentences, and ci95 their 2.5th and 97.5th percentiles."""
    import numpy as np

    mix = [r if i % 3 else b for i, (r, b) in enumerate(zip(REFS, BAD))]
    out = paired_bootstrap(mix, BAD, REFS, samples=200, seed=7)["bleu"]
    draws = np.random.default_rng(7).integers(0, len(REFS), size=(200, len(REFS)))
    deltas = [BLEU().corpus_score([mix[i] for i in d], [[REFS[i] for i in d]]).score
              - BLEU().corpus_score([BAD[i] for i in d], [[REFS[i] for i in d]]).score
              for d in draws]
    assert out["ci95"] == [round(float(x), 2) for x in np.percentile(deltas, [2.5, 97.5])]


def test_strata_resample_each_test_set_apart():
    """Two test sets joined end to end, A better on the first and B on the second: drawing
    each set's sentences apart keeps the mix fixed, so the interval is narrower than when the
    mix itself is resampled; one stratum is the plain bootstrap."""
    a, b = GOOD + BAD, BAD + GOOD
    plain = paired_bootstrap(a, b, REFS + REFS, samples=400)["bleu"]
    split = paired_bootstrap(a, b, REFS + REFS, samples=400, strata=[60, 60])
    assert split["strata"] == [60, 60] and split["bleu"]["delta"] == plain["delta"] == 0
    width = split["bleu"]["ci95"][1] - split["bleu"]["ci95"][0]
    assert 0 < width < plain["ci95"][1] - plain["ci95"][0]
    assert split["bleu"]["ci95"][0] < 0 < split["bleu"]["ci95"][1]  # each set drawn from itself
    one = paired_bootstrap(GOOD, BAD, REFS, samples=50, strata=[60])
    assert one.pop("strata") == [60] and one == paired_bootstrap(GOOD, BAD, REFS, samples=50)
    for bad in ([60, 1], [61, -1], [0, 60]):
        with pytest.raises(ValueError, match="strata"):
            paired_bootstrap(GOOD, BAD, REFS, strata=bad)


def test_per_sentence_targets_score_as_corpus_metrics_does():
    from moe_train.eval.metrics import corpus_metrics

    refs = ["the cat sat on a mat", "我今天去学校上课了。", "a dog ran home", "这只猫坐在垫子上。"]
    good = ["the cat sat on a mat", "我今天去学校上课。", "a dog ran home", "这只猫坐在桌子上。"]
    bad = ["a mat", "我。", "home", "这只猫。"]
    langs = ["de", "zh", "de", "zh"]
    out = paired_bootstrap(good, bad, refs, samples=50, tgt_lang=langs)["bleu"]
    assert out["a"] == corpus_metrics(good, refs, langs)["bleu"]
    assert out["b"] == corpus_metrics(bad, refs, langs)["bleu"]
    assert "tok:13a+zh" in out["signature"]


def test_resamples_scored_in_chunks_equal_all_at_once():
    import numpy as np
    from sacrebleu.metrics import CHRF

    from moe_train.eval.significance import _resampled

    chrf = CHRF()
    stats_NS = np.asarray(chrf._extract_corpus_statistics(GOOD + BAD, [REFS + REFS]), dtype=float)
    idx_RN = np.random.default_rng(0).integers(0, len(stats_NS), size=(23, len(stats_NS)))
    whole = _resampled(chrf, stats_NS, idx_RN, chunk=len(idx_RN))
    assert len(whole) == 23 and np.array_equal(_resampled(chrf, stats_NS, idx_RN, chunk=5), whole)
