"""sacreBLEU corpus metrics (BLEU, chrF) with their reproducibility signatures."""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Sequence

from sacrebleu.metrics import BLEU, CHRF

from moe_train.errors import DataError

SCRIPT_TOKENIZERS = {"zh": ("zh", r"[\u4e00-\u9fff]"),
                     "ja": ("ja-mecab", r"[\u3040-\u30ff\u4e00-\u9fff]"),
                     "ko": ("ko-mecab", r"[\uac00-\ud7af]")}
"""Target languages whose text has no spaces between words: sacreBLEU's tokenizer for each
(what its command line picks for ``-l xx-zh`` and so on) and the script that needs it."""


def bleu_tokenizer(tgt_lang: str | None, refs: Sequence[str]) -> str:
    """sacreBLEU's tokenizer for references in `tgt_lang`: its own for Chinese, Japanese and
    Korean text in their scripts (Japanese and Korean fall back to characters where MeCab is not
    installed), 13a for everything else (romanised text included). A region or script suffix
    does not hide the language (zh_CN, zh-TW, ZH)."""
    base = re.split(r"[_-]", tgt_lang or "", maxsplit=1)[0].lower()
    name, script = SCRIPT_TOKENIZERS.get(base, ("13a", None))
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
    """The target language of a group of sentences (their BLEU tokenizer's), None when they
    mix targets (13a)."""
    found = set(tgt_langs)
    return found.pop() if len(found) == 1 else None


def corpus_metrics(hyps: Sequence[str], refs: Sequence[str],
                   tgt_lang: str | None = None) -> dict[str, Any]:
    """Corpus BLEU and chrF of `hyps` against one reference each (sacreBLEU defaults; BLEU's
    tokenizer by the target language, `bleu_tokenizer`; the signature records it)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise DataError("no sentences to score")
    bleu, chrf = BLEU(tokenize=bleu_tokenizer(tgt_lang, refs)), CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "sentences": len(hyps),
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}
