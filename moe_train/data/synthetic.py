"""Embedded synthetic multi-domain parallel corpus for demos and tests (nothing is downloaded).

English-like source sentences come from per-domain templates over per-domain pseudo-word
vocabularies (nouns, verbs, adjectives) plus a shared function-word core. The target side is a
deterministic, learnable function of the source (`translate`): a per-language word lexicon (a few
words become two target words or vanish) plus per-language reordering rules. Four shared nouns
("case", "record", "charge", "order") translate differently in every domain, so only a sentence's
context, its domain words, resolves them: this is what makes domain routing pay off.

The vocabularies and lexicons are fixed (independent of the `seed`, which only draws sentences),
so `translate` is a pure function and a domain's data does not depend on which other domains are
generated. Tokens are separated by single spaces (punctuation included).
"""

from __future__ import annotations

import re

import functools
import itertools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from moe_train.errors import ConfigError
from moe_train.utils.atomic import write_json, write_text

DOMAINS = ("medical", "law", "it", "subtitles", "religion", "news", "finance")
SOURCE_LANG = "en"
TARGET_LANGS = ("de", "fr", "es", "cs", "ja")
SPLITS = ("train", "dev", "test")
_LEXICON_SEED = 1234  # fixes vocabularies and lexicons; never the user's seed

# ------------------------------------------------------------------------------- the grammar
# Shared function-word core, by part of speech. Every word has exactly one part of speech, which
# is what lets `translate` parse a sentence without ambiguity.
_CORE: dict[str, tuple[str, ...]] = {
    "det": ("the", "a", "this", "that", "every", "some", "each"),
    "num": ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    "prep": ("in", "on", "with", "for", "from", "under", "after", "before", "near", "without"),
    "sub": ("because", "while", "when", "although", "if", "unless"),
    "conj": ("and", "but"),
    "adv": ("today", "however", "then", "usually", "finally", "now"),
    "qw": ("why", "how", "where"),
    "aux": ("does",),
    "punct": (".", ",", "?"),
}
_SHARED: dict[str, tuple[str, ...]] = {
    "noun": ("system", "report", "group", "time", "result", "member", "part", "plan"),
    "verb": ("has", "needs", "shows", "gets", "uses", "finds"),
    "adj": ("new", "old", "good", "large", "small", "other"),
}
AMBIGUOUS = ("case", "record", "charge", "order")
"""Shared nouns whose translation depends on the domain."""

_DOMAIN_SIZES = {"noun": 28, "verb": 14, "adj": 12}
_SUFFIXES = {
    "noun": {"medical": ("itis", "ase", "oma", "ine", "ol"),
             "law": ("ance", "ure", "or", "ment", "ity"),
             "it": ("ware", "ex", "ix", "ode", "net"),
             "subtitles": ("y", "o", "ie", "a", "ey"),
             "religion": ("im", "ah", "eth", "el", "on"),
             "news": ("ist", "ion", "ard", "age", "ism"),
             "finance": ("et", "und", "ax", "ium", "ent")},
    "verb": ("ates", "ifies", "izes", "ens", "ects"),
    "adj": ("ic", "al", "ous", "ive", "ful"),
}
# Per-language sound inventories (onsets, nuclei, codas) for target pseudo-words.
_SOUNDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "de": (("b", "d", "f", "g", "h", "k", "l", "m", "n", "r", "s", "t", "w", "z", "sch", "st",
            "pf", "kr", "gr", "br"), ("a", "e", "i", "o", "u", "ei", "au", "ie", "ü", "ö"),
           ("", "n", "r", "t", "ch", "ng", "st", "l", "s", "nd")),
    "fr": (("b", "c", "d", "f", "g", "j", "l", "m", "n", "p", "r", "s", "t", "v", "ch", "gr",
            "pl"), ("a", "e", "i", "o", "u", "ou", "ai", "eu", "é", "au", "oi"),
           ("", "", "", "n", "r", "s", "x", "t", "l")),
    "es": (("b", "c", "d", "f", "g", "j", "l", "m", "n", "p", "r", "s", "t", "v", "ll", "ch",
            "br"), ("a", "e", "i", "o", "u", "ia", "ue", "io"), ("", "", "", "n", "s", "r", "l")),
    "cs": (("b", "d", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "č", "ř", "š", "ž",
            "st", "kr", "pr"), ("a", "e", "i", "o", "u", "y", "á", "é", "í", "ů"),
           ("", "", "k", "v", "t", "n", "c", "ch", "š")),
    "ja": (("k", "s", "t", "n", "h", "m", "y", "r", "w", "g", "z", "d", "b", "sh", "ch", "ts"),
           ("a", "i", "u", "e", "o"), ("", "", "", "", "n")),
}


