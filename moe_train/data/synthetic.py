"""Embedded synthetic multi-domain parallel corpus for demos and tests (nothing is downloaded).

Source sentences come from per-domain templates (`_STYLES`) over the fixed language of
`synthetic_grammar`; references are its `translate`. The `seed` only draws sentences. How much
a sentence's domain matters is set by `SynthOptions`: how often content words come from the
shared vocabulary, how many shared words translate by domain, how often those appear, and which
fraction of sentences carries a domain cue (a word of the domain's own vocabulary) at all. The
defaults reproduce the original corpus exactly. Tokens are separated by single spaces
(punctuation included).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from moe_train.data.synthetic_grammar import (AMBIGUITY_ORDER, AMBIGUOUS, BUILTIN_AMBIGUOUS,
                                              DOMAINS, MAX_SHARED_WORDS, SOURCE_LANG,
                                              TARGET_LANGS, _CORE, _RULES, _Grammar,
                                              _check_domain, _grammar, ambiguous_words, gloss,
                                              shared_vocabulary, translate, vocabulary)
from moe_train.errors import ConfigError
from moe_train.utils.atomic import write_json, write_text

__all__ = ["AMBIGUITY_ORDER", "AMBIGUOUS", "DOMAINS", "SOURCE_LANG", "SPLITS", "TARGET_LANGS",
           "PRESETS", "SynthOptions", "detokenize", "generate_sentences", "generate_synthetic",
           "gloss", "pair_name", "shared_vocabulary", "tokenize", "translate", "vocabulary"]

SPLITS = ("train", "dev", "test")
_SHARED_RATES = {"noun": .15, "verb": .2, "adj": .25}
"""Default probability that a content word comes from the shared vocabulary."""


@dataclass(frozen=True)
class SynthOptions:
    """How much domain knowledge the corpus demands (defaults: the original corpus)."""

    shared_rate: float | None = None
    """Probability that a noun, verb or adjective comes from the shared vocabulary instead of
    the domain's own (None: 0.15 / 0.2 / 0.25 by part of speech)."""
    ambiguous: int = len(AMBIGUOUS)
    """How many shared words translate differently in every domain: the first n of
    AMBIGUITY_ORDER (4 ambiguous nouns, then the shared nouns, verbs, adjectives, then the extra
    shared words; at most 24 + shared_words)."""
    ambiguous_rate: float = 0.12
    """Probability that a noun slot holds one of the four ambiguous nouns of AMBIGUOUS."""
    cue_rate: float = 1.0
    """Fraction of sentences with at least one word of their domain's own vocabulary; the
    others use shared words only (their domain shows only in their shape)."""
    shared_words: int = 0
    """Extra shared content words (the first n of synthetic_grammar.EXTRA_SHARED: half nouns,
    a quarter verbs, a quarter adjectives) beside the 24 built-in ones; with ``ambiguous`` up
    to 24 + n, each a word whose translation a model must learn per domain."""

    def __post_init__(self) -> None:
        def expect(ok: bool, name: str, what: str, value: Any) -> None:
            if not ok:
                raise ConfigError(f"synthetic {name}: expected {what}, got {value!r}")

        if self.shared_rate is not None:
            expect(0 <= self.shared_rate < 1, "shared_rate", "a probability in [0, 1) (at 1 no "
                   "sentence could carry its domain's own words)", self.shared_rate)
        expect(0 <= self.shared_words <= MAX_SHARED_WORDS, "shared_words",
               f"0..{MAX_SHARED_WORDS} words", self.shared_words)
        most = BUILTIN_AMBIGUOUS + max(0, min(self.shared_words, MAX_SHARED_WORDS))
        expect(0 <= self.ambiguous <= most, "ambiguous",
               f"0..{most} words (24 + shared_words)", self.ambiguous)
        expect(0 <= self.ambiguous_rate <= 1, "ambiguous_rate", "a probability in [0, 1]",
               self.ambiguous_rate)
        expect(0 < self.cue_rate <= 1, "cue_rate", "a fraction in (0, 1]", self.cue_rate)

    def p_shared(self, pos: str) -> float:
        return _SHARED_RATES[pos] if self.shared_rate is None else self.shared_rate


