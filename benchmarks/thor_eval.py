"""Measurements for benchmarks/thor.py: translation quality, experts per token, task accuracy.

- `score_split`: beam-search BLEU / chrF per domain (moe_train.eval.evaluate.evaluate_dataset),
  then one teacher-forced pass over the same sentences (eval mode, the task predicted from the
  source alone) in which forward hooks on every MoE layer's router count the experts each real
  token is sent to (003 Table 7: per layer and the mean over layers; source tokens in the
  encoder layers, reference tokens in the decoder layers) and the task predictor's argmax is
  compared with the gold task (accuracy overall, per domain, confusion matrix).
- `RawSplit`: an external test set in the OPUS layout ({domain}/{domain}.{l1}-{l2}.test.{lang}),
  encoded with the model's own sentencepiece model, readable wherever a prepared split is.
- `tfidf_domain_classifier`: a TF-IDF + logistic-regression domain classifier (scikit-learn)
  trained on the sources of the prepared training split, scored on the test sources.

Shape legend: B sentences, T tokens (flattened positions), K expert slots per token.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from moe_train.config.schema import EvalConfig
from moe_train.data.batching import eval_batches
from moe_train.data.corpus import discover, read_pairs
from moe_train.data.shards import ShardedDataset
from moe_train.eval.decode import batch_context
from moe_train.eval.evaluate import evaluate_dataset
from moe_train.models.build import moe_layers
from moe_train.moe.routing import Routing
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_PROBS_KEY
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train.export import InferenceModel

SIDES = ("encoder", "decoder")


class ExpertMeter:
    """Counts, per MoE layer, routed expert slots of real (non-pad) tokens: forward hooks on
    each layer's router read the `Routing` it returns (ids -1 are unused top-p slots)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self.slots = {name: 0 for name, _ in self.layers}
        self.tokens = {name: 0 for name, _ in self.layers}
        self._handles: list[Any] = []
        self._current = ""

    def __enter__(self) -> ExpertMeter:
        hooked: set[int] = set()
        for name, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter(name)))
            if id(layer.router) not in hooked:
                hooked.add(id(layer.router))
                self._handles.append(layer.router.register_forward_hook(self._count,
                                                                        with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, name: str) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple) -> None:
            self._current = name

        return pre_hook

    @torch.no_grad()
    def _count(self, module: nn.Module, args: tuple, kwargs: dict, routing: Routing) -> None:
        rctx = args[1] if len(args) > 1 else kwargs.get("rctx")
        ids_TK = routing.expert_ids_TK
        pad_T = None if rctx is None else rctx.pad_mask_T
        keep_T = torch.ones(ids_TK.size(0), dtype=torch.bool, device=ids_TK.device) \
            if pad_T is None else ~pad_T.to(ids_TK.device)
        self.slots[self._current] += int(((ids_TK >= 0) & keep_T[:, None]).sum())
        self.tokens[self._current] += int(keep_T.sum())

    def result(self) -> dict[str, Any] | None:
        """Experts per token: per layer, the mean over layers, and the mean over each side's
        layers; None for a dense model."""
        if not self.layers:
            return None
        per_layer = {name: self.slots[name] / max(self.tokens[name], 1) for name, _ in
                     self.layers}
        out: dict[str, Any] = {"layers": {k: round(v, 4) for k, v in per_layer.items()},
                               "mean": round(float(np.mean(list(per_layer.values()))), 4)}
        for side in SIDES:
            values = [v for k, v in per_layer.items() if k.startswith(f"{side}_layers.")]
            out[side] = round(float(np.mean(values)), 4) if values else None
        out["tokens"] = {name: self.tokens[name] for name, _ in self.layers}
        return out


def _task_accuracy(pred: list[np.ndarray], gold: list[np.ndarray], domains: list[np.ndarray],
                   names: list[str], num_tasks: int) -> dict[str, Any] | None:
    if not pred:
        return None
    p, g, d = (np.concatenate(x) for x in (pred, gold, domains))
    confusion = np.zeros((num_tasks, num_tasks), dtype=np.int64)
    np.add.at(confusion, (g, p), 1)
    return {"all": round(float((p == g).mean()), 4), "sentences": int(len(p)),
            "domains": {names[i]: round(float((p[d == i] == g[d == i]).mean()), 4)
                        for i in np.unique(d)},
            "confusion_gold_x_predicted": confusion.tolist()}


