"""The fixed language of the synthetic corpus: vocabularies, lexicons and translation rules.

English-like source words come in a shared function-word core, shared content words (nouns,
verbs, adjectives) and per-domain pseudo-word vocabularies. The target side is a deterministic,
learnable function of the source (`translate`): a per-language word lexicon (a few words become
two target words or vanish) plus per-language reordering rules. Some shared words translate
differently in every domain (`AMBIGUITY_ORDER`, the first ``ambiguous`` of them; by default the
four nouns of `AMBIGUOUS`), so only a sentence's context, its domain words, resolves them. A
corpus may enlarge the shared vocabulary with up to `MAX_SHARED_WORDS` extra words
(`EXTRA_SHARED`), which can be made ambiguous too: more lexicon for a model to learn per domain.

Everything here is independent of any seed (`_LEXICON_SEED` fixes it), so `translate` is a pure
function and a domain's data does not depend on which other domains are generated.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Sequence

DOMAINS = ("medical", "law", "it", "subtitles", "religion", "news", "finance")
SOURCE_LANG = "en"
TARGET_LANGS = ("de", "fr", "es", "cs", "ja")
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
"""Shared nouns whose translation depends on the domain (the default ambiguous words)."""
MAX_SHARED_WORDS = 96
"""Size of the pool of extra shared content words (`extra_shared_words`)."""
_EXTRA_POS = ("noun", "noun", "verb", "adj")
"""Parts of speech of the extra shared words, in turn: half nouns, a quarter verbs, adjectives."""
_EXTRA_SUFFIXES = {"noun": ("an", "in", "up", "ack"), "verb": ("ips", "ogs", "ams"),
                   "adj": ("ish", "esk")}
"""Suffixes no domain uses, so an extra shared word's spelling names no domain."""


def _extra_shared() -> tuple[tuple[str, str], ...]:
    """The fixed pool of extra shared content words, (word, part of speech) in pool order.

    Drawn from their own random stream, so the default vocabulary and lexicons are the same
    with or without them."""
    rng = random.Random(f"{_LEXICON_SEED}/shared")
    taken = {w for table in (_CORE, _SHARED) for words in table.values() for w in words}
    taken.update(AMBIGUOUS)
    out: list[tuple[str, str]] = []
    while len(out) < MAX_SHARED_WORDS:
        p = _EXTRA_POS[len(out) % len(_EXTRA_POS)]
        word = "".join(rng.choice(s) for s in ("bdfgklmnprstvz", "aeiou", "bdfgklmnprstvz")) + \
            rng.choice(_EXTRA_SUFFIXES[p])
        if word not in taken:
            taken.add(word)
            out.append((word, p))
    return tuple(out)


EXTRA_SHARED = _extra_shared()
"""Extra shared content words a corpus may add to the shared vocabulary: the first
``shared_words`` of these (`SynthOptions.shared_words`)."""
AMBIGUITY_ORDER = AMBIGUOUS + _SHARED["noun"] + _SHARED["verb"] + _SHARED["adj"] + \
    tuple(w for w, _ in EXTRA_SHARED)
"""Words made domain-dependent by a corpus with ``ambiguous = n``: the first n of these (the 24
built-in shared words, then the extra ones)."""
BUILTIN_AMBIGUOUS = len(AMBIGUITY_ORDER) - MAX_SHARED_WORDS
"""How many words of AMBIGUITY_ORDER belong to the built-in shared vocabulary (24)."""


@functools.cache
def shared_vocabulary(shared_words: int = 0) -> dict[str, tuple[str, ...]]:
    """Shared nouns, verbs and adjectives of a corpus with `shared_words` extra shared words."""
    out = dict(_SHARED)
    for word, p in EXTRA_SHARED[:shared_words]:
        out[p] += (word,)
    return out


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


@dataclass
class _Grammar:
    """Vocabularies, parts of speech and per-language lexicons (built once, never mutated)."""

    domain_words: dict[str, dict[str, tuple[str, ...]]]
    pos: dict[str, str]
    lexicon: dict[str, dict[str, tuple[str, ...]]]
    """lang -> source word -> target words (of words that are not ambiguous)."""
    senses: dict[str, dict[tuple[str, str], tuple[str, ...]]] = field(default_factory=dict)
    """lang -> (word of AMBIGUITY_ORDER, domain) -> target words when the word is ambiguous."""


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
        # Later words of AMBIGUITY_ORDER get their senses after everything else, so the
        # default corpus's lexicon does not depend on how many words could be ambiguous.
        senses[lang].update({(w, d): fresh(1) for w in AMBIGUITY_ORDER[len(AMBIGUOUS):]
                             for d in DOMAINS})
        for w in AMBIGUOUS:  # their translation when a corpus makes fewer words ambiguous
            lex[w] = senses[lang][(w, DOMAINS[0])]
        # The extra shared words come last for the same reason.
        for w, p in EXTRA_SHARED:
            lex[w] = fresh(2 if lrng.random() < .08 else 1)
        senses[lang].update({(w, d): fresh(1) for w, _ in EXTRA_SHARED for d in DOMAINS})
    clash = pos.keys() & dict(EXTRA_SHARED).keys()
    assert not clash, f"extra shared words that are already words: {sorted(clash)}"
    pos.update(EXTRA_SHARED)
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


def ambiguous_words(ambiguous: int = len(AMBIGUOUS)) -> frozenset[str]:
    """The words whose translation depends on the domain in a corpus made with `ambiguous`."""
    if not 0 <= ambiguous <= len(AMBIGUITY_ORDER):
        raise ValueError(f"ambiguous: expected 0..{len(AMBIGUITY_ORDER)} words, got {ambiguous}")
    return frozenset(AMBIGUITY_ORDER[:ambiguous])


def _gloss_words(words: list[str], g: _Grammar, domain: str, lang: str, ambiguous: int) -> str:
    lex, senses, by_domain = g.lexicon[lang], g.senses[lang], ambiguous_words(ambiguous)
    out: list[str] = []
    for w in words:
        out += senses[(w, domain)] if w in by_domain else lex[w]
    return " ".join(out)


def translate(sentence: str, domain: str, lang: str, ambiguous: int = len(AMBIGUOUS)) -> str:
    """The reference translation of a generated source sentence into pseudo-language `lang`,
    the first `ambiguous` words of AMBIGUITY_ORDER translated by `domain`."""
    tokens, g = _tokens(sentence, domain, lang)
    rules = _RULES[lang]
    units: list[_Unit] = []
    for seg in _segments(_parse(tokens, g.pos)):
        units += _reorder(seg, rules)
    return _gloss_words(_flatten(units, rules), g, domain, lang, ambiguous)


def gloss(sentence: str, domain: str, lang: str, ambiguous: int = len(AMBIGUOUS)) -> str:
    """Word-by-word lexicon translation without any reordering (the trivial baseline)."""
    tokens, g = _tokens(sentence, domain, lang)
    return _gloss_words(tokens, g, domain, lang, ambiguous)