@dataclass(frozen=True)
class _Rules:
    """How one target language orders and words a parsed source sentence."""

    np_order: tuple[str, ...]
    """Order of the noun-phrase slots det, num, adj, noun."""
    postpositions: bool = False
    """PREP NP becomes NP PREP."""
    verb_final: bool = False
    """The verb goes to the end of every clause (SOV)."""
    sub_verb_final: bool = False
    """The verb goes to the end of subordinate clauses."""
    v2: bool = False
    """After a fronted adverb, question word or subordinate clause the verb comes first."""
    drop: tuple[str, ...] = ()
    """Source words with no translation."""
    two_word: tuple[str, ...] = ()
    """Function words that become two target words."""
    question_particle: bool = False
    """'?' is preceded by a question particle."""
    summary: str = ""


_RULES = {
    "de": _Rules(("det", "num", "adj", "noun"), sub_verb_final=True, v2=True, drop=("does",),
                 summary="verb-final in subordinate clauses; verb second after a fronted "
                         "adverb, question word or clause"),
    "fr": _Rules(("det", "num", "noun", "adj"), two_word=("does",),
                 summary="adjectives after the noun; 'does' becomes two words"),
    "es": _Rules(("det", "noun", "adj", "num"), drop=("does",),
                 summary="adjectives and numbers after the noun"),
    "cs": _Rules(("det", "adj", "noun", "num"), sub_verb_final=True, drop=("the", "a", "does"),
                 summary="no articles; numbers after the noun; verb-final in subordinate clauses"),
    "ja": _Rules(("det", "num", "adj", "noun"), postpositions=True, verb_final=True,
                 drop=("the", "a", "does", ","), question_particle=True,
                 summary="verb-final (SOV); postpositions; no articles or commas; question "
                         "particle"),
}


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


@dataclass
class _Grammar:
    """Vocabularies, parts of speech and per-language lexicons (built once, never mutated)."""

    domain_words: dict[str, dict[str, tuple[str, ...]]]
    pos: dict[str, str]
    lexicon: dict[str, dict[str, tuple[str, ...]]]
    """lang -> source word -> target words (ambiguous nouns: see `senses`)."""
    senses: dict[str, dict[tuple[str, str], tuple[str, ...]]] = field(default_factory=dict)
    """lang -> (ambiguous noun, domain) -> target words."""


def _pseudo_word(rng: random.Random, sounds: Sequence[Sequence[str]], syllables: int) -> str:
    onsets, nuclei, codas = sounds
    return "".join(rng.choice(onsets) + rng.choice(nuclei) for _ in range(syllables)) + \
        rng.choice(codas)


@functools.cache
def _grammar() -> _Grammar:
    """Build the fixed vocabularies and lexicons (memoised: a pure function of constants)."""
    rng = random.Random(_LEXICON_SEED)
    pos: dict[str, str] = {w: p for p, words in _CORE.items() for w in words}
    pos.update({w: p for p, words in _SHARED.items() for w in words})
    pos.update({w: "noun" for w in AMBIGUOUS})
    consonants, vowels = "bcdfgklmnprstvz", "aeiou"
    domain_words: dict[str, dict[str, tuple[str, ...]]] = {}
    for domain in DOMAINS:
        domain_words[domain] = {}
        for p, n in _DOMAIN_SIZES.items():
            suffixes = _SUFFIXES[p][domain] if p == "noun" else _SUFFIXES[p]
            words: list[str] = []
            while len(words) < n:
                stem = "".join(rng.choice(consonants) + rng.choice(vowels)
                               for _ in range(rng.choice((1, 2)))) + rng.choice(consonants)
                word = stem + rng.choice(suffixes)
                if word not in pos:
                    pos[word] = p
                    words.append(word)
            domain_words[domain][p] = tuple(words)

    lexicon: dict[str, dict[str, tuple[str, ...]]] = {}
    senses: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {}
    for lang in TARGET_LANGS:
        rules, sounds = _RULES[lang], _SOUNDS[lang]
        lrng = random.Random(f"{_LEXICON_SEED}/{lang}")
        used: set[str] = set()

        def fresh(n_words: int, short: bool = False) -> tuple[str, ...]:
            out = []
            while len(out) < n_words:
                syllables = 1 if short else lrng.choice((1, 2, 2, 3))
                word = _pseudo_word(lrng, sounds, syllables)
                if word not in used:
                    used.add(word)
                    out.append(word)
            return tuple(out)

        lex: dict[str, tuple[str, ...]] = {}
        for word, p in pos.items():  # insertion order: fixed
            if word in AMBIGUOUS:
                continue
            if p == "punct":
                lex[word] = (word,)
            elif word in rules.drop:
                lex[word] = ()
            elif word in rules.two_word or (p in ("noun", "verb", "adj") and lrng.random() < .08):
                lex[word] = fresh(2, short=p in _CORE)
            else:
                lex[word] = fresh(1, short=p in _CORE)  # function words are short
        if rules.question_particle:
            lex["?"] = fresh(1, short=True) + ("?",)
        lexicon[lang] = lex
        senses[lang] = {(w, d): fresh(1) for w in AMBIGUOUS for d in DOMAINS}
    return _Grammar(domain_words=domain_words, pos=pos, lexicon=lexicon, senses=senses)