@torch.no_grad()
def teacher_forced(inf: InferenceModel, dataset: Any, max_tokens: int) -> dict[str, Any]:
    """Experts per token and task accuracy over one teacher-forced pass (see the module)."""
    model, vocab, manifest = inf.model.eval(), inf.vocab, inf.manifest
    batches = eval_batches(dataset, max_tokens, vocab.pad_id, vocab.bos_id, vocab.eos_id)
    pred: list[np.ndarray] = []
    gold: list[np.ndarray] = []
    domains: list[np.ndarray] = []
    num_tasks = 0
    device = next(model.parameters()).device
    with ExpertMeter(model) as meter:
        for batch in batches:
            batch = batch.to(device)
            ctx = batch_context(batch, vocab.pad_id, len(manifest["langs"]))
            out = model(batch.src_tokens_BS, batch.tgt_in_BT, ctx)
            probs_BK, gold_B = out.extras.get(TASK_PROBS_KEY), out.extras.get(GOLD_TASK_KEY)
            if probs_BK is not None and gold_B is not None:
                num_tasks = probs_BK.size(-1)
                pred.append(probs_BK.argmax(-1).cpu().numpy())
                gold.append(gold_B.cpu().numpy())
                domains.append(batch.domain_ids_B.cpu().numpy())
    return {"experts_per_token": meter.result(),
            "task_accuracy": _task_accuracy(pred, gold, domains, manifest["domains"],
                                            num_tasks)}


def score_split(inf: InferenceModel, dataset: Any, beam: int, max_tokens: int
                ) -> dict[str, Any]:
    """BLEU / chrF per domain (beam search), then `teacher_forced` on the same split. Where
    `evaluate_dataset` measures routing itself (``routing=True``), its experts per token and
    task accuracy are kept beside ours as a cross-check (``moe_train_evaluate``)."""
    ecfg = EvalConfig(beam=beam, lenpen=inf.cfg.eval.lenpen, max_len_a=inf.cfg.eval.max_len_a,
                      max_len_b=inf.cfg.eval.max_len_b, max_sentences=inf.cfg.eval.max_sentences)
    routing = {"routing": True} if "routing" in inspect.signature(evaluate_dataset).parameters \
        else {}
    metrics, _ = evaluate_dataset(inf.model, dataset, inf.vocab, inf.manifest, ParallelRuntime(),
                                  ecfg, max_tokens, **routing)
    out: dict[str, Any] = {
        "sentences": metrics["all"]["sentences"],
        "bleu": {d: m["bleu"] for d, m in metrics["domains"].items()} | {
            "all": metrics["all"]["bleu"]},
        "chrf": {d: m["chrf"] for d, m in metrics["domains"].items()} | {
            "all": metrics["all"]["chrf"]},
        "bleu_signature": metrics["all"]["bleu_signature"]}
    out |= teacher_forced(inf, dataset, max_tokens)
    if "routing" in metrics:
        theirs = metrics["routing"]["experts_per_token"]
        ours = out["experts_per_token"]
        out["moe_train_evaluate"] = {
            "experts_per_token": theirs, "task_accuracy": metrics["all"].get("task_accuracy"),
            "experts_per_token_mean_agrees": ours is not None and theirs.get("all") is not None
            and abs(ours["mean"] - theirs["all"]) < 1e-3}
    return out


