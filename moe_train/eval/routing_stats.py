"""Routing statistics: which experts the tokens of each domain and task are sent to.

`RoutingRecorder` hooks the router of every MoE layer (no change to the layer) and counts each
routed token slot against its expert and the domain, language pair and target language of its
sentence. With a THOR task predictor in the model it also hooks the predictor and counts
predicted vs gold task per sentence, token slots per expert and gold / predicted task, and for
THOR layers with candidate sets which experts each sentence's S^t holds (recomputed from the
E_p in the routing context with `ThorRouter.candidate_sets`) and whether each candidate got a
token. `collect_routing_stats` runs teacher-forced forwards over a prepared split, sharded over
ranks and summed with one all-reduce (the counts: routing_counts.py); routing_tables.py turns
the counts into tables, metrics and files (re-exported here).

What is counted: router decisions for real tokens. Padding is never counted; a slot that expert
capacity drops later is (it was routed there); with k > 1 a token counts once per slot, and a
slot with id -1 (top-p, or outside S^t) not at all. A soft router (`Router.soft`: Gated
Adapters' gate mixes all E adapters into every token) would fill every expert equally; its
tokens count once, at their largest-weight expert. In THOR models the encoder's [CLS] position
is a real token.

Shape legend: B sentences, T tokens (the flattened B x length positions, padding included),
K expert slots per token, E experts, N domains, L languages, P language pairs (L * L),
C columns of a table, Q task-predictor classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from moe_train.data.batching import eval_batches
from moe_train.errors import ConfigError, DataError
from moe_train.eval.decode import batch_context
from moe_train.eval.routing_counts import LayerCounts, TaskCounts
from moe_train.eval.routing_tables import (  # noqa: F401  (re-exported)
    ALL_LAYERS_FILE, CONFUSION_FILE, LAYERS_FILE, SUMMARY_FILE, TABLE_KINDS, THOR_TABLE_KINDS,
    LayerTables, RoutingStats, TaskPrediction, check_out_dir, column_purity, expert_purity,
    load_cv, normalized_mutual_info, plot_heatmap, table_csv, write_routing_stats)
from moe_train.models.build import moe_layers
from moe_train.models.context import ForwardContext
from moe_train.models.lm_batch import teacher_forced
from moe_train.moe.routing import Routing, RoutingContext
from moe_train.moe.thor_router import (GOLD_TASK_KEY, TASK_PROBS_KEY, TASK_REPR_KEY,
                                       TaskPredictor, ThorRouter)
from moe_train.parallel.collectives import all_reduce_sum
from moe_train.parallel.runtime import ParallelRuntime

_UNSET = object()  # set_batch not called yet


# ---------------------------------------------------------------------------------- recording
@dataclass
class _Pending:
    """One layer's per-sentence counts of a forward, waiting for the task predictions (an MoE
    layer may route before the predictor runs)."""

    layer: str
    slots_EB: Tensor
    tokens_B: Tensor
    in_set_BE: Tensor | None


class RoutingRecorder:
    """Context manager counting, per MoE layer, routed token slots by expert x domain / task.

    Forward hooks on each layer's router read the `Routing` it returns and the `RoutingContext`
    it was given (padding mask, token -> sentence map, E_p). The sentences' domains and
    languages come from the `ForwardContext` passed to `set_batch` before each forward;
    ``set_batch(None)`` runs forwards without counting them (filler batches). A `TaskPredictor`
    in the model is hooked too (predicted vs gold task). Hooks are removed on exit; `tables()`
    and `task_tables()` stay readable afterwards.
    """

    def __init__(self, model: nn.Module, num_domains: int, num_langs: int) -> None:
        if num_domains < 1 or num_langs < 1:
            raise ValueError(f"RoutingRecorder: need at least one domain and one language, got "
                             f"{num_domains} domains and {num_langs} languages")
        self.layers = moe_layers(model)
        self.num_domains, self.num_langs = num_domains, num_langs
        predictors = [m for m in model.modules() if isinstance(m, TaskPredictor)]
        if len(predictors) > 1:
            raise ValueError(f"RoutingRecorder: the model has {len(predictors)} task predictors,"
                             " expected at most one")
        self.predictor: TaskPredictor | None = predictors[0] if predictors else None
        self.num_tasks = self.predictor.num_tasks if self.predictor is not None else 0
        """Q, the predictor's classes (0: no task predictor)."""
        self.task_source = self.predictor.cfg.task_source if self.predictor is not None else None
        self.sentences = 0
        """Sentences of the counted batches."""
        self._counts: dict[str, LayerCounts] = {}
        self._task = TaskCounts.zeros(self.num_tasks, num_domains, num_langs) \
            if self.predictor is not None else None
        self._labels: Any = _UNSET
        self._pending: list[_Pending] = []
        self._predicted: tuple[Tensor, Tensor | None] | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._current = ""
        """The MoE layer whose router is running."""

    def __enter__(self) -> RoutingRecorder:
        # A router may serve several layers (one sentence-level decision for all): hook each
        # router once, and let each layer announce itself before its router runs.
        hooked: set[int] = set()
        for name, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(name)))
            if id(layer.router) not in hooked:
                hooked.add(id(layer.router))
                self._handles.append(
                    layer.router.register_forward_hook(self._hook(), with_kwargs=True))
        if self.predictor is not None:
            self._handles.append(self.predictor.register_forward_hook(self._predictor_hook))
        return self

    def _enter_layer(self, name: str) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple) -> None:
            self._current = name

        return pre_hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._flush()
        self._labels = _UNSET

    def set_batch(self, ctx: ForwardContext | None) -> None:
        """Label the next forwards with `ctx`'s per-sentence domain / language ids (None: the
        forwards that follow are not counted)."""
        self._flush()
        if ctx is None:
            self._labels = None
            return
        fields = {"domain_ids_B": (ctx.domain_ids_B, self.num_domains),
                  "src_lang_B": (ctx.src_lang_B, self.num_langs),
                  "tgt_lang_B": (ctx.tgt_lang_B, self.num_langs)}
        for key, (ids_B, limit) in fields.items():
            if ids_B is None:
                raise ValueError(f"RoutingRecorder.set_batch: ForwardContext.{key} is missing")
            if ids_B.numel() and (int(ids_B.min()) < 0 or int(ids_B.max()) >= limit):
                raise ValueError(f"RoutingRecorder.set_batch: ForwardContext.{key} has ids "
                                 f"outside [0, {limit})")
        domain_B, src_B, tgt_B = (ids.long() for ids in (ctx.domain_ids_B, ctx.src_lang_B,
                                                         ctx.tgt_lang_B))
        self._labels = (domain_B, src_B * self.num_langs + tgt_B, tgt_B)
        self.sentences += int(domain_B.numel())

    def tables(self) -> dict[str, LayerCounts]:
        """Copies of the counts so far, per layer name in module order (zeros if never run)."""
        self._flush()
        out = {}
        for name, layer in self.layers:
            counts = self._counts.get(name)
            out[name] = counts.clone() if counts is not None else LayerCounts.zeros(
                layer.router.num_experts, self.num_domains, self.num_langs, self.num_tasks)
        return out

    def task_tables(self) -> TaskCounts | None:
        """A copy of the task-prediction counts (None: the model has no task predictor)."""
        self._flush()
        return None if self._task is None else self._task.clone()

    # ------------------------------------------------------------------------- hooks
    def _hook(self) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, routing: Routing) -> None:
            name = self._current
            if self._labels is _UNSET:
                raise RuntimeError("RoutingRecorder: call set_batch(ctx) before each forward "
                                   "(set_batch(None) to run one without counting it)")
            if self._labels is None:
                return
            rctx = args[1] if len(args) > 1 else kwargs.get("rctx")
            self._count(name, module, routing, rctx)

        return hook

    @torch.no_grad()
    def _predictor_hook(self, module: nn.Module, args: tuple, output: tuple) -> None:
        if self._labels is _UNSET or self._labels is None:
            return  # the router hooks complain about a missing set_batch
        if self._predicted is not None:
            self._flush()  # a second forward on the same labels
        extras = output[0]
        pred_B = extras[TASK_PROBS_KEY].argmax(-1)
        gold_B = extras.get(GOLD_TASK_KEY)
        domain_B, pair_B, _ = (ids.to(pred_B.device) for ids in self._labels)
        if pred_B.numel() != domain_B.numel():
            raise ValueError(f"RoutingRecorder: the task predictor saw {pred_B.numel()} "
                             f"sentences but set_batch labelled {domain_B.numel()}")
        self._predicted = (pred_B, gold_B)
        if gold_B is None:
            return
        gold_B = gold_B.to(pred_B.device).long()
        task, Q = self._task, self.num_tasks
        if task.confusion_QQ.device != pred_B.device:
            self._task = task = TaskCounts(*(t.to(pred_B.device) for t in task.tensors()))
        task.confusion_QQ += torch.bincount(pred_B * Q + gold_B, minlength=Q * Q).view(Q, Q)
        right_B = (pred_B == gold_B).long()
        for correct, total, ids_B in ((task.correct_N, task.sentences_N, domain_B),
                                      (task.correct_P, task.sentences_P, pair_B)):
            correct.index_add_(0, ids_B, right_B)
            total.index_add_(0, ids_B, torch.ones_like(right_B))

    @torch.no_grad()
    def _count(self, name: str, router: nn.Module, routing: Routing,
               rctx: RoutingContext | None) -> None:
        if rctx is None or rctx.sentence_ids_T is None:
            raise ValueError(f"RoutingRecorder: the router of {name} was called without a "
                             "RoutingContext mapping tokens to sentences")
        ids_TK = routing.expert_ids_TK
        if getattr(router, "soft", False):  # every expert in every slot: its dominant one
            ids_TK = routing.weights_TK.argmax(-1, keepdim=True)
        dev, E, B = ids_TK.device, routing.num_experts, rctx.num_sentences
        domain_B, pair_B, tgt_B = (ids.to(dev) for ids in self._labels)
        if domain_B.numel() != B:
            raise ValueError(f"RoutingRecorder: {name} routed {B} sentences but "
                             f"set_batch labelled {domain_B.numel()}")
        counts = self._counts.get(name)
        if counts is None:
            counts = LayerCounts.zeros(E, self.num_domains, self.num_langs, self.num_tasks, dev)
            self._counts[name] = counts
        keep_T = (torch.ones(ids_TK.size(0), dtype=torch.bool, device=dev)
                  if rctx.pad_mask_T is None else ~rctx.pad_mask_T.to(dev))
        sentence_T = rctx.sentence_ids_T.to(dev)
        slot_TK = (ids_TK >= 0) & keep_T[:, None]
        expert_S = ids_TK[slot_TK]  # S: the counted slots
        sentence_S = sentence_T[:, None].expand_as(ids_TK)[slot_TK]
        for table_EC, labels_B in ((counts.expert_domain_EN, domain_B),
                                   (counts.expert_pair_EP, pair_B),
                                   (counts.expert_tgt_EL, tgt_B)):
            C = table_EC.size(1)
            flat = torch.bincount(expert_S * C + labels_B[sentence_S], minlength=E * C)
            table_EC += flat.view(E, C)
        tokens_B = torch.bincount(sentence_T[keep_T], minlength=B)
        counts.tokens_domain_N.index_add_(0, domain_B, tokens_B)
        counts.tokens_pair_P.index_add_(0, pair_B, tokens_B)
        n_real = keep_T.sum()
        counts.tokens += n_real
        if routing.probs_TE is not None:
            entropy_T = torch.special.entr(routing.probs_TE.detach().double()).sum(-1)
            counts.entropy_sum += entropy_T[keep_T].sum()
            counts.entropy_tokens += n_real
        in_set_BE = None
        if isinstance(router, ThorRouter) and router.candidates:
            in_set_BE = self._count_candidates(counts, router, rctx, expert_S, sentence_S,
                                               tokens_B)
        if self.predictor is not None:
            slots_EB = torch.bincount(expert_S * B + sentence_S, minlength=E * B).view(E, B)
            self._pending.append(_Pending(name, slots_EB, tokens_B, in_set_BE))

    @staticmethod
    def _count_candidates(counts: LayerCounts, router: ThorRouter, rctx: RoutingContext,
                          expert_S: Tensor, sentence_S: Tensor, tokens_B: Tensor) -> Tensor:
        """S^t of each sentence (recomputed from E_p as the router does), how many sentences
        hold each expert, and which candidates received a real token slot. Returns the
        (B, E) candidate mask, real sentences only."""
        B, E = rctx.num_sentences, router.num_experts
        _, cand_BC, _ = router.candidate_sets(rctx.require(TASK_REPR_KEY, router.name))
        cand_BC = cand_BC.to(tokens_B.device)
        real_B = tokens_B > 0
        in_set_BE = torch.zeros(B, E, dtype=torch.bool, device=cand_BC.device)
        in_set_BE.scatter_(1, cand_BC, True)
        in_set_BE &= real_B[:, None]
        hit_BE = torch.zeros(B, E, dtype=torch.bool, device=cand_BC.device)
        hit_BE[sentence_S, expert_S] = True
        counts.candidate_E += in_set_BE.sum(0)
        counts.candidate_sentences += real_B.sum()
        counts.candidate_pairs += in_set_BE.sum()
        counts.candidate_used += (hit_BE & in_set_BE).sum()
        return in_set_BE

    @torch.no_grad()
    def _flush(self) -> None:
        """Book the pending per-sentence counts under the predicted and gold tasks."""
        pending, predicted = self._pending, self._predicted
        self._pending, self._predicted = [], None
        if predicted is None:
            return  # no prediction: a filler, or a forward that failed
        pred_B, gold_B = predicted
        for item in pending:
            counts = self._counts[item.layer]
            dev = item.slots_EB.device
            counts.expert_pred_EQ.index_add_(1, pred_B.to(dev), item.slots_EB)
            if gold_B is None:
                continue
            gold = gold_B.to(dev).long()
            counts.expert_gold_EQ.index_add_(1, gold, item.slots_EB)
            counts.tokens_gold_Q.index_add_(0, gold, item.tokens_B)
            if item.in_set_BE is not None:
                counts.candidate_gold_EQ.index_add_(1, gold, item.in_set_BE.T.long())


