"""Stage `evaluate`: translation quality and domain discrimination of a stage-wise recipe.

- Per-domain BLEU and chrF (sacreBLEU) of the backbone and of the adapter model on the first
  ``moa.eval_sentences`` test sentences of each domain, beam ``moa.eval_beam``.
- RND (seed 001): the same sentences mixed with their domain labels withheld. Label-free models
  never read the labels, so RND is their overall score; a model that reads them (ADPT's oracle
  routing, FFN experts or THOR routed by the gold domain, a domain tag in the source:
  `uses_domain_labels`) is decoded again with the labels (and tags) shuffled.
- Routing on the test sentences, as a sentence x domain table (CSV + heatmap PNG, seed 001
  Figures 4-5) with PUR (Eq. 11) and NMI: the clusterer (its fitted PCA + clusterer applied to
  the test features), the distilled gate (top-1), and the routed model's own sentence router
  (its top-1 on the same mean-pooled encoder states): the adapter model's (the encoder is
  frozen, so the backbone's features are its), else the backbone's when it is itself a
  sentence-routed MoE (the Switch-SL / SGMoE-SL baselines with FFN experts).
- Random routing (``random_routing``): a model decoded again with its sentence router's (gate
  or learned) choice of experts replaced by a fixed arbitrary one per sentence, its k and
  combine weights kept: what routing is worth.
- Extra parameters of the adapter model over the backbone.
- The test hypotheses of each model, one per line in test-index order, beside the references
  (``hypotheses/<model>.txt``, ``hypotheses/references.txt``): what a paired significance test
  between two runs (`moe_train.eval.significance`) reads.
The backbone's scores and hypotheses are cached beside it (recipes sharing a backbone decode it
once), keyed on the content of its export, of the test data and on the decode settings, and
reported with ``"cached": true`` when reused. Artifact: ``eval.json``, ``routing/<name>.csv``
and ``.png``, ``hypotheses/``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_train.config.moe import RouterConfig
from moe_train.config.schema import EvalConfig, ExperimentConfig
from moe_train.data.shards import MANIFEST, ShardedDataset, nonempty_split
from moe_train.data.views import Relabeled
from moe_train.eval.evaluate import evaluate_dataset
from moe_train.eval.extract import task_sources
from moe_train.eval.routing_stats import plot_heatmap, table_csv
from moe_train.moe.adapters import AdapterSlot
from moe_train.moe.moa_router import MoAGate, RandomSentenceRouter, SharedRouter
from moe_train.moe.routing import RoutingContext
from moe_train.parallel.collectives import agreed_exit
from moe_train.stages.cluster import load_cluster
from moe_train.stages.cluster_core import cluster_report
from moe_train.stages.common import StageContext, load_matching, moa_stages, quality_decoding
from moe_train.stages.distill import GATE, gate_labels, load_gate
from moe_train.stages.features import encode_sentences
from moe_train.train.export import InferenceModel, load_for_inference
from moe_train.utils.atomic import lines_text, write_json, write_text
from moe_train.utils.provenance import digest_files, digest_tree

STAGE = "evaluate"
CACHE_DIR = "eval_cache"
CACHE_FORMAT = 3
"""Version of what a cache entry holds and how its scores were computed (2: scores and test
hypotheses; 3: BLEU tokenized per target language, `bleu_statistics`); older entries miss."""
HYP_DIR = "hypotheses"


def test_indices(test: ShardedDataset, per_domain: int) -> np.ndarray:
    """The first `per_domain` test sentences of every domain, in index order."""
    chosen = [np.flatnonzero(test.domain_ids == d)[:per_domain]
              for d in np.unique(test.domain_ids)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def _scores(metrics: dict[str, Any]) -> dict[str, Any]:
    keep = ("bleu", "chrf", "sentences")
    return {"all": {k: metrics["all"][k] for k in keep},
            "domains": {d: {k: m[k] for k in keep} for d, m in metrics["domains"].items()}}


SENTENCE_ROUTED = ("gumbel", "sentence")
"""Adapter routers that decide from the sentence representation (a gate or a learned one)."""


def uses_domain_labels(cfg: ExperimentConfig, data_manifest: dict[str, Any]) -> bool:
    """Whether a model reads the domain label when it translates, so that RND (seed 001)
    withholds it: adapters or MoE layers routed by domain, THOR routing by the gold domain, or
    a ``<dom:NAME>`` tag in its source text (DC-Tag)."""
    a = cfg.adapters
    if a.enabled and a.router == "task" and a.task_source == "domain":
        return True
    if "domain" in task_sources(cfg).values():
        return True
    if cfg.uses_thor and cfg.thor.task_source == "domain" and cfg.thor.task_repr == "gold":
        return True
    return bool(data_manifest.get("domain_tags"))


def sentence_routers(model: torch.nn.Module, encoder: bool = True) -> list[SharedRouter]:
    """The model's sentence-level routers (gate or learned; one per stack side, shared by its
    layers): its adapters' (MoA, the adapter baselines) and its MoE FFN layers' (Switch-SL /
    SGMoE-SL trained as FFN-expert MoE models), decoder side first (`encoder` False: only
    those)."""
    found: dict[int, SharedRouter] = {}
    for layer in [*model.decoder_layers, *(model.encoder_layers if encoder else [])]:
        for slot in (layer.adapter, layer.ffn):
            moe = slot.moe if isinstance(slot, AdapterSlot) else slot
            router = getattr(moe, "router", None)
            if isinstance(router, SharedRouter) and router.name in SENTENCE_ROUTED:
                found.setdefault(id(router), router)
    return list(found.values())


@torch.no_grad()
def sentence_router_labels(inf: InferenceModel, features_ND: np.ndarray) -> np.ndarray | None:
    """Top-1 expert per sentence of the model's decoder-side sentence-level router given its
    input, the model's own mean-pooled encoder states (`learned_routing`); None when it has
    none. (An encoder-side one decides from the pooled source embeddings: not scored.)"""
    routers = sentence_routers(inf.model, encoder=False)
    if not routers:
        return None
    router = routers[0].inner.eval()
    device = next(router.parameters(), torch.empty(0)).device  # the model's, a GPU included
    x_ND = torch.from_numpy(features_ND).to(device)
    rctx = RoutingContext.from_batch(len(x_ND), 1, sentence_repr_BD=x_ND, side="decoder")
    return router.route(x_ND, rctx).expert_ids_TK[:, 0].cpu().numpy()


def learned_routing(routed: InferenceModel, backbone: InferenceModel, features_ND: np.ndarray,
                    encode: Callable[[torch.nn.Module], np.ndarray]
                    ) -> tuple[str, np.ndarray, int] | None:
    """(name, top-1 expert per sentence, its number of experts) of the routed model's own
    sentence router, or None.
    Its input is the routed model's pooled encoder output: the backbone's `features_ND` when
    the routed model is the backbone, else `encode(routed.model)` (adapters on the encoder, or
    an encoder trained further, change it)."""
    if not sentence_routers(routed.model, encoder=False):
        return None
    own_ND = features_ND if routed is backbone else encode(routed.model)
    router = sentence_routers(routed.model, encoder=False)[0]
    return f"router_{router.name}", sentence_router_labels(routed, own_ND), router.inner.num_experts


@contextmanager
def random_routing(inf: InferenceModel):
    """The model with its sentence-level routers (see `sentence_routers`) swapped for
    `RandomSentenceRouter` inside the block: each sentence goes to fixed arbitrary experts,
    with the trained router's k and combine weights (only the choice of experts changes);
    yields whether there was anything to swap."""
    saved = [(r, r.inner) for r in sentence_routers(inf.model)]
    for router, inner in saved:
        router.inner = RandomSentenceRouter(inf.cfg.model.d_model, inner.num_experts,
                                            RouterConfig(), weights_of=inner)
        router._memo = None
    try:
        yield bool(saved)
    finally:
        for router, inner in saved:
            router.inner = inner
            router._memo = None


def backbone_cache_key(export: Path, prepared: Path, split: str, ecfg: EvalConfig,
                       eval_sentences: int, max_tokens: int, rnd_seed: int | None = None,
                       device: str = "cpu", code: dict[str, Any] | None = None
                       ) -> dict[str, Any]:
    """What the backbone's test scores depend on: the export's content (weights, config,
    tokenizer), the prepared split's content and manifest, every decode setting, the seed of
    the RND label shuffle, the device, the code (`code`: the git commit and whether the tree
    was dirty) and the sacreBLEU version that scores them."""
    import sacrebleu

    prepared = Path(prepared)
    data_files = [prepared / MANIFEST, *(p for p in (prepared / split).rglob("*")
                                          if p.is_file() and not p.name.startswith("."))]
    return {"format": CACHE_FORMAT, "checkpoint_sha256": digest_tree(Path(export)),
            "test_data_sha256": digest_files(data_files, prepared), "split": split,
            "sacrebleu": sacrebleu.__version__,
            "decode": {"beam": ecfg.beam, "lenpen": ecfg.lenpen, "max_len_a": ecfg.max_len_a,
                       "max_len_b": ecfg.max_len_b, "max_sentences": ecfg.max_sentences,
                       "max_tokens": max_tokens, "sentences_per_domain": eval_sentences},
            "rnd_seed": rnd_seed, "device": device, "code": code}


def cached_scores(cache_dir: Path, key: dict[str, Any], compute: Callable[[], dict[str, Any]],
                  write: bool = True, measured_by: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The scores stored under `key` in `cache_dir` (``"cached": true``, with the
    ``measured_by`` provenance of the process that computed them), else `compute()`'s,
    stored there with `measured_by` when `write` (``"cached": false``). An entry is used only
    when its whole key matches: any change of checkpoint, data or decode settings computes
    again."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{name}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            stored = None  # a damaged entry: computed again and replaced
        if isinstance(stored, dict) and stored.get("key") == key and \
                isinstance(stored.get("scores"), dict):
            return dict(stored["scores"], cached=True, measured_by=stored.get("measured_by"))
    scores = compute()
    if write:
        write_json(path, {"key": key, "scores": scores, "measured_by": measured_by})
    return dict(scores, cached=False)


def hypotheses_file(stage_dir: Path, model: str) -> Path:
    """Where an evaluate stage's directory holds `model`'s test hypotheses ("references": the
    test targets), one per line in test-index order."""
    return stage_dir / HYP_DIR / f"{model}.txt"


def _write_lines(path: Path, lines: list[str]) -> None:
    write_text(path, lines_text(lines))


def read_lines(path: Path) -> list[str]:
    """What `_write_lines` wrote: one line per "\\n" (a line holds no other line break)."""
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _write_table(out: Path, name: str, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = np.asarray(report["table"])
    write_text(out / f"{name}.csv", table_csv(table, report["domains"]))
    plot_heatmap(table, report["domains"], f"{name}: PUR {report['pur']:.3f}, "
                 f"NMI {report['nmi']:.3f}", "domain", out / f"{name}.png",
                 row_kind="cluster" if name == "clusterer" else "expert", unit="test sentences")


def run(ctx: StageContext) -> dict[str, Any]:
    done = ctx.reuse(STAGE, ctx.cfg)
    if done is not None:
        return done
    cfg, rt, moa = ctx.cfg, ctx.rt, ctx.cfg.moa
    test = nonempty_split(cfg.data.prepared_dir, "test")
    domains = list(test.manifest["domains"])
    idx = test_indices(test, moa.eval_sentences)
    ecfg = quality_decoding(cfg)
    backbone_export = ctx.require("backbone", STAGE) / "checkpoints" / "export"
    backbone = load_for_inference(backbone_export, rt.device)
    models = {"backbone": backbone}
    # this config's stages only (never a leftover of another config), and each must be done
    stages = moa_stages(cfg)
    if "adapters" in stages:
        models["adapters"] = load_for_inference(
            ctx.require("adapters", STAGE) / "checkpoints" / "export", rt.device)
    result: dict[str, Any] = {"test_sentences": int(len(idx)), "beam": moa.eval_beam}
    gate = None
    if "distill" in stages:  # checked before hours of decoding, loaded as the adapters stage does
        gate = MoAGate(backbone.cfg.model.d_model, moa.num_clusters)
        load_matching(gate, load_gate(ctx, STAGE), ctx.stage_dir("distill") / GATE, set())
    clusterer = load_cluster(ctx, STAGE)[0] if "cluster" in stages else None  # so is this

    def scores(inf: InferenceModel) -> dict[str, Any]:
        metrics, hyps = evaluate_dataset(inf.model, test, inf.vocab, inf.manifest, rt, ecfg,
                                         cfg.data.max_tokens, indices=idx)
        entry = _scores(metrics)
        entry["hypotheses"] = [hyps[int(i)] for i in idx]
        entry["rnd"] = entry["all"]
        if uses_domain_labels(inf.cfg, test.manifest):
            shuffled = test.domain_ids.copy()
            shuffled[idx] = np.random.default_rng(moa.seed).permutation(shuffled[idx])
            rnd, _ = evaluate_dataset(inf.model, Relabeled(test, shuffled), inf.vocab,
                                      inf.manifest, rt, ecfg, cfg.data.max_tokens, indices=idx)
            entry["rnd"] = {k: rnd["all"][k] for k in ("bleu", "chrf", "sentences")}
        with random_routing(inf) as swapped:
            if swapped:
                rand, _ = evaluate_dataset(inf.model, test, inf.vocab, inf.manifest, rt, ecfg,
                                           cfg.data.max_tokens, indices=idx)
                entry["random_routing"] = {k: rand["all"][k] for k in ("bleu", "chrf")}
        entry["parameters"] = sum(p.numel() for p in inf.model.parameters())
        return entry

    for name, inf in models.items():
        if name != "backbone":
            result[name] = scores(inf)
            continue
        git = ctx.process_provenance.get("git") or {}
        key = backbone_cache_key(backbone_export, cfg.data.prepared_dir, "test", ecfg,
                                 moa.eval_sentences, cfg.data.max_tokens, rnd_seed=moa.seed,
                                 device=rt.device.type, code={k: git.get(k) for k in
                                                              ("commit", "dirty")})
        result[name] = cached_scores(ctx.stage_dir("backbone") / CACHE_DIR, key,
                                     lambda inf=inf: scores(inf), write=rt.is_main,
                                     measured_by=ctx.stage_provenance())
        result["backbone_cache_key"] = key
    out = ctx.stage_dir(STAGE)
    hypotheses = {name: result[name].pop("hypotheses") for name in models}
    if "adapters" in result:
        result["extra_parameters"] = result["adapters"]["parameters"] - \
            result["backbone"]["parameters"]

    def encode(model: torch.nn.Module) -> np.ndarray:
        return encode_sentences(model, test, idx, ctx, cfg.data.max_tokens)

    features_ND = encode(backbone.model)
    true_N = test.domain_ids[idx]
    # {name: (group per sentence, number of groups)}: a group no test sentence went to
    # keeps its row of zeros in the table
    assignments: dict[str, tuple[np.ndarray, int]] = {}
    if clusterer is not None:
        assignments["clusterer"] = clusterer.predict(features_ND), moa.num_clusters
    if gate is not None:
        assignments["distilled_gate"] = gate_labels(gate, features_ND), moa.num_clusters
    learned = learned_routing(models.get("adapters", backbone), backbone, features_ND, encode)
    if learned is not None:
        assignments[learned[0]] = learned[1], learned[2]
    reports = {name: cluster_report(labels_N, true_N, domains, groups)
               for name, (labels_N, groups) in assignments.items()}
    result["routing"] = {name: {k: report[k] for k in ("pur", "nmi", "table")}
                         for name, report in reports.items()}
    with agreed_exit(rt, f"stage {STAGE}: rank 0 failed writing its results (its error line "
                     "says why)"):
        if rt.is_main:
            _write_lines(hypotheses_file(out, "references"), [test.raw_tgt(int(i)) for i in idx])
            for name, lines in hypotheses.items():
                _write_lines(hypotheses_file(out, name), lines)
            for name, report in reports.items():
                _write_table(out / "routing", name, report)
            # what it measured, and where and by what command
            write_json(out / "eval.json", result | {"provenance": ctx.stage_provenance()})
    return ctx.finish(STAGE, result, ctx.cfg)
