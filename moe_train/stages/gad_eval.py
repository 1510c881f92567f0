"""Stage `evaluate` of the Gated Adapters recipe: 004's quality, misclassified-subset, gate and
efficiency tables, for MIX, TAG, TAG_CLF, AD_ORACLE, AD_CLF and GAD.

- Quality: BLEU and chrF (sacreBLEU, signatures kept) per gold domain on the first
  ``moa.eval_sentences`` test sentences of each domain, beam ``moa.eval_beam``; AVG (domain
  mean) and wAVG (weighted by the domains' training-sentence share). *_CLF systems read the
  classifier's predicted domain (AD_CLF: the adapter it routes to; TAG_CLF: the source tag).
- Misclassified subset (004 Table 5): the same scores on the evaluated sentences whose
  predicted domain is wrong.
- Gate agreement: argmax of GAD's encoder gates (each layer, and their mean) against the
  classifier's prediction and against the gold domain.
- Efficiency (004 Table 7): see `gad_efficiency`.
Artifact: ``eval.json``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_train.config.schema import EvalConfig
from moe_train.data.batching import bucket_key, eval_batches
from moe_train.data.shards import ShardedDataset, nonempty_split
from moe_train.data.views import Relabeled
from moe_train.errors import ConfigError
from moe_train.eval.decode import batch_context, translate_dataset
from moe_train.eval.metrics import corpus_metrics
from moe_train.moe.gated_router import GatedRouter
from moe_train.parallel.collectives import agreed_exit
from moe_train.stages.classifier import load_classifier, load_probs
from moe_train.stages.classifier_core import DomainClassifier
from moe_train.stages.common import StageContext, quality_decoding
from moe_train.stages.evaluate import test_indices
from moe_train.stages.gad import export_dir
from moe_train.stages.gad_efficiency import efficiency_table
from moe_train.train.export import InferenceModel, load_for_inference
from moe_train.utils.atomic import write_json

STAGE = "evaluate"


def domain_weights(manifest: dict[str, Any]) -> np.ndarray:
    """Training-sentence share of every domain (wAVG's weights), manifest domain order."""
    sizes = np.zeros(len(manifest["domains"]))
    for corpus, n in zip(manifest["corpora"], manifest["splits"]["train"]["corpus_sizes"]):
        sizes[corpus["domain_id"]] += n
    return sizes / sizes.sum()


def score_system(hyps: dict[int, str], test: ShardedDataset, idx: np.ndarray,
                 mis_idx: np.ndarray, domains: list[str], weights_D: np.ndarray
                 ) -> dict[str, Any]:
    """Per gold domain BLEU/chrF, AVG, wAVG, all and the misclassified subset."""
    langs = test.manifest["langs"]

    def score(ids: np.ndarray) -> dict[str, Any]:
        return corpus_metrics([hyps[int(i)] for i in ids], [test.raw_tgt(int(i)) for i in ids],
                              [langs[int(test.tgt_lang_ids[int(i)])] for i in ids])

    gold = test.domain_ids[idx]
    per = {d: score(idx[gold == k]) for k, d in enumerate(domains) if (gold == k).any()}
    present = [k for k, d in enumerate(domains) if d in per]
    w = weights_D[present] / weights_D[present].sum()
    out: dict[str, Any] = {"domains": {d: {m: s[m] for m in ("bleu", "chrf", "sentences")}
                                       for d, s in per.items()}}
    for metric in ("bleu", "chrf"):
        values = np.array([per[domains[k]][metric] for k in present])
        out.setdefault("avg", {})[metric] = round(float(values.mean()), 2)
        out.setdefault("wavg", {})[metric] = round(float((values * w).sum()), 2)
    whole = score(idx)
    out["all"] = {m: whole[m] for m in ("bleu", "chrf", "sentences")}
    out["signatures"] = {"bleu": whole["bleu_signature"], "chrf": whole["chrf_signature"]}
    if len(mis_idx):
        mis = score(mis_idx)
        out["misclassified"] = {m: mis[m] for m in ("bleu", "chrf", "sentences")}
    return out


@torch.no_grad()
def encoder_gate_probs(model: torch.nn.Module, dataset: Any, idx: np.ndarray,
                       max_tokens: int) -> np.ndarray:
    """(L, N, E) gate weights of the encoder's gated layers for the sentences `idx`, rows in
    the order of `idx` (every rank encodes them all: one encoder pass, no search)."""
    routers = [m for m in model.modules() if isinstance(m, GatedRouter)]
    captured: list[tuple[int, torch.Tensor]] = []

    def hook(module: GatedRouter, args: tuple, out: Any) -> None:
        rctx = args[1]
        if rctx.side == "encoder":
            B = rctx.num_sentences
            sums = torch.zeros(B, out.probs_TE.shape[1]).index_add_(
                0, rctx.sentence_ids_T.cpu(), out.probs_TE.float().cpu())
            counts = torch.bincount(rctx.sentence_ids_T.cpu(), minlength=B).clamp_min(1)
            captured.append((routers.index(module), sums / counts[:, None]))

    handles = [r.register_forward_hook(hook) for r in routers]
    manifest = dataset.manifest
    rows: dict[int, list[np.ndarray]] = {}
    device = next(model.parameters()).device
    try:
        model.eval()
        for batch in eval_batches(dataset, max_tokens, manifest["pad_id"], manifest["bos_id"],
                                  manifest["eos_id"], indices=idx):
            batch = batch.to(device)
            captured.clear()
            model.encode(batch.src_tokens_BS, batch_context(batch, manifest["pad_id"],
                                                            len(manifest["langs"])))
            per_layer = [p for _, p in sorted(captured, key=lambda c: c[0])]
            for row, i in enumerate(batch.indices_B.tolist()):
                rows[i] = [p[row].numpy() for p in per_layer]
    finally:
        for h in handles:
            h.remove()
    return np.stack([np.stack(rows[int(i)]) for i in idx], axis=1)


def gate_agreement(gates_LNE: np.ndarray, pred_N: np.ndarray, gold_N: np.ndarray
                   ) -> dict[str, Any]:
    mean_NE = gates_LNE.mean(0)
    return {"with_classifier": round(float((mean_NE.argmax(1) == pred_N).mean()), 4),
            "with_gold": round(float((mean_NE.argmax(1) == gold_N).mean()), 4),
            "per_layer_with_classifier": [round(float((g.argmax(1) == pred_N).mean()), 4)
                                          for g in gates_LNE],
            "mean_max_weight": round(float(mean_NE.max(1).mean()), 4)}


def _tag_test(ctx: StageContext, test: ShardedDataset) -> ShardedDataset | None:
    tag_dir = ctx.cfg.gated.tag_prepared_dir
    if not tag_dir:
        return None
    tagged = ShardedDataset(tag_dir, "test")
    if len(tagged) != len(test) or not np.array_equal(tagged.domain_ids, test.domain_ids) \
            or not np.array_equal(tagged.tgt_lengths, test.tgt_lengths):
        raise ConfigError(f"gated.tag_prepared_dir: the test split of {tag_dir} is not the same "
                          f"sentences as {ctx.cfg.data.prepared_dir}'s (prepare both from the "
                          "same corpora and data settings)")
    return tagged


def gad_tables(ctx: StageContext, inf: InferenceModel, split: str) -> dict[str, Any]:
    """One gated model on `split` of the prepared data, scored as `evaluate_split` scores GAD
    (same sentences, search, misclassified subset), with its gates' agreement (ablations)."""
    data = ShardedDataset(ctx.cfg.data.prepared_dir, split)
    idx = test_indices(data, ctx.cfg.moa.eval_sentences)
    pred_N = load_probs(ctx, split, STAGE).argmax(1)
    mis_idx = idx[pred_N[idx] != data.domain_ids[idx]]
    hyps = translate_dataset(inf.model, data, inf.vocab, ctx.rt, quality_decoding(ctx.cfg),
                             ctx.cfg.data.max_tokens, indices=idx)
    gates_LNE = encoder_gate_probs(inf.model, data, idx, ctx.cfg.data.max_tokens)
    return {"split": split,
            "quality": score_system(hyps, data, idx, mis_idx, list(data.manifest["domains"]),
                                    domain_weights(data.manifest)),
            "gate_agreement": gate_agreement(gates_LNE, pred_N[idx], data.domain_ids[idx])}


def load_systems(ctx: StageContext) -> dict[str, InferenceModel]:
    """The recipe's trained models by stage: backbone (MIX), tag (when run), ad, gad."""
    stages = ["backbone", *(["tag"] if ctx.cfg.gated.tag_prepared_dir else []), "ad", "gad"]
    out = {}
    for stage in stages:
        ctx.require(stage, STAGE)
        out[stage] = load_for_inference(export_dir(ctx, stage), ctx.rt.device)
    return out


def evaluate_split(ctx: StageContext, models: dict[str, InferenceModel], test: Any,
                   tagged: Any | None, probs_NC: np.ndarray, clf: DomainClassifier
                   ) -> dict[str, Any]:
    """Every table of the module docstring on one test set: `test` as the untagged models
    read it, `tagged` as TAG reads it (or None), `probs_NC` the classifier's prediction for
    every sentence of it, `clf` the classifier AD_CLF runs in the efficiency table."""
    cfg, rt, moa = ctx.cfg, ctx.rt, ctx.cfg.moa
    domains = list(models["backbone"].manifest["domains"])
    idx = test_indices(test, moa.eval_sentences)
    pred_N, gold_N = probs_NC.argmax(1), test.domain_ids
    mis_idx = idx[pred_N[idx] != gold_N[idx]]
    systems: dict[str, tuple[InferenceModel, Any]] = {"MIX": (models["backbone"], test)}
    if tagged is not None and "tag" in models:
        systems |= {"TAG": (models["tag"], tagged),
                    "TAG_CLF": (models["tag"], Relabeled(tagged, pred_N))}
    systems |= {"AD_ORACLE": (models["ad"], test), "AD_CLF": (models["ad"],
                                                              Relabeled(test, pred_N)),
                "GAD": (models["gad"], test)}
    ecfg = quality_decoding(ctx.cfg)
    weights_D = domain_weights(models["backbone"].manifest)
    quality = {}
    for name, (inf, dataset) in systems.items():
        hyps = translate_dataset(inf.model, dataset, inf.vocab, rt, ecfg, cfg.data.max_tokens,
                                 indices=idx)
        quality[name] = score_system(hyps, test, idx, mis_idx, domains, weights_D)
    gates_LNE = encoder_gate_probs(models["gad"].model, test, idx, cfg.data.max_tokens)
    return {
        "test_sentences": int(len(idx)), "beam": moa.eval_beam,
        "training_share": {d: round(float(w), 4) for d, w in zip(domains, weights_D)},
        "classifier": {"kind": clf.kind,
                       "accuracy": round(float((pred_N[idx] == gold_N[idx]).mean()), 4),
                       "misclassified": int(len(mis_idx))},
        "systems": quality,
        "gate_agreement": gate_agreement(gates_LNE, pred_N[idx], gold_N[idx]),
        "efficiency": _efficiency(ctx, test, idx, models["ad"], models["gad"], clf),
    }


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    test = nonempty_split(ctx.cfg.data.prepared_dir, "test")
    models = load_systems(ctx)
    clf = load_classifier(ctx, STAGE, backbone_model=models["backbone"].model)
    result = evaluate_split(ctx, models, test, _tag_test(ctx, test),
                            load_probs(ctx, "test", STAGE), clf)
    with agreed_exit(ctx.rt, f"stage {STAGE}: rank 0 failed writing eval.json (its error line "
                     "says why)"):
        if ctx.rt.is_main:
            write_json(ctx.stage_dir(STAGE) / "eval.json", result)
    return ctx.finish(STAGE, result, ctx.cfg)


def efficiency_max_tokens(test: Any, idx: np.ndarray, batch: int) -> int:
    """A token budget under which the sentences `idx` decode in batches of exactly `batch`
    (the last one excepted), as the efficiency table records: held-out pairs are not limited to
    data.max_len, so a budget from it would cut batches of long sentences smaller."""
    return batch * int(bucket_key(test)[idx].max(initial=1))


def _efficiency(ctx: StageContext, test: Any, idx: np.ndarray, ad: InferenceModel,
                gad: InferenceModel, clf: DomainClassifier) -> dict[str, Any]:
    """AD_ORACLE, AD_CLF (classifier + AD) and GAD timed in one run (004 Table 7)."""
    cfg, g, rt = ctx.cfg, ctx.cfg.gated, ctx.rt
    ecfg = EvalConfig(beam=1, max_len_a=cfg.eval.max_len_a, max_len_b=cfg.eval.max_len_b,
                      max_sentences=g.efficiency_batch)
    max_tokens = efficiency_max_tokens(test, idx, g.efficiency_batch)

    def decode(inf: InferenceModel, dataset: Any, ids: np.ndarray) -> Any:
        return translate_dataset(inf.model, dataset, inf.vocab, rt, ecfg, max_tokens,
                                 indices=ids)

    def ad_clf(ids: np.ndarray) -> Any:
        predicted = test.domain_ids.copy()
        predicted[ids] = clf.predict_proba(test, ids).argmax(1)
        return decode(ad, Relabeled(test, predicted), ids)

    gold = test.domain_ids[idx]
    by_domain = {d: idx[gold == k] for k, d in enumerate(ad.manifest["domains"])
                 if (gold == k).any()}
    systems = {"AD_ORACLE": lambda ids: decode(ad, test, ids), "AD_CLF": ad_clf,
               "GAD": lambda ids: decode(gad, test, ids)}
    table = efficiency_table(systems, by_domain, np.asarray(test.tgt_lengths),
                             g.efficiency_repeats, warmup=idx[:g.efficiency_batch])
    return table | {"batch": g.efficiency_batch, "search": "greedy", "classifier": clf.kind,
                    "tokens": "reference subword tokens"}
