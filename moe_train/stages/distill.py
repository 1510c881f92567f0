"""Stage `distill`: the MoA gate (Eq. 2) trained to predict the cluster labels (Eq. 6-7).

Everything but the gate is frozen, and the gate reads the mean-pooled output of the frozen
encoder, which is exactly what the features stage stored. So distillation trains on the stored
features: the same objective as running the frozen encoder every step (in eval mode), without
re-encoding. Data-parallel on a DeepSpeed engine (`probe.fit_probe`, batches of
``moa.distill_batch_sentences``). Artifact: ``gate.pt`` (the `MoAGate` state dict).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_train.data.shards import read_manifest
from moe_train.errors import CheckpointError
from moe_train.moe.moa_router import MoAGate
from moe_train.parallel.collectives import agreed_exit
from moe_train.stages.cluster import load_cluster
from moe_train.stages.cluster_core import cluster_report
from moe_train.stages.common import StageContext
from moe_train.stages.features import load_features
from moe_train.stages.probe import fit_probe
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import load_tensors

STAGE = "distill"
GATE = "gate.pt"


@torch.no_grad()
def gate_labels(gate: MoAGate, features_ND: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Top-1 adapter of each feature row (what MoA routes to at inference)."""
    gate.eval()
    device = next(gate.parameters()).device
    out = [gate(torch.from_numpy(features_ND[i:i + chunk]).to(device)).argmax(-1).cpu()
           for i in range(0, len(features_ND), chunk)]
    return torch.cat(out).numpy() if out else np.zeros(0, np.int64)


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    moa, rt = ctx.cfg.moa, ctx.rt
    features_ND, meta = load_features(ctx, STAGE)
    _, labels_N = load_cluster(ctx, STAGE)
    if len(labels_N) != len(features_ND):
        raise CheckpointError(f"{ctx.stage_dir('cluster')}: {len(labels_N)} cluster labels for "
                              f"{len(features_ND)} feature rows; expected one label per row "
                              "(run the cluster stage again)")
    torch.manual_seed(moa.seed)  # the same initial gate on every rank
    gate_module, final_loss = fit_probe(
        MoAGate(features_ND.shape[1], moa.num_clusters), features_ND, labels_N,
        moa.distill_steps, moa.distill_lr, moa.distill_batch_sentences, moa.seed, rt)
    predicted_N = gate_labels(gate_module, features_ND)
    domains = list(read_manifest(ctx.cfg.data.prepared_dir)["domains"])
    out = ctx.stage_dir(STAGE)
    with agreed_exit(rt, f"stage {STAGE}: rank 0 failed saving the gate (its error line says "
                     "why)"):
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_path(out / GATE) as tmp:
                torch.save({k: v.cpu() for k, v in gate_module.state_dict().items()}, tmp)
    return ctx.finish(STAGE, {
        "steps": moa.distill_steps,
        "batch_sentences": min(moa.distill_batch_sentences, len(labels_N)),
        "final_loss": final_loss,
        # both measured on the rows the gate was fitted to (no held-out rows: the evaluate
        # stage scores the gate on the test set)
        "measured_on": "training rows",
        "cluster_accuracy": float((predicted_N == labels_N).mean()),
        "gate_vs_domains": cluster_report(predicted_N, meta["domain"], domains,
                                          moa.num_clusters)}, ctx.cfg)


def load_gate(ctx: StageContext, by: str) -> dict[str, torch.Tensor]:
    """The distilled gate's state dict."""
    return load_tensors(ctx.require(STAGE, by) / GATE, "the distilled gate's weights")
