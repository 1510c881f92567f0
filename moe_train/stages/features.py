"""Stage `features`: sentence features from the frozen backbone encoder (MoA Eq. 1).

A random sample of ``moa.sample_size`` training source sentences (all if fewer; fixed by
``moa.seed``) is encoded and mean-pooled over non-pad positions. Optional domain anchors (seed
001's "DI"): the first ``moa.anchors_per_domain`` dev sentences of each anchor domain are joined
to the sample. The work is sharded over ranks in whole batches (the batches do not depend on the
number of ranks) and gathered in the sample's order, so N ranks give the features of 1 rank.

Artifact: ``features.npy`` (N x D float32) and ``meta.npz``: ``split`` (0 train, 1 dev anchor),
``index`` (sentence index in its split) and ``domain`` (the true domain id, kept only for
evaluation: clustering never reads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_train.data.batching import eval_batches
from moe_train.config.schema import ExperimentConfig
from moe_train.data.shards import MANIFEST, ShardedDataset, read_manifest
from moe_train.errors import ConfigError
from moe_train.eval.decode import batch_context
from moe_train.parallel.collectives import agreed_exit, all_gather_object
from moe_train.stages.common import StageContext
from moe_train.train.export import load_for_inference
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import load_array, load_arrays

STAGE = "features"
FEATURES, META = "features.npy", "meta.npz"
SPLIT_IDS = {"train": 0, "dev": 1}


@torch.no_grad()
def encode_sentences(model: torch.nn.Module, dataset: Any, indices: np.ndarray, ctx: StageContext,
                     max_tokens: int) -> np.ndarray:
    """Mean-pooled encoder output of `dataset[indices]`, (len(indices), D) float32, every rank.

    Sharded over the ranks batch by batch; rows come back in the order of `indices`.
    """
    rt, manifest = ctx.rt, dataset.manifest
    model.eval()
    batches = eval_batches(dataset, max_tokens, manifest["pad_id"], manifest["bos_id"],
                           manifest["eos_id"], dp_rank=rt.dp_rank, dp_world=rt.dp_world,
                           indices=indices)
    local: dict[int, np.ndarray] = {}
    for batch in batches:
        batch = batch.to(rt.device)
        enc = model.encode(batch.src_tokens_BS,
                           batch_context(batch, manifest["pad_id"], len(manifest["langs"])))
        if not batch.is_padding:
            repr_BD = enc.sentence_repr_BD.float().cpu().numpy()
            for row, idx in enumerate(batch.indices_B.tolist()):
                local[idx] = repr_BD[row]
    merged: dict[int, np.ndarray] = {}
    for part in all_gather_object(rt, local):
        merged.update(part)
    return np.stack([merged[int(i)] for i in indices]).astype(np.float32)


def sample_indices(n: int, size: int, seed: int) -> np.ndarray:
    """`size` distinct indices of [0, n) (all if n <= size), sorted, fixed by `seed`."""
    if n <= size:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def anchor_indices(dev: ShardedDataset, domains: list[str], wanted: list[str], per_domain: int
                   ) -> np.ndarray:
    """The first `per_domain` dev sentences of each wanted domain (all domains if none named)."""
    unknown = sorted(set(wanted) - set(domains))
    if unknown:
        raise ConfigError(f"moa.anchor_domains: unknown domain {unknown[0]!r} (the data has: "
                          f"{', '.join(domains)})")
    chosen = []
    for name in wanted or domains:
        ids = np.flatnonzero(dev.domain_ids == domains.index(name))[:per_domain]
        if not len(ids):  # it would anchor nothing (and an empty dev split, everything)
            raise ConfigError(f"moa.anchors_per_domain: the dev split of {dev.prepared_dir} "
                              f"holds no {name} sentence to anchor; expected dev sentences of "
                              "every anchored domain (moa.anchor_domains)")
        chosen.append(ids)
    return np.concatenate(chosen).astype(np.int64) if chosen else np.zeros(0, np.int64)


def check_label_free(manifest: dict[str, Any], where: Any) -> None:
    """Refuse data whose sources carry their domain tag: the features would read the label
    the clustering is meant to discover."""
    if manifest.get("domain_tags"):
        raise ConfigError(f"data.domain_tags: {where} starts every source with its domain tag, "
                          "which label-free features would read; prepare the data without "
                          "domain tags")


def check_recipe_config(cfg: ExperimentConfig) -> None:
    """What the features and cluster stages would refuse, decided from the config and the
    prepared data's manifest before the backbone trains (they were found only after it had):
    domain-tagged sources, unknown anchor domains, anchors without a dev split, more clusters
    than sentences, a Birch sample too large."""
    from moe_train.stages.cluster import BIRCH_MAX_SENTENCES

    moa, data = cfg.moa, cfg.data
    if not (Path(data.prepared_dir) / MANIFEST).is_file():
        return  # the backbone stage names the missing data
    manifest = read_manifest(data.prepared_dir)
    check_label_free(manifest, data.prepared_dir)
    domains, splits = list(manifest.get("domains", [])), manifest.get("splits", {})
    anchors = 0
    if moa.anchors_per_domain:
        unknown = sorted(set(moa.anchor_domains) - set(domains))
        if unknown:
            raise ConfigError(f"moa.anchor_domains: unknown domain {unknown[0]!r} (the data "
                              f"has: {', '.join(domains)})")
        if "dev" not in splits:
            raise ConfigError(f"moa.anchors_per_domain: anchors come from the dev split, which "
                              f"{data.prepared_dir} does not have")
        anchors = moa.anchors_per_domain * len(moa.anchor_domains or domains)
    sampled = min(int(splits.get("train", {}).get("sentences", moa.sample_size)),
                  moa.sample_size)
    if moa.num_clusters > sampled + anchors:
        raise ConfigError(f"moa.num_clusters: expected at most the {sampled + anchors} "
                          f"sentences the features stage will sample, got {moa.num_clusters}")
    if moa.clusterer == "birch" and sampled > BIRCH_MAX_SENTENCES:
        raise ConfigError(f"moa.sample_size: Birch needs at most {BIRCH_MAX_SENTENCES} "
                          f"sentences (its last step is quadratic in memory), the features will "
                          f"have {sampled}; lower moa.sample_size or use gmm / kmeans")


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    moa, data = ctx.cfg.moa, ctx.cfg.data
    inf = load_for_inference(ctx.require("backbone", STAGE) / "checkpoints" / "export",
                             ctx.rt.device)
    train = ShardedDataset(data.prepared_dir, "train")
    check_label_free(train.manifest, data.prepared_dir)
    parts = [("train", train, sample_indices(len(train), moa.sample_size, moa.seed))]
    if moa.anchors_per_domain:
        if "dev" not in train.manifest["splits"]:
            raise ConfigError(f"moa.anchors_per_domain: anchors come from the dev split, which "
                              f"{data.prepared_dir} does not have")
        dev = ShardedDataset(data.prepared_dir, "dev")
        parts.append(("dev", dev, anchor_indices(dev, train.manifest["domains"],
                                                 moa.anchor_domains, moa.anchors_per_domain)))
    feats, split, index, domain = [], [], [], []
    for name, dataset, idx in parts:
        feats.append(encode_sentences(inf.model, dataset, idx, ctx, data.max_tokens))
        split.append(np.full(len(idx), SPLIT_IDS[name], np.int64))
        index.append(idx)
        domain.append(dataset.domain_ids[idx])
    out = ctx.stage_dir(STAGE)
    with agreed_exit(ctx.rt, f"stage {STAGE}: rank 0 failed writing the features (its error "
                     "line says why)"):
        if ctx.rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_path(out / FEATURES) as tmp:
                with open(tmp, "wb") as f:
                    np.save(f, np.concatenate(feats))
            with atomic_path(out / META) as tmp:
                with open(tmp, "wb") as f:
                    np.savez(f, split=np.concatenate(split), index=np.concatenate(index),
                             domain=np.concatenate(domain))
    return ctx.finish(STAGE, {"sentences": int(sum(len(i) for i in index)),
                              "sampled": int(len(index[0])),
                              "anchors": int(sum(len(i) for i in index[1:])),
                              "dim": int(feats[0].shape[1])}, ctx.cfg)


def load_features(ctx: StageContext, by: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(features_ND, meta) of the finished features stage."""
    where = ctx.require(STAGE, by)
    features_ND = load_array(where / FEATURES, "the sentence features", "f", 2)
    meta = load_arrays(where / META, "the features' sentence ids", ("split", "index", "domain"),
                       len(features_ND))
    return features_ND, meta