PRESETS = {
    "default": SynthOptions(),
    "domain-matters": SynthOptions(shared_rate=0.5, ambiguous=24, cue_rate=0.95),
}
"""Named option sets. domain-matters (the MoA recipe's corpus): half the content words shared,
24 shared words translated by domain, 5% of sentences without a domain word; a bag-of-words
classifier still finds the domain ~98% of the time, and a perfect translation made for the
wrong domain scores ~40 BLEU."""


@dataclass(frozen=True)
class _Style:
    """Sentence shapes of one domain."""

    min_words: int
    max_words: int
    templates: dict[str, float]
    p_adj: float = 0.35
    max_adj: int = 1
    p_num: float = 0.1
    p_extra_pp: float = 0.3


_STYLES = {
    "medical": _Style(7, 18, {"simple": .25, "pp": .35, "sub": .25, "coord": .15}, .45, 2, .2),
    "law": _Style(14, 25, {"pp": .15, "sub": .4, "subfirst": .2, "intro": .25}, .5, 2, .1, .6),
    "it": _Style(5, 16, {"imperative": .4, "ifthen": .25, "simple": .2, "pp": .15}, .35, 1, .1),
    "subtitles": _Style(5, 10, {"simple": .45, "question": .35, "intro": .2}, .15, 1, .05, 0.),
    "religion": _Style(8, 20, {"coord": .35, "pp": .3, "intro": .2, "sub": .15}, .4, 2, .1),
    "news": _Style(10, 22, {"intro": .3, "pp": .3, "sub": .25, "coord": .15}, .35, 2, .3, .4),
    "finance": _Style(8, 20, {"pp": .35, "sub": .25, "simple": .2, "intro": .2}, .3, 1, .45),
}

# Template -> sequence of pieces: "S" a clause NP V NP, "I" an imperative V NP, "PP" PREP NP,
# a trailing "?" marks an optional piece, other names draw a word of that part of speech.
_TEMPLATES = {
    "simple": ("S", "."),
    "pp": ("S", "PP", "PP?", "."),
    "sub": ("S", "sub", "S", "PP?", "."),
    "subfirst": ("sub", "S", ",", "S", "PP?", "."),
    "ifthen": ("sub", "S", ",", "I", "PP?", "."),
    "coord": ("S", "conj", "S", "."),
    "intro": ("adv", ",", "S", "PP?", "."),
    "imperative": ("I", "PP", "PP?", "."),
    "question": ("qw", "aux", "S", "?"),
}



@functools.cache
def _zipf_cum_weights(n: int) -> tuple[float, ...]:
    """Cumulative Zipf-like weights 1 / rank^0.7: some domain words are common, most rare."""
    return tuple(itertools.accumulate(1.0 / (r + 1) ** 0.7 for r in range(n)))


def _zipf_choice(rng: random.Random, words: Sequence[str]) -> str:
    return rng.choices(words, cum_weights=_zipf_cum_weights(len(words)))[0]


