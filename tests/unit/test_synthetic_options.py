"""Generator difficulty options (SynthOptions): the defaults reproduce the original corpus
byte for byte; each knob does what it says; the difficulty report separates easy from hard."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from moe_train.data.synthetic import (AMBIGUITY_ORDER, AMBIGUOUS, DOMAINS, SynthOptions,
                                      generate_sentences, generate_synthetic, shared_vocabulary,
                                      translate, vocabulary)
from moe_train.data.synthetic_grammar import EXTRA_SHARED, MAX_SHARED_WORDS
from moe_train.errors import ConfigError

ORIGINAL_DIGEST = "50107428583f5bedb01576a38d366b6652e2a714ebde24f40c9770260f2a2ced"
"""sha256 of the corpus below as the generator wrote it before SynthOptions existed."""


def _own(domain: str) -> set[str]:
    return {w for words in vocabulary(domain).values() for w in words}


def test_defaults_reproduce_the_original_corpus(tmp_path: Path) -> None:
    generate_synthetic(tmp_path, num_domains=5, target_langs=("de", "ja"), train_per_domain=60,
                       dev_per_domain=5, test_per_domain=5, seed=11)
    h = hashlib.sha256()
    for p in sorted(tmp_path.rglob("*")):
        if p.is_file() and p.name != "domains.json":
            h.update(p.name.encode())
            h.update(p.read_bytes())
    assert h.hexdigest() == ORIGINAL_DIGEST


def test_cue_rate_leaves_a_fraction_without_domain_words() -> None:
    sents = generate_sentences("law", 800, seed=5, options=SynthOptions(cue_rate=0.8))
    cued = [bool(_own("law").intersection(s.split())) for s in sents]
    assert 0.74 <= sum(cued) / len(cued) <= 0.86
    other_domains = set().union(*(_own(d) for d in DOMAINS if d != "law"))
    assert not other_domains.intersection(w for s in sents for w in s.split())
    full = generate_sentences("law", 300, seed=5)
    assert all(_own("law").intersection(s.split()) for s in full)


def test_shared_rate_moves_content_words_to_the_shared_vocabulary() -> None:
    shared = {w for p in ("noun", "verb", "adj") for w in vocabulary()[p]}

    def shared_share(rate: float) -> float:
        words = [w for s in generate_sentences("it", 400, seed=2,
                                               options=SynthOptions(shared_rate=rate))
                 for w in s.split() if w in shared or w in _own("it")]
        return sum(w in shared for w in words) / len(words)

    low, high = shared_share(0.0), shared_share(0.7)
    assert low == 0.0 and high > 0.5


def test_ambiguous_words_translate_by_domain_only_when_asked() -> None:
    sentence = "the system needs the new record ."
    by_domain = {translate(sentence, d, "de", ambiguous=len(AMBIGUITY_ORDER)) for d in DOMAINS}
    assert len(by_domain) == len(DOMAINS)  # system, needs, new and record all change
    default = {translate(sentence, d, "de") for d in DOMAINS}
    assert len(default) == len(DOMAINS)  # only 'record' changes
    assert len({translate(sentence, d, "de", ambiguous=0) for d in DOMAINS}) == 1
    words_changed = {w for w in translate(sentence, "law", "de", 24).split()} - \
        set(translate(sentence, "medical", "de", 24).split())
    assert len(words_changed) >= 4 > len(set(translate(sentence, "law", "de").split()) -
                                          set(translate(sentence, "medical", "de").split()))
    assert AMBIGUITY_ORDER[:len(AMBIGUOUS)] == AMBIGUOUS


@pytest.mark.parametrize("field,value", [("shared_rate", 1.5), ("shared_rate", 1.0), ("ambiguous", 25),
                                         ("ambiguous_rate", -0.1), ("cue_rate", 0.0),
                                         ("shared_words", -1), ("shared_words", 97)])
def test_bad_options_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"synthetic {field}: expected"):
        SynthOptions(**{field: value})


def test_extra_shared_words_join_every_domain_and_translate_by_domain() -> None:
    n = 40
    extra = {w for w, _ in EXTRA_SHARED[:n]}
    assert len({w for w, _ in EXTRA_SHARED}) == MAX_SHARED_WORDS
    assert not extra & set().union(*(_own(d) for d in DOMAINS))  # no domain's own words
    assert extra <= {w for p in ("noun", "verb", "adj") for w in shared_vocabulary(n)[p]}
    assert shared_vocabulary(0) == {p: vocabulary()[p] for p in ("noun", "verb", "adj")}
    opts = SynthOptions(shared_rate=0.7, shared_words=n, ambiguous=24 + n)
    used = {d: {w for s in generate_sentences(d, 300, seed=3, options=opts)
                for w in s.split()} & extra for d in ("law", "it")}
    assert len(used["law"]) > n // 2 and len(used["it"]) > n // 2  # shared across domains
    assert not extra & {w for s in generate_sentences("law", 300, seed=3) for w in s.split()}
    noun = next(w for w, p in EXTRA_SHARED if p == "noun")
    sentence = f"the {noun} needs a plan ."
    assert len({translate(sentence, d, "de", ambiguous=24 + n) for d in DOMAINS}) == len(DOMAINS)
    assert len({translate(sentence, d, "de", ambiguous=4) for d in DOMAINS}) == 1
    with pytest.raises(ConfigError, match=r"ambiguous: expected 0\.\.34 words"):
        SynthOptions(shared_words=10, ambiguous=35)
    assert AMBIGUITY_ORDER[24:24 + n] == tuple(w for w, _ in EXTRA_SHARED[:n])


def test_difficulty_report_separates_easy_from_hard(tmp_path: Path) -> None:
    sizes = dict(num_domains=5, train_per_domain=300, dev_per_domain=10, test_per_domain=40)
    easy = generate_synthetic(tmp_path / "easy", seed=4, report=True, **sizes)
    hard = generate_synthetic(tmp_path / "hard", seed=4, report=True, options=SynthOptions(
        shared_rate=0.5, ambiguous=24, cue_rate=0.85), **sizes)
    e, h = easy["difficulty"], hard["difficulty"]
    assert e["sentences"] == h["sentences"] == 200 and e["held_out_split"] == "test"
    assert e["bow_domain_accuracy"] >= 0.97 > h["bow_domain_accuracy"] >= 0.6
    assert e["wrong_domain_bleu"] > 80 > 60 > h["wrong_domain_bleu"]
    assert hard["options"]["ambiguous"] == 24
    cued = [d["cued_fraction"] for d in hard["domains"]]
    assert all(0.75 <= c <= 0.95 for c in cued) and all(d["cued_fraction"] == 1.0
                                                         for d in easy["domains"])
    assert all(d["ambiguous_token_rate"] > 3 * e_d["ambiguous_token_rate"]
               for d, e_d in zip(hard["domains"], easy["domains"]))
    assert len(hard["domains"][0]["ambiguous_words"]) == 24
