"""sacreBLEU corpus metrics (BLEU, chrF) with their reproducibility signatures."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Any, Iterable, Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from moe_train.errors import DataError

SCRIPT_TOKENIZERS = {"zh": ("zh", r"[\u4e00-\u9fff]"),
                     "ja": ("ja-mecab", r"[\u3040-\u30ff\u4e00-\u9fff]"),
                     "ko": ("ko-mecab", r"[\uac00-\ud7af]")}
"""Target languages whose text has no spaces between words: sacreBLEU's tokenizer for each
(what its command line picks for ``-l xx-zh`` and so on) and the script that needs it."""


LANGUAGE_ALIASES = {"zho": "zh", "cmn": "zh", "yue": "zh", "jpn": "ja", "kor": "ko"}
"""Three-letter codes (FLORES' zho_Hans, jpn_Jpan, ...) of the languages in SCRIPT_TOKENIZERS."""


def base_language(code: str | None) -> str:
    """The language of a code, without region or script (zh_CN, zh-TW, ZH, zho_Hans: zh)."""
    base = re.split(r"[_-]", code or "", maxsplit=1)[0].lower()
    return LANGUAGE_ALIASES.get(base, base)


def bleu_tokenizer(tgt_lang: str | None, refs: Sequence[str]) -> str:
    """sacreBLEU's tokenizer for references in `tgt_lang`: its own for Chinese, Japanese and
    Korean text in their scripts (Japanese and Korean fall back to characters where MeCab is not
    installed), 13a for everything else (romanised text included). A region or script suffix
    does not hide the language (`base_language`)."""
    name, script = SCRIPT_TOKENIZERS.get(base_language(tgt_lang), ("13a", None))
    if script is None or not any(re.search(script, r) for r in refs):
        return "13a"
    return name if not name.endswith("mecab") or _installed(name) else "char"


@functools.lru_cache(maxsize=None)
def _installed(tokenizer: str) -> bool:
    """Whether sacreBLEU can build `tokenizer` here (MeCab's come with sacrebleu[ja] / [ko])."""
    try:
        BLEU(tokenize=tokenizer)
    except (RuntimeError, ImportError):
        return False
    return True


def group_target(tgt_langs: Iterable[str]) -> str | None:
    """The target language of a group of sentences (`base_language`), None when they mix
    languages."""
    found = {base_language(code) for code in tgt_langs}
    return found.pop() if len(found) == 1 else None


def bleu_statistics(hyps: Sequence[str], refs: Sequence[str],
                    tgt_langs: Sequence[str | None]) -> tuple[np.ndarray, str]:
    """Per-sentence BLEU sufficient statistics (N x 10 at 4-grams: lengths, n-gram matches and
    totals), each sentence tokenized for its own target language (`bleu_tokenizer` on the
    references of that language), and sacreBLEU's signature, whose tokenizer field joins the
    names by "+" when the sentences needed several. The counts add up over sentences, so a group that mixes
    targets (en-de with en-zh) gets one corpus BLEU in which neither side is mis-tokenized
    (13a over unsegmented Chinese would count each sentence as a word or two)."""
    by_lang: dict[str, list[int]] = defaultdict(list)
    for i, lang in enumerate(tgt_langs):
        by_lang[base_language(lang)].append(i)
    by_tokenizer: dict[str, list[int]] = defaultdict(list)
    for lang, ids in by_lang.items():
        by_tokenizer[bleu_tokenizer(lang, [refs[i] for i in ids])].extend(ids)
    if not by_tokenizer:
        raise DataError("no sentences to score")
    stats_NS: np.ndarray | None = None
    for name, ids in sorted(by_tokenizer.items()):
        bleu = BLEU(tokenize=name)
        part = np.asarray(bleu._extract_corpus_statistics([hyps[i] for i in ids],
                                                          [[refs[i] for i in ids]]), dtype=float)
        if stats_NS is None:
            stats_NS = np.zeros((len(hyps), part.shape[1]))
        stats_NS[ids] = part
    signature = re.sub(r"tok:[^|]+", "tok:" + "+".join(sorted(by_tokenizer)),
                       str(bleu.get_signature()))
    return stats_NS, signature


def per_sentence(tgt_lang: str | Sequence[str | None] | None, n: int) -> Sequence[str | None]:
    """`tgt_lang` as one target language per sentence of `n` (one for all, or one each)."""
    langs = [tgt_lang] * n if tgt_lang is None or isinstance(tgt_lang, str) else tgt_lang
    if len(langs) != n:
        raise ValueError(f"{len(langs)} target languages but {n} references")
    return langs


def corpus_metrics(hyps: Sequence[str], refs: Sequence[str],
                   tgt_lang: str | Sequence[str | None] | None = None) -> dict[str, Any]:
    """Corpus BLEU and chrF of `hyps` against one reference each (sacreBLEU defaults; BLEU's
    tokenizer by the target language, `tgt_lang`: one for all sentences or one per sentence,
    see `bleu_statistics`; the signature records it)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise DataError("no sentences to score")
    stats_NS, signature = bleu_statistics(hyps, refs, per_sentence(tgt_lang, len(refs)))
    bleu = BLEU()._compute_score_from_stats(list(stats_NS.sum(axis=0)))
    chrf = CHRF()
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {"bleu": round(bleu.score, 2), "chrf": round(c.score, 2), "sentences": len(hyps),
            "bleu_signature": signature,
            "chrf_signature": str(chrf.get_signature())}
