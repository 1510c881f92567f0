"""Stage `classifier`: the domain classifier of the Gated Adapters recipe (seed 004 Sec. 3).

Trained on the training split only (``gated.classifier``: `encoder` head on the frozen backbone
encoder, data-parallel; or `tfidf`, fitted on rank 0). Reports micro-F1 and the confusion
matrix on dev, and stores per-sentence domain probabilities for the train, dev and test splits:
the train rows are the GAD gates' distillation target (`TeacherProbs`), the test rows drive the
*_CLF pipelines' accuracy tables and the misclassified subset. Artifacts: ``tfidf.skops`` or
``head.pt``, ``probs_{split}.npy`` (N x C float32, rows in split order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moe_train.data.shards import ShardedDataset, nonempty_split
from moe_train.errors import ConfigError
from moe_train.parallel.collectives import agreed_exit
from moe_train.stages.classifier_core import (DomainClassifier, EncoderClassifier,
                                              TfidfClassifier, domain_report, source_docs)
from moe_train.stages.common import StageContext
from moe_train.stages.probe import fit_probe, predict_probs
from moe_train.train.export import load_for_inference
from moe_train.train.hooks import load_probability_rows
from moe_train.utils.atomic import atomic_path

STAGE = "classifier"
TFIDF, HEAD = "tfidf.skops", "head.pt"
SPLITS = ("train", "dev", "test")


def probs_file(split: str) -> str:
    return f"probs_{split}.npy"


def _datasets(ctx: StageContext) -> dict[str, ShardedDataset]:
    prepared = ctx.cfg.data.prepared_dir
    train = nonempty_split(prepared, "train")
    missing = [s for s in SPLITS if s not in train.manifest["splits"]]
    if missing:
        raise ConfigError(f"stage {STAGE}: {prepared} has no {missing[0]} split (prepare "
                          "carves dev and test from train when the data has none)")
    return {"train": train, **{s: nonempty_split(prepared, s) for s in SPLITS[1:]}}


def _fit(ctx: StageContext, train: ShardedDataset, num_domains: int) -> tuple[
        DomainClassifier, dict[str, Any], np.ndarray | None]:
    """The fitted classifier, what to record of its fit, and its training-split probabilities
    when they come for free (the encoder head's features are already computed)."""
    g, rt, out = ctx.cfg.gated, ctx.rt, ctx.stage_dir(STAGE)
    every_N = np.arange(len(train), dtype=np.int64)
    if rt.is_main:  # a file of the other kind, left by a run killed before it finished
        (out / (HEAD if g.classifier == "tfidf" else TFIDF)).unlink(missing_ok=True)
    if g.classifier == "tfidf":  # scikit-learn is single-process: rank 0 fits, the rest load
        with agreed_exit(rt, f"stage {STAGE}: rank 0 failed fitting the classifier (its error "
                         "line says why)"):
            if rt.is_main:
                out.mkdir(parents=True, exist_ok=True)
                TfidfClassifier.fit(source_docs(train, every_N), train.domain_ids, num_domains,
                                    g.tfidf_ngrams).save(out / TFIDF)
        return TfidfClassifier.load(out / TFIDF), {"ngrams": g.tfidf_ngrams}, None
    backbone = load_for_inference(ctx.require("backbone", STAGE) / "checkpoints" / "export",
                                  rt.device)
    clf = EncoderClassifier(backbone.model, nn.Linear(1, 1), ctx, ctx.cfg.data.max_tokens)
    features_ND = clf.features(train, every_N)
    torch.manual_seed(ctx.cfg.moa.seed)  # the same initial head on every rank
    clf.head, loss = fit_probe(nn.Linear(features_ND.shape[1], num_domains), features_ND,
                               train.domain_ids, g.classifier_steps, g.classifier_lr,
                               g.classifier_batch_sentences, ctx.cfg.moa.seed, rt)
    with agreed_exit(rt, f"stage {STAGE}: rank 0 failed saving the classifier (its error line "
                     "says why)"):
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            clf.save(out / HEAD)
    return clf, {"steps": g.classifier_steps, "final_loss": loss}, \
        predict_probs(clf.head, features_ND)


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    data = _datasets(ctx)
    domains = list(data["train"].manifest["domains"])
    clf, fit_info, train_probs_NC = _fit(ctx, data["train"], len(domains))
    reports: dict[str, Any] = {}
    out = ctx.stage_dir(STAGE)
    for split, dataset in data.items():
        probs_NC = train_probs_NC if split == "train" and train_probs_NC is not None else \
            clf.predict_proba(dataset, np.arange(len(dataset), dtype=np.int64))
        reports[split] = domain_report(probs_NC.argmax(1), dataset.domain_ids, domains)
        with agreed_exit(ctx.rt, f"stage {STAGE}: rank 0 failed writing {probs_file(split)} "
                         "(its error line says why)"):
            if ctx.rt.is_main:
                with atomic_path(out / probs_file(split)) as tmp:
                    with open(tmp, "wb") as f:
                        np.save(f, probs_NC.astype(np.float32))
    summary = {"kind": clf.kind, **fit_info, "dev": reports["dev"],
               "train_micro_f1": reports["train"]["micro_f1"],
               "test_micro_f1": reports["test"]["micro_f1"],
               "test_misclassified": reports["test"]["misclassified"]}
    return ctx.finish(STAGE, summary, ctx.cfg)


def load_probs(ctx: StageContext, split: str, by: str) -> np.ndarray:
    """The classifier's (N, C) domain probabilities for `split` (never unpickled), checked
    against the split's sentences and the data's domains."""
    dataset = ShardedDataset(ctx.cfg.data.prepared_dir, split)
    return load_probability_rows(
        ctx.require(STAGE, by) / probs_file(split), len(dataset),
        len(dataset.manifest["domains"]), "domain probabilities",
        f"one row per sentence of the {split} split of {ctx.cfg.data.prepared_dir}, one column "
        "per domain (was the classifier stage run on other data? delete its directory to rerun "
        "it)")


def load_classifier(ctx: StageContext, by: str, backbone_model: nn.Module | None = None
                    ) -> DomainClassifier:
    """The fitted classifier, for pipelines that predict the domain at inference (an encoder
    classifier runs `backbone_model`, the backbone export's model)."""
    where: Path = ctx.require(STAGE, by)
    if ctx.cfg.gated.classifier == "tfidf":  # the kind the finished stage was run with, never
        return TfidfClassifier.load(where / TFIDF)  # the file a killed run of another left
    if backbone_model is None:
        raise ConfigError(f"stage {by}: the encoder classifier needs the backbone model")
    return EncoderClassifier(backbone_model, EncoderClassifier.load_head(where / HEAD), ctx,
                             ctx.cfg.data.max_tokens)