def _sentence(rng: random.Random, domain: str, g: _Grammar, opts: SynthOptions,
              cued: bool = True) -> list[str]:
    """One source sentence (tokens) in the domain's style; may violate its length range.
    An uncued sentence draws every content word from the shared vocabulary."""
    style, own = _STYLES[domain], g.domain_words[domain]
    shared = shared_vocabulary(opts.shared_words)

    def pick(p: str) -> str:
        p_shared = opts.p_shared(p) if cued else 1.0
        return rng.choice(shared[p]) if rng.random() < p_shared else _zipf_choice(rng, own[p])

    def noun_phrase() -> list[str]:
        words = [rng.choice(_CORE["det"])]
        if rng.random() < style.p_num:
            words.append(rng.choice(_CORE["num"]))
        n_adj = rng.randint(1, style.max_adj) if rng.random() < style.p_adj else 0
        for _ in range(n_adj):
            adj = pick("adj")
            if adj not in words:
                words.append(adj)
        words.append(rng.choice(AMBIGUOUS) if rng.random() < opts.ambiguous_rate
                     else pick("noun"))
        return words

    pieces = {
        "S": lambda: noun_phrase() + [pick("verb")] + noun_phrase(),
        "I": lambda: [pick("verb")] + noun_phrase(),
        "PP": lambda: [rng.choice(_CORE["prep"])] + noun_phrase(),
    }
    names, weights = zip(*style.templates.items())
    out: list[str] = []
    for piece in _TEMPLATES[rng.choices(names, weights=weights)[0]]:
        if piece.endswith("?") and len(piece) > 1:  # optional piece
            if rng.random() >= style.p_extra_pp:
                continue
            piece = piece[:-1]
        if piece in pieces:
            out += pieces[piece]()
        elif piece in _CORE:
            out.append(rng.choice(_CORE[piece]))
        else:
            out.append(piece)
    return out


def generate_sentences(domain: str, n: int, seed: int = 0,
                       options: SynthOptions = SynthOptions()) -> list[str]:
    """`n` distinct source sentences of `domain`: a fraction ``options.cue_rate`` (drawn per
    sentence) with at least one word of the domain's own vocabulary, the others with none."""
    _check_domain(domain)
    g, style = _grammar(), _STYLES[domain]
    rng = random.Random(f"{seed}/{domain}")
    own = {w for words in g.domain_words[domain].values() for w in words}
    seen: set[str] = set()
    out: list[str] = []
    attempts = 50 * n + 1000
    while len(out) < n and attempts > 0:
        cued = options.cue_rate >= 1 or rng.random() < options.cue_rate
        while attempts > 0:
            attempts -= 1
            tokens = _sentence(rng, domain, g, options, cued)
            n_words = sum(g.pos[w] != "punct" for w in tokens)
            if not style.min_words <= n_words <= style.max_words or \
                    (cued and not own.intersection(tokens)):
                continue
            text = " ".join(tokens)
            if text not in seen:
                seen.add(text)
                out.append(text)
                break
    if len(out) < n:
        raise ConfigError(f"synthetic: could draw only {len(out)} distinct {domain} sentences, "
                          f"{n} asked; lower the per-domain sizes or raise cue_rate")
    return out


def pair_name(src: str, tgt: str) -> str:
    """OPUS pair name: the two languages in alphabetical order (de-en, en-fr)."""
    return "-".join(sorted((src, tgt)))


_DETOK_RE = re.compile(r" ([.,;:?!])")
_TOK_RE = re.compile(r"(?<=\S)([.,;:?!])")


def detokenize(sentence: str) -> str:
    """Attach punctuation to the preceding word, as real (detokenized) text is written."""
    return _DETOK_RE.sub(r"\1", sentence)


def tokenize(sentence: str) -> str:
    """Inverse of `detokenize`: split punctuation off the preceding word."""
    return _TOK_RE.sub(r" \1", sentence)


def check_counts(num_domains: int, target_langs: Sequence[str], sizes: dict[str, int]
                 ) -> list[str]:
    """The domain count, target languages (returned without repeats) and sentences per domain
    and split ({split: n}) of a corpus, checked."""
    if not 1 <= num_domains <= len(DOMAINS):
        raise ConfigError(f"synthetic num_domains: expected 1..{len(DOMAINS)}, got {num_domains}")
    langs = list(dict.fromkeys(target_langs))
    if not langs or any(lang not in TARGET_LANGS for lang in langs):
        raise ConfigError(f"synthetic target_langs: expected some of {', '.join(TARGET_LANGS)}, "
                          f"got {list(target_langs)!r}")
    for split, n in sizes.items():
        if n < 0 or (split == "train" and n == 0):
            raise ConfigError(f"synthetic {split}_per_domain: expected a "
                              f"{'positive' if split == 'train' else 'non-negative'} integer, "
                              f"got {n}")
    return langs


