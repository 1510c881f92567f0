"""Paired bootstrap resampling (Koehn, 2004) of corpus BLEU and chrF between two systems.

Two systems' outputs for the same test sentences are scored on the same resamples of those
sentences; the spread of the resampled differences is what a single corpus score hides. This
is what MT papers mean by "significantly better", and what a claim like "Gumbel-Max is no worse
than top-1" needs beside the raw difference. Scores come from sacreBLEU's per-sentence
sufficient statistics (the same ones its own ``--paired-bs`` uses), so every resample is an
exact corpus BLEU / chrF, not an average of sentence scores.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from moe_train.eval.metrics import bleu_statistics, per_sentence


def _stats(name: str, hyps: Sequence[str], refs: Sequence[str],
           langs: Sequence[str | None]) -> tuple[np.ndarray, str]:
    """Per-sentence sufficient statistics of `name` (bleu, chrf) and its signature."""
    if name == "bleu":
        return bleu_statistics(hyps, refs, langs)
    chrf = CHRF()
    stats_NS = np.asarray(chrf._extract_corpus_statistics(list(hyps), [list(refs)]),
                          dtype=np.float64)
    return stats_NS, str(chrf.get_signature())


def _resampled(metric: Any, stats_NS: np.ndarray, idx_RN: np.ndarray,
               chunk: int = 50) -> np.ndarray:
    """The corpus score of every resample (rows of `idx_RN`), `chunk` resamples at a time: the
    gathered statistics of all 1000 at once would take resamples x sentences x statistics
    floats (0.5 GB for chrF on 3,500 sentences)."""
    sums_RS = np.concatenate([stats_NS[idx_RN[r:r + chunk]].sum(axis=1)
                              for r in range(0, len(idx_RN), chunk)])
    return np.array([metric._compute_score_from_stats(list(s)).score for s in sums_RS])


def _p_value(not_better_R: np.ndarray) -> float:
    """(c + 1) / (R + 1) of the R resamples, c of them not better."""
    return round(float((not_better_R.sum() + 1) / (len(not_better_R) + 1)), 4)


def paired_bootstrap(hyps_a: Sequence[str], hyps_b: Sequence[str], refs: Sequence[str],
                     samples: int = 1000, seed: int = 12345,
                     strata: Sequence[int] | None = None,
                     tgt_lang: str | Sequence[str | None] | None = None) -> dict[str, Any]:
    """System A against system B on the same sentences: per metric (``bleu``, ``chrf``) the
    corpus scores, ``delta`` = A - B, the 95% percentile interval of the resampled deltas
    (``ci95``), and the one-sided p-value of "A is better", (c + 1) / (samples + 1) with c the
    resamples in which A does not beat B (``p_a_not_better``; the +1s, as sacreBLEU's
    ``--paired-bs``, keep R resamples from claiming p = 0: at least 1 / (R + 1)), and the same
    for B (``p_b_not_better``). `strata`: sizes of consecutive blocks of the sentences (test sets
    joined end to end) that each resample draws from separately, so that every resample keeps
    each block's share. BLEU tokenizes as `corpus_metrics` does for `tgt_lang` (one target
    language for all sentences or one each; Chinese, Japanese, Korean: their own tokenizers);
    each metric records its sacreBLEU signature.
    Deterministic for a given `seed`."""
    if not (len(hyps_a) == len(hyps_b) == len(refs)):
        raise ValueError(f"paired bootstrap needs one hypothesis of each system per reference: "
                         f"{len(hyps_a)} / {len(hyps_b)} hypotheses, {len(refs)} references")
    if not refs:
        raise ValueError("paired bootstrap needs at least one sentence")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    blocks = list(strata) if strata is not None else [len(refs)]
    if sum(blocks) != len(refs) or min(blocks) < 1:
        raise ValueError(f"strata must be positive block sizes summing to the {len(refs)} "
                         f"sentences, got {blocks}")
    rng = np.random.default_rng(seed)
    starts = np.cumsum([0, *blocks[:-1]])
    idx_RN = np.concatenate([start + rng.integers(0, n, size=(samples, n))
                             for start, n in zip(starts, blocks)], axis=1)
    out: dict[str, Any] = {"sentences": len(refs), "samples": samples, "seed": seed}
    if strata is not None:
        out["strata"] = blocks
    langs = per_sentence(tgt_lang, len(refs))
    for name, metric in (("bleu", BLEU()), ("chrf", CHRF())):
        (stats_a, signature), (stats_b, _) = (_stats(name, hyps, refs, langs)
                                              for hyps in (hyps_a, hyps_b))
        a = metric._compute_score_from_stats(list(stats_a.sum(axis=0))).score
        b = metric._compute_score_from_stats(list(stats_b.sum(axis=0))).score
        delta_R = _resampled(metric, stats_a, idx_RN) - _resampled(metric, stats_b, idx_RN)
        lo, hi = np.percentile(delta_R, [2.5, 97.5])
        out[name] = {"a": round(a, 2), "b": round(b, 2), "delta": round(a - b, 2),
                     "ci95": [round(float(lo), 2), round(float(hi), 2)],
                     "p_a_not_better": _p_value(delta_R <= 0),
                     "p_b_not_better": _p_value(delta_R >= 0),
                     "signature": signature}
    return out