# ------------------------------------------------------------------------------- collection
def _check_ids(dataset: Any, num_domains: int, num_langs: int) -> None:
    for key, limit, what in (("domain_ids", num_domains, "domains"),
                             ("src_lang_ids", num_langs, "langs"),
                             ("tgt_lang_ids", num_langs, "langs")):
        ids = np.asarray(getattr(dataset, key))
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            raise DataError(f"routing-stats: the split has {key} up to {int(ids.max())} but the "
                            f"manifest lists {limit} {what}; run `moe-train prepare` again")


def _all_reduce_counts(rt: ParallelRuntime, counts: dict[str, LayerCounts],
                       task: TaskCounts | None, sentences: int
                       ) -> tuple[dict[str, LayerCounts], TaskCounts | None, int]:
    """Sum the counts of every rank with one collective (float64 is exact below 2**53)."""
    groups = [c.tensors() for c in counts.values()] + ([task.tensors()] if task else [])
    parts = [t.reshape(-1).to(rt.device, torch.float64) for g in groups for t in g]
    flat = torch.cat(parts + [torch.tensor([float(sentences)], device=rt.device,
                                           dtype=torch.float64)])
    flat = all_reduce_sum(rt, flat).cpu()
    summed, pos = [], 0
    for group in groups:
        tensors = []
        for t in group:
            chunk = flat[pos:pos + t.numel()].view(t.shape)
            pos += t.numel()
            tensors.append(chunk if t.is_floating_point() else chunk.round().long())
        summed.append(tensors)
    out = {name: LayerCounts(*tensors) for name, tensors in zip(counts, summed)}
    task_out = TaskCounts(*summed[-1]) if task else None
    return out, task_out, int(round(float(flat[pos])))