def generate_synthetic(out_dir: str | os.PathLike, num_domains: int = 5,
                       target_langs: Sequence[str] = ("de",), train_per_domain: int = 3000,
                       dev_per_domain: int = 100, test_per_domain: int = 100,
                       seed: int = 0, options: SynthOptions = SynthOptions(),
                       report: bool = False) -> dict[str, Any]:
    """Write the corpus in OPUS layout ``{out_dir}/{domain}/{domain}.{l1}-{l2}.{split}.{lang}``.

    Also writes ``{out_dir}/domains.json`` (last, so its presence means the corpus is complete)
    and returns its content; `report` adds the corpus's difficulty (synthetic_report) to it.
    A domain's dev and test sentences never occur in its train split (a cue-less sentence may
    occur in another domain, translated by that domain).
    """
    sizes = {"train": train_per_domain, "dev": dev_per_domain, "test": test_per_domain}
    langs = check_counts(num_domains, target_langs, sizes)
    out = Path(out_dir)
    g = _grammar()
    ambiguous = ambiguous_words(options.ambiguous)
    facts: list[dict[str, Any]] = []
    all_types: set[str] = set()
    for domain in DOMAINS[:num_domains]:
        sents = generate_sentences(domain, sum(sizes.values()), seed, options)
        split_sents = {"train": sents[:train_per_domain],
                       "dev": sents[train_per_domain:train_per_domain + dev_per_domain],
                       "test": sents[train_per_domain + dev_per_domain:]}
        for lang in langs:
            pair = pair_name(SOURCE_LANG, lang)
            for split, lines in split_sents.items():
                if not lines:  # no empty files: prepare carves a missing dev / test from train
                    continue
                stem = out / domain / f"{domain}.{pair}.{split}"
                write_text(f"{stem}.{SOURCE_LANG}", "".join(f"{detokenize(s)}\n" for s in lines))
                write_text(f"{stem}.{lang}", "".join(
                    f"{detokenize(translate(s, domain, lang, options.ambiguous))}\n"
                    for s in lines))
        types = {w for s in sents for w in s.split()}
        all_types |= types
        train_words = [len(s.split()) for s in split_sents["train"]]
        style = _STYLES[domain]
        own = {w for words in g.domain_words[domain].values() for w in words}
        tokens = [s.split() for s in sents]
        facts.append({
            "name": domain, "sizes": sizes, "src_word_types": len(types),
            "mean_src_tokens": round(sum(train_words) / len(train_words), 2),
            "min_words": style.min_words, "max_words": style.max_words,
            "templates": sorted(style.templates),
            "cued_fraction": round(sum(bool(own.intersection(t)) for t in tokens) / len(sents), 4),
            "ambiguous_token_rate": round(sum(w in ambiguous for t in tokens for w in t)
                                          / sum(map(len, tokens)), 4),
            "ambiguous_words": {w: {lang: " ".join(g.senses[lang][(w, domain)]) for lang in langs}
                                for w in AMBIGUITY_ORDER if w in ambiguous}})
    info = {"generator": "moe_train.data.synthetic", "seed": seed, "source_lang": SOURCE_LANG,
            "target_langs": langs, "pairs": [pair_name(SOURCE_LANG, lang) for lang in langs],
            "options": dataclasses.asdict(options), "domains": facts,
            "src_word_types": len(all_types),
            "reordering": {lang: _RULES[lang].summary for lang in langs}}
    if report:
        from moe_train.data.synthetic_report import difficulty

        info["difficulty"] = difficulty(out, [f["name"] for f in facts], langs[0],
                                        options.ambiguous)
    write_json(out / "domains.json", info)
    return info