def vocabulary(domain: str | None = None) -> dict[str, tuple[str, ...]]:
    """Source words by part of speech: a domain's own words, or (None) the shared ones.

    The shared dictionary holds the function-word core, the shared nouns/verbs/adjectives and
    the ambiguous nouns under "ambiguous".
    """
    if domain is None:
        shared = dict(_CORE)
        shared.update(_SHARED)
        shared["ambiguous"] = AMBIGUOUS
        return shared
    _check_domain(domain)
    return dict(_grammar().domain_words[domain])


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown synthetic domain {domain!r}; expected one of {DOMAINS}")


def _check_lang(lang: str) -> None:
    if lang not in TARGET_LANGS:
        raise ValueError(f"unknown synthetic target language {lang!r}; expected one of "
                         f"{TARGET_LANGS}")


# ------------------------------------------------------------------------------- translation
@dataclass
class _Unit:
    """A parsed piece: a noun phrase (slots), a prepositional phrase, or a single word."""

    kind: str
    word: str = ""
    slots: dict[str, list[str]] = field(default_factory=dict)
    prep: str = ""


def _parse(tokens: list[str], pos: dict[str, str]) -> list[_Unit]:
    """Group tokens into units: NP = det [num] adj* noun, PP = prep NP, anything else alone."""
    units: list[_Unit] = []
    i = 0

    def noun_phrase(i: int) -> tuple[_Unit, int]:
        slots: dict[str, list[str]] = {"det": [tokens[i]], "num": [], "adj": [], "noun": []}
        i += 1
        if i < len(tokens) and pos[tokens[i]] == "num":
            slots["num"].append(tokens[i])
            i += 1
        while i < len(tokens) and pos[tokens[i]] == "adj":
            slots["adj"].append(tokens[i])
            i += 1
        if i >= len(tokens) or pos[tokens[i]] != "noun":
            raise ValueError(f"noun phrase without a noun at word {i + 1} of {' '.join(tokens)!r}")
        slots["noun"].append(tokens[i])
        return _Unit("np", slots=slots), i + 1

    while i < len(tokens):
        p = pos[tokens[i]]
        if p == "det":
            unit, i = noun_phrase(i)
        elif p == "prep":
            if i + 1 >= len(tokens) or pos[tokens[i + 1]] != "det":
                raise ValueError(f"preposition without a noun phrase in {' '.join(tokens)!r}")
            np_unit, j = noun_phrase(i + 1)
            unit, i = _Unit("pp", slots=np_unit.slots, prep=tokens[i]), j
        else:
            unit, i = _Unit(tokens[i] if p == "punct" else p, word=tokens[i]), i + 1
        units.append(unit)
    return units


@dataclass
class _Segment:
    kind: str  # "main" or "sub"
    lead: list[_Unit] = field(default_factory=list)
    body: list[_Unit] = field(default_factory=list)
    tail: list[_Unit] = field(default_factory=list)
    fronted: bool = False  # a subordinate clause precedes this main clause