def task_names(source: str, num_tasks: int, manifest: dict[str, Any]) -> list[str]:
    """Name of each predictor class: the domain, language or src-tgt pair it stands for
    (``task<i>`` beyond what the manifest names)."""
    domains, langs = list(manifest["domains"]), list(manifest["langs"])
    L = len(langs)
    if source == "domain":
        named = domains
    elif source in ("tgt_lang", "src_lang", "other_lang"):
        named = langs
    else:
        named = [f"{langs[p // L]}-{langs[p % L]}" for p in range(L * L)]
    return [named[q] if q < len(named) else f"task{q}" for q in range(num_tasks)]


def _manifest_tasks(source: str, manifest: dict[str, Any]) -> set[int]:
    """The task ids the manifest's data has (all domains; the corpora's languages / pairs)."""
    if source == "domain":
        return set(range(len(manifest["domains"])))
    L, corpora = len(manifest["langs"]), manifest.get("corpora", [])
    if source == "other_lang":  # either side may be the non-pivot one
        return {int(c[k]) for c in corpora for k in ("src_lang_id", "tgt_lang_id")}
    key = {"tgt_lang": lambda c: int(c["tgt_lang_id"]),
           "src_lang": lambda c: int(c["src_lang_id"]),
           "lang_pair": lambda c: int(c["src_lang_id"]) * L + int(c["tgt_lang_id"])}[source]
    return {key(c) for c in corpora}


