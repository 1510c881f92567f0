"""sacreBLEU wiring on a tiny example whose BLEU is computed by hand."""

import math

import pytest

from moe_train.errors import DataError
from moe_train.eval.metrics import corpus_metrics


def test_identical_is_100():
    m = corpus_metrics(["the cat sat on the mat ."], ["the cat sat on the mat ."])
    assert m["bleu"] == 100.0 and m["chrf"] == 100.0


def test_known_bleu_value():
    # n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths so no brevity penalty
    m = corpus_metrics(["the cat sat on the mat"], ["the cat sat on a mat"])
    expected = 100 * math.exp((math.log(5 / 6) + math.log(3 / 5) + math.log(2 / 4)
                               + math.log(1 / 3)) / 4)
    assert m["bleu"] == pytest.approx(expected, abs=0.01)
    assert 0 < m["chrf"] < 100
    assert m["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert m["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        corpus_metrics(["a"], ["a", "b"])


def test_an_empty_corpus_is_an_error():
    with pytest.raises(DataError, match="no sentences"):
        corpus_metrics([], [])


def test_chinese_targets_use_sacrebleu_s_chinese_tokenizer():
    """13a sees one 'word' per unsegmented Chinese sentence (BLEU 0 for a near match); the zh
    tokenizer, as sacreBLEU's `-l en-zh`, scores characters. Romanised or Latin text keeps 13a
    whatever the language code, and Japanese / Korean in their scripts fall back to characters
    when MeCab is missing."""
    hyps, refs = ["我今天去学校上课。", "这只猫坐在桌子上。"], ["我今天去学校上课了。", "这只猫坐在垫子上。"]
    assert corpus_metrics(hyps, refs)["bleu"] == 0.0
    zh = corpus_metrics(hyps, refs, "zh")
    assert zh["bleu"] > 50 and "tok:zh" in zh["bleu_signature"]
    assert "tok:13a" in corpus_metrics(["te kaho meru"], ["te kaho meru"], "ja")["bleu_signature"]
    ja = corpus_metrics(["猫が座った"], ["猫が座った"], "ja")["bleu_signature"]
    assert "tok:ja-mecab" in ja or "tok:char" in ja
    assert "tok:13a" in corpus_metrics(hyps, refs, "de")["bleu_signature"]
