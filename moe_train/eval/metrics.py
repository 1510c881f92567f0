"""sacreBLEU corpus metrics (BLEU, chrF) with their reproducibility signatures."""

from __future__ import annotations

from typing import Any, Sequence

from sacrebleu.metrics import BLEU, CHRF


def corpus_metrics(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU and chrF of `hyps` against one reference each (sacreBLEU defaults: 13a)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "sentences": len(hyps),
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}