def stats_from_counts(counts: dict[str, LayerCounts], manifest: dict[str, Any], sentences: int,
                      task: TaskCounts | None = None, task_source: str | None = None
                      ) -> RoutingStats:
    """Name the columns from the manifest. Language-pair / target-language columns (and the
    predictor's task columns) are those the manifest's corpora list, plus any seen in the
    counts, in id order."""
    domains, langs = list(manifest["domains"]), list(manifest["langs"])
    L = len(langs)
    pairs = {int(c["src_lang_id"]) * L + int(c["tgt_lang_id"])
             for c in manifest.get("corpora", [])}
    tgts = {int(c["tgt_lang_id"]) for c in manifest.get("corpora", [])}

    def seen(t: Tensor, dim: int = 0) -> set[int]:
        return set(torch.nonzero(t.sum(dim)).view(-1).tolist()) if t.numel() else set()

    for c in counts.values():
        pairs |= seen(c.expert_pair_EP)
        tgts |= seen(c.expert_tgt_EL)
    pair_ids, tgt_ids = sorted(pairs), sorted(tgts)
    task_ids: list[int] = []
    if task is not None:
        Q = task.confusion_QQ.size(0)
        ids = {q for q in _manifest_tasks(task_source, manifest) if q < Q}
        ids |= seen(task.confusion_QQ, 0) | seen(task.confusion_QQ, 1)
        for c in counts.values():
            ids |= seen(c.expert_gold_EQ) | seen(c.expert_pred_EQ)
        task_ids = sorted(ids)

    def np_(t: Tensor, cols: list[int] | None = None) -> np.ndarray:
        a = t.cpu().numpy().astype(np.int64)
        return a if cols is None else a[..., cols]

    layers = {}
    for name, c in counts.items():
        n_ent = int(c.entropy_tokens)
        has_sets = int(c.candidate_sentences) > 0
        layers[name] = LayerTables(
            expert_domain=np_(c.expert_domain_EN), expert_task=np_(c.expert_pair_EP, pair_ids),
            expert_tgt_lang=np_(c.expert_tgt_EL, tgt_ids), tokens=int(c.tokens),
            routing_entropy=float(c.entropy_sum) / n_ent if n_ent else None,
            tokens_domain=np_(c.tokens_domain_N), tokens_task=np_(c.tokens_pair_P, pair_ids),
            expert_gold_task=np_(c.expert_gold_EQ, task_ids) if task is not None else None,
            expert_pred_task=np_(c.expert_pred_EQ, task_ids) if task is not None else None,
            candidate_gold_task=(np_(c.candidate_gold_EQ, task_ids)
                                 if task is not None and has_sets else None),
            candidates_per_expert=np_(c.candidate_E) if has_sets else None,
            candidate_sentences=int(c.candidate_sentences),
            candidate_pairs=int(c.candidate_pairs), candidate_used=int(c.candidate_used))
    prediction = None
    if task is not None:
        ids_Q = np.asarray(task_ids, dtype=np.int64)
        prediction = TaskPrediction(
            source=task_source, confusion=np_(task.confusion_QQ)[np.ix_(ids_Q, ids_Q)],
            correct_domain=np_(task.correct_N), sentences_domain=np_(task.sentences_N),
            correct_task=np_(task.correct_P, pair_ids), sentences_task=np_(task.sentences_P,
                                                                           pair_ids))
    names = task_names(task_source, max(task_ids, default=-1) + 1, manifest) \
        if task is not None else None
    return RoutingStats(layers=layers, domains=domains,
                        tasks=[f"{langs[p // L]}-{langs[p % L]}" for p in pair_ids],
                        tgt_langs=[langs[t] for t in tgt_ids], sentences=sentences,
                        pred_tasks=None if names is None else [names[q] for q in task_ids],
                        task_prediction=prediction)


