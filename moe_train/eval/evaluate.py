"""Evaluate a model on a prepared split: BLEU and chrF overall, per domain and per language pair;
for MoE models optionally routing metrics (experts per token, THOR task-prediction accuracy)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from moe_train.config.schema import EvalConfig
from moe_train.data.vocab import Vocab
from moe_train.eval.decode import translate_dataset
from moe_train.eval.metrics import corpus_metrics
from moe_train.eval.routing_stats import collect_routing_stats
from moe_train.eval.routing_tables import RoutingStats
from moe_train.models.build import moe_layers
from moe_train.parallel.runtime import ParallelRuntime


def evaluate_dataset(model: torch.nn.Module, dataset: Any, vocab: Vocab, manifest: dict[str, Any],
                     rt: ParallelRuntime, ecfg: EvalConfig, max_tokens: int,
                     indices: np.ndarray | None = None, beam: int | None = None,
                     routing: bool = False) -> tuple[dict[str, Any], dict[int, str]]:
    """Decode the split and score it; returns (metrics, {index: hypothesis}).

    metrics = {"all": {...}, "domains": {domain: {...}}, "pairs": {src-tgt: {...}}} with BLEU,
    chrF and sacreBLEU signatures; groups with a single member are still reported. With
    `routing` and an MoE model, see `add_routing_metrics` (one teacher-forced forward per batch
    of the same sentences, much cheaper than the search).
    """
    if len(dataset):  # the references exist (dev / test keep raw text) before hours of search
        dataset.raw_tgt(0 if indices is None or not len(indices) else int(indices[0]))
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
        return corpus_metrics([hyps[i] for i in ids], [refs[i] for i in ids],
                              [langs[int(dataset.tgt_lang_ids[i])] for i in ids])

    metrics = {"all": score(order),
               "domains": {d: score(ids) for d, ids in sorted(by_domain.items())},
               "pairs": {p: score(ids) for p, ids in sorted(by_pair.items())}}
    if routing and moe_layers(model):
        stats = collect_routing_stats(model, dataset, manifest, rt, max_tokens,
                                      indices=None if indices is None else np.asarray(indices))
        add_routing_metrics(metrics, stats)
    return metrics, hyps


def add_routing_metrics(metrics: dict[str, Any], stats: RoutingStats) -> None:
    """Add routing metrics of the evaluated sentences to `metrics` in place.

    ``experts_per_token`` (003 Table 7: used expert slots per real token, averaged over the MoE
    layers) joins "all" and every domain / pair entry, and ``task_accuracy`` (argmax of the task
    predictor's P^t vs the gold task) too when the model has a task predictor; "routing" holds
    the per-side and per-layer values and candidate-set usage. Encoder routing and the task
    prediction are what inference computes (they see the source only); decoder routing is
    measured on the reference prefixes (teacher forcing).
    """
    groups = stats.group_metrics()
    for group in ("domains", "pairs"):
        for name, entry in metrics[group].items():
            entry.update(groups[group].get(name, {}))
    metrics["all"]["experts_per_token"] = stats.experts_per_token()["all"]
    layers = {}
    for name, t in stats.layers.items():
        layers[name] = {"experts_per_token": t.experts_per_token}
        if t.candidate_usage is not None:
            layers[name]["candidate_usage"] = t.candidate_usage
    routing: dict[str, Any] = {"experts_per_token": stats.experts_per_token(), "layers": layers}
    usage = stats.candidate_usage()
    if usage is not None:
        routing["candidate_usage"] = usage
    task = stats.task_summary()
    if task is not None:
        metrics["all"]["task_accuracy"] = task["accuracy"]
        routing["task_prediction"] = {k: task[k] for k in ("source", "sentences", "accuracy",
                                                           "accuracy_by_task")}
    metrics["routing"] = routing


def format_table(metrics: dict[str, Any]) -> str:
    """A small fixed-width table of per-domain BLEU / chrF (and experts per token and task
    accuracy when measured)."""
    extra = [(key, head) for key, head in (("experts_per_token", "exp/tok"),
                                           ("task_accuracy", "taskacc"))
             if key in metrics["all"]]

    def row(name: str, m: dict[str, Any]) -> str:
        cells = [f"{name:<16} {m['sentences']:>6} {m['bleu']:>6.2f} {m['chrf']:>6.2f}"]
        for key, head in extra:
            value = m.get(key)
            cells.append(f"{'-':>{len(head)}}" if value is None
                         else f"{value:>{len(head)}.3f}")
        return " ".join(cells)

    rows = [" ".join([f"{'domain':<16} {'sents':>6} {'BLEU':>6} {'chrF':>6}",
                      *(head for _, head in extra)])]
    for name, m in metrics["domains"].items():
        rows.append(row(name, m))
    rows.append(row("ALL", metrics["all"]))
    return "\n".join(rows)
