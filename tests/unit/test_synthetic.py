"""The synthetic demo corpus: layout, determinism, splits, domain vocabularies, reordering."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from moe_train.data.synthetic import (AMBIGUOUS, DOMAINS, TARGET_LANGS, generate_sentences,
                                      detokenize, generate_synthetic, gloss, tokenize,
                                      translate, vocabulary)
from moe_train.errors import ConfigError

SMALL = dict(num_domains=5, target_langs=("de", "fr"), train_per_domain=150, dev_per_domain=20,
             test_per_domain=20)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    generate_synthetic(out, seed=3, **SMALL)
    return out


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _words(domain: str, pos: str) -> tuple[str, ...]:
    return vocabulary(domain)[pos]


# ------------------------------------------------------------------------------ files
def test_opus_layout_and_manifest(corpus: Path) -> None:
    info = json.loads((corpus / "domains.json").read_text())
    assert [d["name"] for d in info["domains"]] == list(DOMAINS[:5])
    assert info["pairs"] == ["de-en", "en-fr"] and info["source_lang"] == "en"
    for domain in DOMAINS[:5]:
        for pair, lang in (("de-en", "de"), ("en-fr", "fr")):
            for split, n in (("train", 150), ("dev", 20), ("test", 20)):
                src = _lines(corpus / domain / f"{domain}.{pair}.{split}.en")
                tgt = _lines(corpus / domain / f"{domain}.{pair}.{split}.{lang}")
                assert len(src) == len(tgt) == n
                # files hold detokenized text ("word." not "word .")
                assert not any(" ." in line for line in src + tgt)
                assert tgt == [detokenize(translate(tokenize(s), domain, lang)) for s in src]
    assert not (corpus / "news").exists()
    assert not [p for p in corpus.rglob("*") if p.name.endswith(".tmp")]


def test_deterministic_and_seeded(corpus: Path, tmp_path: Path) -> None:
    generate_synthetic(tmp_path / "again", seed=3, **SMALL)
    for path in corpus.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (tmp_path / "again" / path.relative_to(corpus)).read_bytes()
    # a domain's data does not depend on how many other domains are generated
    generate_synthetic(tmp_path / "two", seed=3, **{**SMALL, "num_domains": 2})
    rel = Path("law/law.de-en.train.de")
    assert (tmp_path / "two" / rel).read_bytes() == (corpus / rel).read_bytes()
    generate_synthetic(tmp_path / "other", seed=4, **{**SMALL, "num_domains": 1})
    rel = Path("medical/medical.de-en.train.en")
    assert (tmp_path / "other" / rel).read_bytes() != (corpus / rel).read_bytes()


def test_dev_and_test_disjoint_from_train(corpus: Path) -> None:
    def split(name: str) -> set[str]:
        return {s for d in DOMAINS[:5] for s in _lines(corpus / d / f"{d}.de-en.{name}.en")}

    train, dev, test = split("train"), split("dev"), split("test")
    assert len(train) == 5 * 150 and len(dev) == 5 * 20 and len(test) == 5 * 20
    assert not train & dev and not train & test and not dev & test


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_domains"):
        generate_synthetic(tmp_path, num_domains=len(DOMAINS) + 1)
    with pytest.raises(ConfigError, match="target_langs"):
        generate_synthetic(tmp_path, target_langs=("xx",))
    with pytest.raises(ConfigError, match="train_per_domain"):
        generate_synthetic(tmp_path, train_per_domain=0)
    with pytest.raises(ValueError, match="unknown source word"):
        translate("the zzzz has a report .", "medical", "de")


# ------------------------------------------------------------------------------ domains
def test_vocabulary_size_and_small_domain_overlap(corpus: Path) -> None:
    shared = vocabulary()
    shared_words = {w for words in shared.values() for w in words}
    own = {d: {w for words in vocabulary(d).values() for w in words} for d in DOMAINS}
    five = shared_words.union(*(own[d] for d in DOMAINS[:5]))
    assert 300 <= len(five) <= 600
    assert len(shared_words.union(*own.values())) <= 600
    function_words = {w for p, words in shared.items()
                      if p not in ("noun", "verb", "adj", "ambiguous") for w in words}
    content = {d: {w for s in _lines(corpus / d / f"{d}.de-en.train.en") for w in s.split()}
               - function_words for d in DOMAINS[:5]}
    for a in DOMAINS[:5]:
        for b in DOMAINS[:5]:
            if a != b:
                assert not own[a] & content[b]  # a domain's own words never leak into another
                jaccard = len(content[a] & content[b]) / len(content[a] | content[b])
                assert jaccard < 0.3, (a, b, jaccard)


def test_styles_differ_and_lengths_in_range() -> None:
    mean_words = {}
    for d in DOMAINS:
        lengths = [sum(w not in ".,?" for w in s.split()) for s in generate_sentences(d, 300)]
        assert 5 <= min(lengths) and max(lengths) <= 25
        mean_words[d] = statistics.mean(lengths)
    assert mean_words["law"] > mean_words["subtitles"] + 8
    assert any("?" in s for s in generate_sentences("subtitles", 50))
    assert not any("?" in s for s in generate_sentences("law", 50))


def test_ambiguous_words_translate_per_domain() -> None:
    for lang in TARGET_LANGS:
        for word in AMBIGUOUS:
            senses = {gloss(word, d, lang) for d in DOMAINS}
            assert len(senses) == len(DOMAINS), (word, lang)
    # everything else in a sentence translates the same in every domain
    outs = {d: translate("the case has this report .", d, "de").split() for d in DOMAINS}
    for d in DOMAINS:
        assert [w for i, w in enumerate(outs[d]) if i != 1] == \
            [w for i, w in enumerate(outs["law"]) if i != 1]
    assert len({o[1] for o in outs.values()}) == len(DOMAINS)


# ------------------------------------------------------------------------------ translation
def test_lexicon_has_two_word_entries_and_drops() -> None:
    words = [w for d in DOMAINS[:5] for p in ("noun", "verb", "adj") for w in _words(d, p)]
    two = [w for w in words if len(gloss(w, "medical", "de").split()) == 2]
    assert 0 < len(two) < len(words) // 4
    assert gloss("the", "medical", "cs") == "" and gloss("the", "medical", "de") != ""
    assert len(gloss("does", "it", "fr").split()) == 2 and gloss("does", "it", "de") == ""
    assert translate("why does the record has a part ?", "law", "ja").split()[-1] == "?"


def test_adjective_after_noun_in_fr() -> None:
    adj, noun, verb, noun2 = (_words("medical", "adj")[0], _words("medical", "noun")[0],
                              _words("medical", "verb")[0], _words("medical", "noun")[1])
    src = f"the {adj} {noun} {verb} a {noun2} ."
    assert translate(src, "medical", "fr") == \
        gloss(f"the {noun} {adj} {verb} a {noun2} .", "medical", "fr")
    assert translate(src, "medical", "de") == gloss(src, "medical", "de")  # de keeps it
    assert translate(src, "medical", "fr") != gloss(src, "medical", "fr")


def test_verb_final_subordinate_and_verb_second_in_de() -> None:
    n, v = _words("law", "noun"), _words("law", "verb")
    src = f"the {n[0]} {v[0]} a {n[1]} because this {n[2]} {v[1]} the {n[3]} ."
    assert translate(src, "law", "de") == gloss(
        f"the {n[0]} {v[0]} a {n[1]} because this {n[2]} the {n[3]} {v[1]} .", "law", "de")
    assert translate(src, "law", "fr") == gloss(src, "law", "fr")  # fr keeps SVO
    intro = f"today , the {n[0]} {v[0]} a {n[1]} ."
    assert translate(intro, "law", "de") == gloss(
        f"today , {v[0]} the {n[0]} a {n[1]} .", "law", "de")
    fronted = f"if the {n[0]} {v[0]} a {n[1]} , this {n[2]} {v[1]} the {n[3]} ."
    assert translate(fronted, "law", "de") == gloss(
        f"if the {n[0]} a {n[1]} {v[0]} , {v[1]} this {n[2]} the {n[3]} .", "law", "de")


def test_sov_and_postpositions_in_ja() -> None:
    n, v = _words("it", "noun"), _words("it", "verb")
    src = f"the {n[0]} {v[0]} a {n[1]} with this {n[2]} ."
    assert translate(src, "it", "ja") == gloss(
        f"the {n[0]} a {n[1]} this {n[2]} with {v[0]} .", "it", "ja")


def test_word_by_word_baseline_fails_where_translate_is_exact() -> None:
    rates = {}
    for lang in TARGET_LANGS:
        exact = total = 0
        for d in DOMAINS[:5]:
            for s in generate_sentences(d, 60, seed=1):
                ref, base = translate(s, d, lang), gloss(s, d, lang)
                assert translate(s, d, lang) == ref  # deterministic
                assert sorted(base.split()) == sorted(ref.split())  # same words, other order
                exact, total = exact + (base == ref), total + 1
        rates[lang] = exact / total
    assert max(rates.values()) < 0.7 and statistics.mean(rates.values()) < 0.5, rates


def test_an_empty_split_writes_no_files(tmp_path: Path) -> None:
    """`synth --dev 0 --test 0`: no empty dev / test files (prepare refused them as empty);
    prepare carves its own from train."""
    from moe_train.data.corpus import discover

    generate_synthetic(tmp_path, num_domains=1, train_per_domain=20, dev_per_domain=0,
                       test_per_domain=3)
    names = sorted(p.name for p in (tmp_path / DOMAINS[0]).iterdir())
    assert not [n for n in names if ".dev." in n]
    assert len([n for n in names if ".test." in n]) == 2 and len(names) == 4
    assert discover(tmp_path)  # a corpus prepare reads