@torch.no_grad()
def collect_routing_stats(model: nn.Module, dataset: Any, manifest: dict[str, Any],
                          rt: ParallelRuntime, max_tokens: int,
                          max_batches: int | None = None,
                          indices: np.ndarray | None = None) -> RoutingStats:
    """Teacher-forced forwards (eval mode) over `dataset` (all, or `indices`), sharded over
    ranks; every rank returns the routing tables summed over all ranks.

    Each rank runs the same number of batches (filler batches run but are not counted), so
    collectives inside the model stay in lockstep; `max_batches` caps the batches per rank.
    The task predictor sees the source only, as at inference.
    """
    layers = moe_layers(model)
    if not layers:
        raise ConfigError("moe.num_experts: routing statistics need an MoE model, this one has "
                          "no MoE layer")
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be non-negative, got {max_batches}")
    num_domains, num_langs = len(manifest["domains"]), len(manifest["langs"])
    _check_ids(dataset, num_domains, num_langs)
    pad_id = manifest["pad_id"]
    batches = eval_batches(dataset, max_tokens, pad_id, manifest["bos_id"], manifest["eos_id"],
                           dp_rank=rt.dp_rank, dp_world=rt.dp_world, indices=indices)
    if max_batches is not None:
        batches = batches[:max_batches]
    was_training = model.training
    model.eval()
    try:
        with RoutingRecorder(model, num_domains, num_langs) as recorder:
            for batch in batches:
                batch = batch.to(rt.device)
                ctx = batch_context(batch, pad_id, num_langs)
                recorder.set_batch(None if batch.is_padding else ctx)
                teacher_forced(model, batch.src_tokens_BS, batch.tgt_in_BT, ctx, pad_id,
                               getattr(model, "decoder_only", False))
    finally:
        model.train(was_training)
    counts, task, sentences = _all_reduce_counts(rt, recorder.tables(), recorder.task_tables(),
                                                 recorder.sentences)
    return stats_from_counts(counts, manifest, sentences, task, recorder.task_source)