def _segments(units: list[_Unit]) -> list[_Segment]:
    """Split parsed units into clauses: [lead words] body [tail punctuation]."""
    out: list[_Segment] = []
    cur = _Segment("main")
    for u in units:
        if u.kind in ("sub", "conj"):
            out.append(cur)
            cur = _Segment("sub" if u.kind == "sub" else "main", lead=[u])
        elif u.kind == "," and cur.kind == "sub":
            cur.tail.append(u)
            out.append(cur)
            cur = _Segment("main", fronted=True)
        elif u.kind in ("adv", "qw", "aux", ",") and not cur.body:
            cur.lead.append(u)
        elif u.kind in (".", "?"):
            cur.tail.append(u)
        else:
            cur.body.append(u)
    out.append(cur)
    return [s for s in out if s.lead or s.body or s.tail]


def _reorder(seg: _Segment, rules: _Rules) -> list[_Unit]:
    """Apply the language's clause-level verb placement to one segment."""
    verbs = [u for u in seg.body if u.kind == "verb"]
    rest = [u for u in seg.body if u.kind != "verb"]
    body = seg.body
    if rules.verb_final or (seg.kind == "sub" and rules.sub_verb_final):
        body = rest + verbs
    elif rules.v2 and seg.kind == "main" and (
            seg.fronted or any(u.kind in ("adv", "qw") for u in seg.lead)):
        body = verbs + rest
    return seg.lead + body + seg.tail


def _flatten(units: list[_Unit], rules: _Rules | None) -> list[str]:
    """Source words in target order (rules) or in source order (None)."""
    np_order = rules.np_order if rules else ("det", "num", "adj", "noun")
    words: list[str] = []
    for u in units:
        phrase = [w for slot in np_order for w in u.slots.get(slot, [])]
        if u.kind == "np":
            words += phrase
        elif u.kind == "pp":
            words += phrase + [u.prep] if rules and rules.postpositions else [u.prep] + phrase
        else:
            words.append(u.word)
    return words


def _tokens(sentence: str, domain: str, lang: str) -> tuple[list[str], _Grammar]:
    _check_domain(domain)
    _check_lang(lang)
    g = _grammar()
    tokens = sentence.split()
    for w in tokens:
        if w not in g.pos:
            raise ValueError(f"unknown source word {w!r} in {sentence!r}")
    return tokens, g


def _gloss_words(words: list[str], g: _Grammar, domain: str, lang: str) -> str:
    lex, senses = g.lexicon[lang], g.senses[lang]
    out: list[str] = []
    for w in words:
        out += senses[(w, domain)] if w in AMBIGUOUS else lex[w]
    return " ".join(out)


def translate(sentence: str, domain: str, lang: str) -> str:
    """The reference translation of a generated source sentence into pseudo-language `lang`."""
    tokens, g = _tokens(sentence, domain, lang)
    rules = _RULES[lang]
    units: list[_Unit] = []
    for seg in _segments(_parse(tokens, g.pos)):
        units += _reorder(seg, rules)
    return _gloss_words(_flatten(units, rules), g, domain, lang)


def gloss(sentence: str, domain: str, lang: str) -> str:
    """Word-by-word lexicon translation without any reordering (the trivial baseline)."""
    tokens, g = _tokens(sentence, domain, lang)
    return _gloss_words(tokens, g, domain, lang)


# ------------------------------------------------------------------------------- generation
@functools.cache
def _zipf_cum_weights(n: int) -> tuple[float, ...]:
    """Cumulative Zipf-like weights 1 / rank^0.7: some domain words are common, most rare."""
    return tuple(itertools.accumulate(1.0 / (r + 1) ** 0.7 for r in range(n)))


def _zipf_choice(rng: random.Random, words: Sequence[str]) -> str:
    return rng.choices(words, cum_weights=_zipf_cum_weights(len(words)))[0]