class RawSplit:
    """The test files of an OPUS-like directory, encoded with a model's vocabulary: the arrays
    and methods `eval_batches` / `evaluate_dataset` read from a prepared split. Only the model's
    translation direction(s) and domains are kept; `skipped` names the rest."""

    def __init__(self, test_dir: str | Path, inf: InferenceModel) -> None:
        self.prepared_dir, self.split = Path(test_dir), "test"
        manifest = self.manifest = inf.manifest
        vocab = inf.vocab
        directions = sorted({f"{c['src_lang']}-{c['tgt_lang']}" for c in manifest["corpora"]})
        present = {frozenset((c.src_lang, c.tgt_lang))
                   for c in discover(test_dir, splits=["test"])}
        self.skipped: list[str] = [f"{test_dir}: no {d} test files" for d in directions
                                   if frozenset(d.split("-")) not in present]
        directions = [d for d in directions if frozenset(d.split("-")) in present]
        corpora = discover(test_dir, pairs=directions, splits=["test"]) if directions else []
        max_chars = int(manifest.get("data_config", {}).get("max_chars", 2048))
        src_ids, tgt_ids, raw_tgt, meta = [], [], [], []
        for files in corpora:
            if files.domain not in manifest["domains"]:
                self.skipped.append(f"{files.src}: domain {files.domain} is not one of the "
                                    f"model's ({', '.join(manifest['domains'])})")
                continue
            src, tgt = read_pairs(files, max_chars)
            prefix = vocab.source_prefix(
                files.domain if manifest.get("domain_tags") else None,
                files.tgt_lang if manifest.get("lang_tags") else None)
            for s, t in zip(vocab.encode_batch(src), vocab.encode_batch(tgt)):
                src_ids.append(np.asarray(prefix + s, np.int64))
                tgt_ids.append(np.asarray(t, np.int64))
            raw_tgt += tgt
            ids = (manifest["domains"].index(files.domain),
                   manifest["langs"].index(files.src_lang), manifest["langs"].index(files.tgt_lang))
            meta += [ids] * len(src)
        self._src, self._tgt, self._raw_tgt = src_ids, tgt_ids, raw_tgt
        meta_N3 = np.asarray(meta, dtype=np.int64).reshape(-1, 3)
        self.domain_ids, self.src_lang_ids, self.tgt_lang_ids = meta_N3.T.copy()
        self.corpus_ids = self.domain_ids.copy()
        self.src_lengths = np.asarray([len(s) for s in src_ids], dtype=np.int64)
        self.tgt_lengths = np.asarray([len(t) for t in tgt_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._src)

    def src(self, i: int) -> np.ndarray:
        return self._src[int(i)]

    def tgt(self, i: int) -> np.ndarray:
        return self._tgt[int(i)]

    def raw_tgt(self, i: int) -> str:
        return self._raw_tgt[int(i)]


def score_test_dir(export: str | Path, test_dir: str | Path, beam: int | None = None
                   ) -> dict[str, Any] | None:
    """BLEU / chrF of a model's export on DIR's test files (`RawSplit`: its directions and
    domains), overall, per domain and per direction; None when DIR has none of them."""
    from moe_train.train.export import load_for_inference

    inf = load_for_inference(export)
    raw = RawSplit(test_dir, inf)
    if not len(raw):
        return None
    ecfg = inf.cfg.eval if beam is None else EvalConfig(
        beam=beam, lenpen=inf.cfg.eval.lenpen, max_len_a=inf.cfg.eval.max_len_a,
        max_len_b=inf.cfg.eval.max_len_b, max_sentences=inf.cfg.eval.max_sentences)
    metrics, _ = evaluate_dataset(inf.model, raw, inf.vocab, inf.manifest, ParallelRuntime(),
                                  ecfg, inf.cfg.data.max_tokens)

    def table(group: dict[str, Any]) -> dict[str, Any]:
        return {k: {m: v[m] for m in ("sentences", "bleu", "chrf")} for k, v in group.items()}

    return {"test_dir": str(test_dir), "beam": ecfg.beam, "skipped": raw.skipped,
            "all": table({"all": metrics["all"]})["all"], "domains": table(metrics["domains"]),
            "pairs": table(metrics["pairs"]),
            "bleu_signature": metrics["all"]["bleu_signature"]}


def source_texts(dataset: Any, vocab: Any) -> list[str]:
    """Every source sentence of a split as the model reads it: its token ids decoded (domain
    and language tags dropped), so that training and test text are normalised alike."""
    skip = sum(bool(dataset.manifest.get(k)) for k in ("domain_tags", "lang_tags"))
    return [vocab.decode(dataset.src(i)[skip:]) for i in range(len(dataset))]


def tfidf_domain_classifier(prepared: Path, vocab: Any, tests: dict[str, Any]
                            ) -> dict[str, Any]:
    """TF-IDF (word 1-2 grams, sublinear tf) + logistic regression, trained on the training
    split's sources and domains; accuracy on each dataset of `tests` (name -> split)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    train = ShardedDataset(prepared, "train")
    names = train.manifest["domains"]
    settings = {"vectorizer": "TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, "
                "min_df=2)", "classifier": "LogisticRegression(C=10, max_iter=2000)"}
    clf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2),
                        LogisticRegression(C=10.0, max_iter=2000))
    clf.fit(source_texts(train, vocab), train.domain_ids)
    out: dict[str, Any] = {"train_sentences": len(train), "settings": settings}
    for name, split in tests.items():
        if len(split) == 0:
            continue
        pred, gold = clf.predict(source_texts(split, vocab)), np.asarray(split.domain_ids)
        out[name] = _task_accuracy([pred], [gold], [gold], names, len(names))
    return out
