"""Stage `cluster`: PCA then a scikit-learn clusterer into K groups (MoA Sec. 4.2, App. 8.2).

Runs on rank 0 (scikit-learn is single-process); the other ranks wait and read the labels it
wrote. Artifact: ``clusterer.skops`` (the fitted PCA + clusterer, reused to label any later set),
``labels.npy`` (the cluster of every feature row) and, in ``done.json``, PUR and NMI of the
clusters against the true domains (evaluation only: the clusterer never sees them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_train.data.shards import read_manifest
from moe_train.errors import CheckpointError, ConfigError
from moe_train.parallel.collectives import agreed_exit, broadcast_object
from moe_train.stages.cluster_core import (FittedClusterer, cluster_report, fit_clusterer,
                                           load_clusterer)
from moe_train.stages.common import StageContext
from moe_train.stages.features import load_features
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import load_array

STAGE = "cluster"
CLUSTERER, LABELS = "clusterer.skops", "labels.npy"
LEGACY_CLUSTERER = "clusterer.pkl"
"""Written by older versions; never read (loading it could run code stored in it)."""
BIRCH_MAX_SENTENCES = 20000
"""Birch's final step clusters its subclusters with an N x N distance matrix when (as with
default settings on unit-scale features) every sentence is its own subcluster: about 10 GB at
50k sentences. Larger samples are refused rather than run out of memory."""


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    moa = ctx.cfg.moa
    features_ND, meta = load_features(ctx, STAGE)
    if moa.clusterer == "birch" and len(features_ND) > BIRCH_MAX_SENTENCES:
        raise ConfigError(f"moa.sample_size: Birch needs at most {BIRCH_MAX_SENTENCES} "
                          f"sentences (its last step is quadratic in memory), the features "
                          f"have {len(features_ND)}; lower moa.sample_size or use gmm / kmeans")
    with agreed_exit(ctx.rt, f"stage {STAGE}: rank 0 failed fitting the clusterer (its error "
                     "line says why)"):
        summary = _fit_and_save(ctx, features_ND, meta) if ctx.rt.is_main else None
    summary = broadcast_object(ctx.rt, summary)
    return ctx.finish(STAGE, summary, ctx.cfg)


def _fit_and_save(ctx: StageContext, features_ND: np.ndarray, meta: dict[str, np.ndarray]
                  ) -> dict[str, Any]:
    """Rank 0's work: fit the clusterer, label every feature row, save both; the summary."""
    moa, out = ctx.cfg.moa, ctx.stage_dir(STAGE)
    fitted = fit_clusterer(features_ND, moa.num_clusters, moa.clusterer, moa.pca_dim, moa.seed,
                           moa.standardize, moa.cluster_inits, moa.whiten, moa.unit_norm)
    labels_N = fitted.predict(features_ND)
    out.mkdir(parents=True, exist_ok=True)
    fitted.save(out / CLUSTERER)
    with atomic_path(out / LABELS) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, labels_N)
    domains = _domain_names(ctx)
    sampled = meta["split"] == 0
    return {"method": moa.clusterer, "num_clusters": moa.num_clusters,
            "standardize": moa.standardize, "whiten": moa.whiten, "unit_norm": moa.unit_norm,
            "inits": moa.cluster_inits, "pca_dim": fitted.dims, "sentences": int(len(labels_N)),
            "all": cluster_report(labels_N, meta["domain"], domains, moa.num_clusters),
            "sampled_only": cluster_report(labels_N[sampled], meta["domain"][sampled], domains,
                                           moa.num_clusters)}


def _domain_names(ctx: StageContext) -> list[str]:
    return list(read_manifest(ctx.cfg.data.prepared_dir)["domains"])


def load_cluster(ctx: StageContext, by: str) -> tuple[FittedClusterer, np.ndarray]:
    """(fitted clusterer, labels of the feature rows) of the finished cluster stage."""
    where = ctx.require(STAGE, by)
    if not (where / CLUSTERER).is_file() and (where / LEGACY_CLUSTERER).is_file():
        raise CheckpointError(f"{where / CLUSTERER}: missing (this run has the old, unsafe "
                              f"{LEGACY_CLUSTERER}, which is not loaded); delete {where} and run "
                              "the cluster stage again")
    labels_N = load_array(where / LABELS, "the cluster labels", "i", 1)
    k = ctx.cfg.moa.num_clusters
    if len(labels_N) and not 0 <= int(labels_N.min()) <= int(labels_N.max()) < k:
        raise CheckpointError(f"{where / LABELS}: labels {int(labels_N.min())}.."
                              f"{int(labels_N.max())}; expected cluster ids below "
                              f"moa.num_clusters ({k})")
    return load_clusterer(where / CLUSTERER), labels_N