def _sentence(rng: random.Random, domain: str, g: _Grammar) -> list[str]:
    """One source sentence (tokens) in the domain's style; may violate its length range."""
    style, own = _STYLES[domain], g.domain_words[domain]

    def pick(p: str, p_shared: float) -> str:
        return rng.choice(_SHARED[p]) if rng.random() < p_shared else _zipf_choice(rng, own[p])

    def noun_phrase() -> list[str]:
        words = [rng.choice(_CORE["det"])]
        if rng.random() < style.p_num:
            words.append(rng.choice(_CORE["num"]))
        n_adj = rng.randint(1, style.max_adj) if rng.random() < style.p_adj else 0
        for _ in range(n_adj):
            adj = pick("adj", .25)
            if adj not in words:
                words.append(adj)
        words.append(rng.choice(AMBIGUOUS) if rng.random() < .12 else pick("noun", .15))
        return words

    pieces = {
        "S": lambda: noun_phrase() + [pick("verb", .2)] + noun_phrase(),
        "I": lambda: [pick("verb", .2)] + noun_phrase(),
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


def generate_sentences(domain: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct source sentences of `domain` (each with at least one domain word)."""
    _check_domain(domain)
    g, style = _grammar(), _STYLES[domain]
    rng = random.Random(f"{seed}/{domain}")
    own = {w for words in g.domain_words[domain].values() for w in words}
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        tokens = _sentence(rng, domain, g)
        n_words = sum(g.pos[w] != "punct" for w in tokens)
        if not style.min_words <= n_words <= style.max_words or not own.intersection(tokens):
            continue
        text = " ".join(tokens)
        if text not in seen:
            seen.add(text)
            out.append(text)
    if len(out) < n:
        raise ConfigError(f"synthetic: could draw only {len(out)} distinct {domain} sentences, "
                          f"{n} asked; lower the per-domain sizes")
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


def generate_synthetic(out_dir: str | os.PathLike, num_domains: int = 5,
                       target_langs: Sequence[str] = ("de",), train_per_domain: int = 3000,
                       dev_per_domain: int = 100, test_per_domain: int = 100,
                       seed: int = 0) -> dict[str, Any]:
    """Write the corpus in OPUS layout ``{out_dir}/{domain}/{domain}.{l1}-{l2}.{split}.{lang}``.

    Also writes ``{out_dir}/domains.json`` (last, so its presence means the corpus is complete)
    and returns its content. Dev and test sentences never occur in train.
    """
    if not 1 <= num_domains <= len(DOMAINS):
        raise ConfigError(f"synthetic num_domains: expected 1..{len(DOMAINS)}, got {num_domains}")
    langs = list(dict.fromkeys(target_langs))
    if not langs or any(lang not in TARGET_LANGS for lang in langs):
        raise ConfigError(f"synthetic target_langs: expected some of {', '.join(TARGET_LANGS)}, "
                          f"got {list(target_langs)!r}")
    sizes = {"train": train_per_domain, "dev": dev_per_domain, "test": test_per_domain}
    for split, n in sizes.items():
        if n < 0 or (split == "train" and n == 0):
            raise ConfigError(f"synthetic {split}_per_domain: expected a "
                              f"{'positive' if split == 'train' else 'non-negative'} integer, "
                              f"got {n}")
    out = Path(out_dir)
    g = _grammar()
    facts: list[dict[str, Any]] = []
    all_types: set[str] = set()
    for domain in DOMAINS[:num_domains]:
        sents = generate_sentences(domain, sum(sizes.values()), seed)
        split_sents = {"train": sents[:train_per_domain],
                       "dev": sents[train_per_domain:train_per_domain + dev_per_domain],
                       "test": sents[train_per_domain + dev_per_domain:]}
        for lang in langs:
            pair = pair_name(SOURCE_LANG, lang)
            for split, lines in split_sents.items():
                stem = out / domain / f"{domain}.{pair}.{split}"
                write_text(f"{stem}.{SOURCE_LANG}", "".join(f"{detokenize(s)}\n" for s in lines))
                write_text(f"{stem}.{lang}", "".join(
                    f"{detokenize(translate(s, domain, lang))}\n" for s in lines))
        types = {w for s in sents for w in s.split()}
        all_types |= types
        train_words = [len(s.split()) for s in split_sents["train"]]
        style = _STYLES[domain]
        facts.append({
            "name": domain, "sizes": sizes, "src_word_types": len(types),
            "mean_src_tokens": round(sum(train_words) / len(train_words), 2),
            "min_words": style.min_words, "max_words": style.max_words,
            "templates": sorted(style.templates),
            "ambiguous_words": {w: {lang: " ".join(g.senses[lang][(w, domain)]) for lang in langs}
                                for w in AMBIGUOUS}})
    info = {"generator": "moe_train.data.synthetic", "seed": seed, "source_lang": SOURCE_LANG,
            "target_langs": langs, "pairs": [pair_name(SOURCE_LANG, lang) for lang in langs],
            "domains": facts, "src_word_types": len(all_types),
            "reordering": {lang: _RULES[lang].summary for lang in langs}}
    write_json(out / "domains.json", info)
    return info
