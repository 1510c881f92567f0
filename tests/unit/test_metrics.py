"""sacreBLEU wiring on a tiny example whose BLEU is computed by hand."""

import math

import pytest

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
