"""Evaluate a model on a prepared split: BLEU and chrF overall, per domain and per language pair."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from moe_train.config.schema import EvalConfig
from moe_train.data.vocab import Vocab
from moe_train.eval.decode import translate_dataset
from moe_train.eval.metrics import corpus_metrics
from moe_train.parallel.runtime import ParallelRuntime


def evaluate_dataset(model: torch.nn.Module, dataset: Any, vocab: Vocab, manifest: dict[str, Any],
                     rt: ParallelRuntime, ecfg: EvalConfig, max_tokens: int,
                     indices: np.ndarray | None = None, beam: int | None = None
                     ) -> tuple[dict[str, Any], dict[int, str]]:
    """Decode the split and score it; returns (metrics, {index: hypothesis}).

    metrics = {"all": {...}, "domains": {domain: {...}}, "pairs": {src-tgt: {...}}} with BLEU,
    chrF and sacreBLEU signatures; groups with a single member are still reported.
    """
    hyps = translate_dataset(model, dataset, vocab, rt, ecfg, max_tokens, indices=indices,
                             beam=beam)
    order = sorted(hyps)
    refs = {i: dataset.raw_tgt(i) for i in order}
    domains, langs = manifest["domains"], manifest["langs"]
    by_domain: dict[str, list[int]] = defaultdict(list)
    by_pair: dict[str, list[int]] = defaultdict(list)
    for i in order:
        by_domain[domains[int(dataset.domain_ids[i])]].append(i)
        pair = f"{langs[int(dataset.src_lang_ids[i])]}-{langs[int(dataset.tgt_lang_ids[i])]}"
        by_pair[pair].append(i)

    def score(ids: list[int]) -> dict[str, Any]:
        return corpus_metrics([hyps[i] for i in ids], [refs[i] for i in ids])

    metrics = {"all": score(order),
               "domains": {d: score(ids) for d, ids in sorted(by_domain.items())},
               "pairs": {p: score(ids) for p, ids in sorted(by_pair.items())}}
    return metrics, hyps


def format_table(metrics: dict[str, Any]) -> str:
    """A small fixed-width table of per-domain BLEU / chrF."""
    rows = [f"{'domain':<16} {'sents':>6} {'BLEU':>6} {'chrF':>6}"]
    for name, m in metrics["domains"].items():
        rows.append(f"{name:<16} {m['sentences']:>6} {m['bleu']:>6.2f} {m['chrf']:>6.2f}")
    m = metrics["all"]
    rows.append(f"{'ALL':<16} {m['sentences']:>6} {m['bleu']:>6.2f} {m['chrf']:>6.2f}")
    return "\n".join(rows)
