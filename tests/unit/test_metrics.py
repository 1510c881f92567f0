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


def test_a_region_or_three_letter_code_keeps_the_chinese_tokenizer():
    """zh_CN and zh_TW sentences are one target language (not "mixed", which used to mean
    13a), and FLORES' zho_Hans / jpn_Jpan name Chinese and Japanese."""
    from moe_train.eval.metrics import base_language, group_target

    assert group_target(["zh_CN", "zh_TW", "ZH"]) == "zh" and group_target(["de", "zh"]) is None
    assert [base_language(c) for c in ("zho_Hans", "jpn_Jpan", "kor", "de-AT")] == \
        ["zh", "ja", "ko", "de"]
    hyps, refs = ["我今天去学校上课。", "这只猫坐在桌子上。"], ["我今天去学校上课了。", "这只猫坐在垫子上。"]
    for langs in (["zh_CN", "zh_TW"], "zho_Hans"):
        m = corpus_metrics(hyps, refs, langs)
        assert m["bleu"] == corpus_metrics(hyps, refs, "zh")["bleu"] > 50, langs
        assert "tok:zh|" in m["bleu_signature"]


def test_a_group_that_mixes_targets_tokenizes_each_sentence_for_its_own_language():
    """en-de with en-zh: one corpus BLEU from the summed counts of the German sentences under
    13a and the Chinese ones under zh (as sacreBLEU computes each), not 13a over all."""
    from sacrebleu.metrics import BLEU

    de_h, de_r = ["the cat sat on the mat", "a dog ran home"], ["the cat sat on a mat",
                                                               "a dog ran home"]
    zh_h, zh_r = ["我今天去学校上课。", "这只猫坐在桌子上。"], ["我今天去学校上课了。", "这只猫坐在垫子上。"]
    hyps, refs = [de_h[0], zh_h[0], de_h[1], zh_h[1]], [de_r[0], zh_r[0], de_r[1], zh_r[1]]
    m = corpus_metrics(hyps, refs, ["de", "zh", "de", "zh"])
    stats = [sum(x) for x in zip(*BLEU(tokenize="13a")._extract_corpus_statistics(de_h, [de_r]),
                                 *BLEU(tokenize="zh")._extract_corpus_statistics(zh_h, [zh_r]))]
    assert m["bleu"] == round(BLEU()._compute_score_from_stats(stats).score, 2)
    assert m["bleu"] > corpus_metrics(hyps, refs)["bleu"] + 3  # 13a over all: 65.8
    assert "|tok:13a+zh|" in m["bleu_signature"]
    with pytest.raises(ValueError, match="3 target languages but 4"):
        corpus_metrics(hyps, refs, ["de", "zh", "de"])


def test_script_detection_per_language_and_a_reference_outside_the_script():
    """One Chinese reference of digits only ("2019") must not switch the set to 13a; Japanese
    (kana) and Korean (Hangul) get theirs (MeCab's, or characters where MeCab is missing), and
    romanised text stays 13a."""
    from moe_train.eval.metrics import bleu_tokenizer

    assert bleu_tokenizer("zh", ["我今天去学校。", "2019"]) == "zh"
    assert bleu_tokenizer("ja", ["きょうは がっこうに いきます。", "2019"]) in ("ja-mecab", "char")
    assert bleu_tokenizer("ko", ["오늘 학교에 갑니다.", "2019"]) in ("ko-mecab", "char")
    assert bleu_tokenizer("ko", ["きょうは"]) == "13a"  # Korean script, not kana
    for lang in ("zh", "ja", "ko"):
        assert bleu_tokenizer(lang, ["romanised text only", "2019"]) == "13a"
