"""Routing statistics: which experts the tokens of each domain and task are sent to.

`RoutingRecorder` hooks the router of every MoE layer (no change to the layer) and counts each
routed token slot against its expert and the domain, language pair and target language of its
sentence. `collect_routing_stats` runs teacher-forced forwards over a prepared split, sharded over
ranks and summed with one all-reduce; `write_routing_stats` writes the tables as CSV, heatmaps
normalised per domain / task (seed 001, Figs. 4-5) as PNG and summary metrics as JSON.

What is counted: router decisions for real tokens. Padding is never counted; a slot that expert
capacity drops later is (it was routed there); with k > 1 a token counts once per slot.

Shape legend: B sentences, T tokens (the flattened B x length positions, padding included),
K expert slots per token, E experts, N domains, L languages, P language pairs (L * L),
C columns of a table (domains or tasks).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from moe_train.data.batching import eval_batches
from moe_train.errors import ConfigError, DataError
from moe_train.eval.decode import batch_context
from moe_train.models.build import moe_layers
from moe_train.models.context import ForwardContext
from moe_train.moe.routing import Routing, RoutingContext
from moe_train.parallel.collectives import all_reduce_sum
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.utils.atomic import atomic_dir, atomic_path, write_json, write_text

SUMMARY_FILE = "summary.json"
ALL_LAYERS_FILE = "all_layers.csv"
TABLE_KINDS = ("expert_domain", "expert_task", "expert_tgt_lang")
"""Per-layer tables written as ``{layer}.{kind}.csv`` and ``{layer}.{kind}.png``."""

_UNSET = object()  # set_batch not called yet


# ---------------------------------------------------------------------------------- recording
@dataclass
class LayerCounts:
    """Raw routing counts of one MoE layer, indexed by the manifest's ids."""

    expert_domain_EN: Tensor
    """Token slots per (expert, domain id), long."""
    expert_pair_EP: Tensor
    """Token slots per (expert, language pair id src * L + tgt), long."""
    expert_tgt_EL: Tensor
    """Token slots per (expert, target-language id), long."""
    tokens: Tensor
    """Real (non-pad) tokens routed, long scalar."""
    entropy_tokens: Tensor
    """Real tokens whose router gave a distribution (probs_TE), long scalar."""
    entropy_sum: Tensor
    """Summed router entropy (nats) of those tokens, float64 scalar."""

    @classmethod
    def zeros(cls, num_experts: int, num_domains: int, num_langs: int,
              device: torch.device | str | None = None) -> LayerCounts:
        def z(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(z(num_experts, num_domains), z(num_experts, num_langs * num_langs),
                   z(num_experts, num_langs), z(), z(), z(dtype=torch.float64))

    def tensors(self) -> list[Tensor]:
        """The fields in declaration order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def clone(self) -> LayerCounts:
        return LayerCounts(*(t.clone() for t in self.tensors()))


class RoutingRecorder:
    """Context manager counting, per MoE layer, routed token slots by expert x domain / task.

    Forward hooks on each layer's router read the `Routing` it returns and the `RoutingContext`
    it was given (padding mask, token -> sentence map). The sentences' domains and languages come
    from the `ForwardContext` passed to `set_batch` before each forward; ``set_batch(None)`` runs
    forwards without counting them (filler batches). Hooks are removed on exit; `tables()` stays
    readable afterwards.
    """

    def __init__(self, model: nn.Module, num_domains: int, num_langs: int) -> None:
        if num_domains < 1 or num_langs < 1:
            raise ValueError(f"RoutingRecorder: need at least one domain and one language, got "
                             f"{num_domains} domains and {num_langs} languages")
        self.layers = moe_layers(model)
        self.num_domains, self.num_langs = num_domains, num_langs
        self.sentences = 0
        """Sentences of the counted batches."""
        self._counts: dict[str, LayerCounts] = {}
        self._labels: Any = _UNSET
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
        return self

    def _enter_layer(self, name: str) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple) -> None:
            self._current = name

        return pre_hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._labels = _UNSET

    def set_batch(self, ctx: ForwardContext | None) -> None:
        """Label the next forwards with `ctx`'s per-sentence domain / language ids (None: the
        forwards that follow are not counted)."""
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
        out = {}
        for name, layer in self.layers:
            counts = self._counts.get(name)
            out[name] = counts.clone() if counts is not None else LayerCounts.zeros(
                layer.router.num_experts, self.num_domains, self.num_langs)
        return out

    def _hook(self) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, routing: Routing) -> None:
            name = self._current
            if self._labels is _UNSET:
                raise RuntimeError("RoutingRecorder: call set_batch(ctx) before each forward "
                                   "(set_batch(None) to run one without counting it)")
            if self._labels is None:
                return
            rctx = args[1] if len(args) > 1 else kwargs.get("rctx")
            self._count(name, routing, rctx)

        return hook

    @torch.no_grad()
    def _count(self, name: str, routing: Routing, rctx: RoutingContext | None) -> None:
        if rctx is None or rctx.sentence_ids_T is None:
            raise ValueError(f"RoutingRecorder: the router of {name} was called without a "
                             "RoutingContext mapping tokens to sentences")
        ids_TK = routing.expert_ids_TK
        dev, E = ids_TK.device, routing.num_experts
        domain_B, pair_B, tgt_B = (ids.to(dev) for ids in self._labels)
        if domain_B.numel() != rctx.num_sentences:
            raise ValueError(f"RoutingRecorder: {name} routed {rctx.num_sentences} sentences but "
                             f"set_batch labelled {domain_B.numel()}")
        counts = self._counts.get(name)
        if counts is None:
            counts = LayerCounts.zeros(E, self.num_domains, self.num_langs, dev)
            self._counts[name] = counts
        keep_T = (torch.ones(ids_TK.size(0), dtype=torch.bool, device=dev)
                  if rctx.pad_mask_T is None else ~rctx.pad_mask_T.to(dev))
        slot_TK = (ids_TK >= 0) & keep_T[:, None]
        expert_S = ids_TK[slot_TK]  # S: the counted slots
        sentence_S = rctx.sentence_ids_T.to(dev)[:, None].expand_as(ids_TK)[slot_TK]
        for table_EC, labels_B in ((counts.expert_domain_EN, domain_B),
                                   (counts.expert_pair_EP, pair_B),
                                   (counts.expert_tgt_EL, tgt_B)):
            C = table_EC.size(1)
            flat = torch.bincount(expert_S * C + labels_B[sentence_S], minlength=E * C)
            table_EC += flat.view(E, C)
        n_real = keep_T.sum()
        counts.tokens += n_real
        if routing.probs_TE is not None:
            entropy_T = torch.special.entr(routing.probs_TE.detach().double()).sum(-1)
            counts.entropy_sum += entropy_T[keep_T].sum()
            counts.entropy_tokens += n_real


# ------------------------------------------------------------------------------------ tables
@dataclass
class LayerTables:
    """One layer's routing tables over the whole split (rows: experts)."""

    expert_domain: np.ndarray
    """(E, domains) token slots, int64."""
    expert_task: np.ndarray
    """(E, language pairs) token slots, int64."""
    expert_tgt_lang: np.ndarray
    """(E, target languages) token slots, int64."""
    tokens: int
    """Real tokens routed."""
    routing_entropy: float | None
    """Mean per-token router entropy in nats (None: the router has no distribution)."""


@dataclass
class RoutingStats:
    """Routing tables of every MoE layer plus the column names shared by all layers."""

    layers: dict[str, LayerTables]
    domains: list[str]
    tasks: list[str]
    """Language pairs as src-tgt."""
    tgt_langs: list[str]
    sentences: int

    @classmethod
    def from_counts(cls, counts: dict[str, LayerCounts], manifest: dict[str, Any],
                    sentences: int) -> RoutingStats:
        """Name the columns from the manifest. Task / target-language columns are the pairs and
        targets the manifest's corpora list, plus any seen in the counts, in id order."""
        domains, langs = list(manifest["domains"]), list(manifest["langs"])
        L = len(langs)
        pairs = {int(c["src_lang_id"]) * L + int(c["tgt_lang_id"])
                 for c in manifest.get("corpora", [])}
        tgts = {int(c["tgt_lang_id"]) for c in manifest.get("corpora", [])}
        for c in counts.values():
            pairs |= set(torch.nonzero(c.expert_pair_EP.sum(0)).view(-1).tolist())
            tgts |= set(torch.nonzero(c.expert_tgt_EL.sum(0)).view(-1).tolist())
        pair_ids, tgt_ids = sorted(pairs), sorted(tgts)
        layers = {}
        for name, c in counts.items():
            n_ent = int(c.entropy_tokens)
            layers[name] = LayerTables(
                expert_domain=c.expert_domain_EN.cpu().numpy().astype(np.int64),
                expert_task=c.expert_pair_EP.cpu().numpy()[:, pair_ids].astype(np.int64),
                expert_tgt_lang=c.expert_tgt_EL.cpu().numpy()[:, tgt_ids].astype(np.int64),
                tokens=int(c.tokens),
                routing_entropy=float(c.entropy_sum) / n_ent if n_ent else None)
        return cls(layers=layers, domains=domains,
                   tasks=[f"{langs[p // L]}-{langs[p % L]}" for p in pair_ids],
                   tgt_langs=[langs[t] for t in tgt_ids], sentences=sentences)

    def table(self, layer: str, kind: str) -> tuple[np.ndarray, list[str]]:
        """(E, C) table of `kind` (one of TABLE_KINDS) and its column names."""
        if kind not in TABLE_KINDS:
            raise ValueError(f"table kind: expected one of {', '.join(TABLE_KINDS)}, got {kind!r}")
        columns = {"expert_domain": self.domains, "expert_task": self.tasks,
                   "expert_tgt_lang": self.tgt_langs}[kind]
        return getattr(self.layers[layer], kind), columns

    def summary(self) -> dict[str, Any]:
        """Per-layer metrics (JSON-serialisable): load, entropy, purity, NMI."""
        layers = {}
        for name, t in self.layers.items():
            per_expert_E = t.expert_domain.sum(1)
            layers[name] = {
                "num_experts": int(t.expert_domain.shape[0]),
                "tokens": t.tokens,
                "token_slots": int(per_expert_E.sum()),
                "tokens_per_expert": per_expert_E.tolist(),
                "load_cv": load_cv(per_expert_E),
                "routing_entropy": t.routing_entropy,
                "domain_purity": dict(zip(self.domains, column_purity(t.expert_domain))),
                "task_purity": dict(zip(self.tasks, column_purity(t.expert_task))),
                "tgt_lang_purity": dict(zip(self.tgt_langs, column_purity(t.expert_tgt_lang))),
                "expert_purity": expert_purity(t.expert_domain),
                "domain_nmi": normalized_mutual_info(t.expert_domain),
            }
        return {"sentences": self.sentences, "domains": self.domains, "tasks": self.tasks,
                "tgt_langs": self.tgt_langs, "layers": layers}


# ----------------------------------------------------------------------------------- metrics
def load_cv(tokens_per_expert_E: np.ndarray) -> float | None:
    """Coefficient of variation (population std / mean) of the expert loads; 0 is balanced."""
    load_E = np.asarray(tokens_per_expert_E, dtype=np.float64)
    mean = load_E.mean() if load_E.size else 0.0
    return float(load_E.std() / mean) if mean > 0 else None


def column_purity(table_EC: np.ndarray) -> list[float | None]:
    """Per column (domain / task): the share of its slots on its most used expert."""
    table_EC = np.asarray(table_EC, dtype=np.float64)
    total_C = table_EC.sum(0)
    return [float(table_EC[:, c].max() / total_C[c]) if total_C[c] > 0 else None
            for c in range(table_EC.shape[1])]


def expert_purity(table_EN: np.ndarray) -> float | None:
    """PUR of seed 001 Eq. 11: (1/U) sum over experts of the expert's largest domain count."""
    table_EN = np.asarray(table_EN, dtype=np.float64)
    total = table_EN.sum()
    return float(table_EN.max(1).sum() / total) if total > 0 else None


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def normalized_mutual_info(table_EN: np.ndarray) -> float | None:
    """NMI between expert and domain labels of the slots (arithmetic-mean normalisation)."""
    n_EN = np.asarray(table_EN, dtype=np.float64)
    total = n_EN.sum()
    if total <= 0:
        return None
    n_E, n_N = n_EN.sum(1), n_EN.sum(0)
    h_e, h_n = _entropy(n_E), _entropy(n_N)
    if h_e == 0.0 and h_n == 0.0:
        return 1.0  # one expert and one domain: identical labelings
    nz = n_EN > 0
    mi = float((n_EN[nz] / total * np.log(total * n_EN[nz] / np.outer(n_E, n_N)[nz])).sum())
    return max(0.0, mi) / (0.5 * (h_e + h_n))


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
                       sentences: int) -> tuple[dict[str, LayerCounts], int]:
    """Sum the counts of every rank with one collective (float64 is exact below 2**53)."""
    parts = [t.reshape(-1).to(rt.device, torch.float64)
             for c in counts.values() for t in c.tensors()]
    flat = torch.cat(parts + [torch.tensor([float(sentences)], device=rt.device,
                                           dtype=torch.float64)])
    flat = all_reduce_sum(rt, flat).cpu()
    out, pos = {}, 0
    for name, c in counts.items():
        tensors = []
        for t in c.tensors():
            chunk = flat[pos:pos + t.numel()].view(t.shape)
            pos += t.numel()
            tensors.append(chunk if t.is_floating_point() else chunk.round().long())
        out[name] = LayerCounts(*tensors)
    return out, int(round(float(flat[pos])))


@torch.no_grad()
def collect_routing_stats(model: nn.Module, dataset: Any, manifest: dict[str, Any],
                          rt: ParallelRuntime, max_tokens: int,
                          max_batches: int | None = None) -> RoutingStats:
    """Teacher-forced forwards (eval mode) over `dataset`, sharded over ranks; every rank returns
    the routing tables summed over all ranks.

    Each rank runs the same number of batches (filler batches run but are not counted), so
    collectives inside the model stay in lockstep; `max_batches` caps the batches per rank.
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
                           dp_rank=rt.dp_rank, dp_world=rt.dp_world)
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
                model(batch.src_tokens_BS, batch.tgt_in_BT, ctx)
    finally:
        model.train(was_training)
    counts, sentences = _all_reduce_counts(rt, recorder.tables(), recorder.sentences)
    return RoutingStats.from_counts(counts, manifest, sentences)


# ---------------------------------------------------------------------------------- writing
def _file_stem(layer: str) -> str:
    return re.sub(r"[^\w.-]", "_", layer)


def _csv_text(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def table_csv(table_EC: np.ndarray, columns: list[str]) -> str:
    """CSV text: header ``expert,<columns>``, one row per expert."""
    return _csv_text(["expert", *columns],
                     [[e, *map(int, row)] for e, row in enumerate(np.asarray(table_EC))])


def plot_heatmap(table_EC: np.ndarray, columns: list[str], title: str, column_kind: str,
                 path: str | Path, row_kind: str = "expert", unit: str = "token slots") -> None:
    """PNG heatmap of an (experts x columns) count table, each column normalised to sum 1
    (the share of that domain's / task's `unit` per row); cells show the raw counts."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts_EC = np.asarray(table_EC, dtype=np.float64)
    E, C = counts_EC.shape
    total_C = counts_EC.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share_EC = np.where(total_C > 0, counts_EC / total_C, np.nan)
    width = min(24.0, 3.0 + 0.8 * max(C, 2))
    height = min(24.0, 2.0 + 0.35 * max(E, 4))
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = colormaps["Blues"].with_extremes(bad="0.85")  # grey: a column with no tokens
    image = ax.imshow(np.ma.masked_invalid(share_EC), cmap=cmap, vmin=0.0, vmax=1.0,
                      aspect="auto", interpolation="nearest")
    rotate = C > 4 or any(len(c) > 6 for c in columns)
    ax.set_xticks(range(C), labels=columns, rotation=45 if rotate else 0,
                  ha="right" if rotate else "center")
    ax.set_yticks(range(E), labels=[str(e) for e in range(E)])
    ax.set_xlabel(column_kind)
    ax.set_ylabel(row_kind)
    ax.set_title(title, fontsize=10)
    colorbar = fig.colorbar(image, ax=ax)
    colorbar.set_label(f"share of the {column_kind}'s {unit}")
    if E * C <= 600:
        for e in range(E):
            for c in range(C):
                dark = not math.isnan(share_EC[e, c]) and share_EC[e, c] > 0.6
                ax.text(c, e, f"{int(counts_EC[e, c])}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def check_out_dir(out_dir: str | Path) -> Path:
    """`out_dir` if routing-stats may write it: new, empty, or an earlier routing-stats output."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / SUMMARY_FILE).is_file() and \
            (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"--out {out_dir}: exists and holds no {SUMMARY_FILE} of an earlier "
                        "routing-stats run; refusing to replace it (choose a new directory)")
    return out_dir


def write_routing_stats(stats: RoutingStats, out_dir: str | Path) -> list[Path]:
    """Write per-layer CSV tables and PNG heatmaps, `all_layers.csv` and `summary.json` into
    `out_dir`; returns the paths written. The directory appears complete or not at all: it is
    built under a temporary name and renamed, replacing an earlier routing-stats output but
    never a directory of other files."""
    out_dir = check_out_dir(out_dir)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        written = _write_files(stats, tmp)
    return [out_dir / p.name for p in written]


def _write_files(stats: RoutingStats, out_dir: Path) -> list[Path]:
    column_kinds = {"expert_domain": "domain", "expert_task": "language pair",
                    "expert_tgt_lang": "target language"}
    written: list[Path] = []
    for layer in stats.layers:
        stem = _file_stem(layer)
        for kind in TABLE_KINDS:
            table_EC, columns = stats.table(layer, kind)
            column_kind = column_kinds[kind]
            csv_path = out_dir / f"{stem}.{kind}.csv"
            write_text(csv_path, table_csv(table_EC, columns))
            png_path = out_dir / f"{stem}.{kind}.png"
            title = (f"{layer}: experts x {column_kind}s "
                     f"({int(table_EC.sum())} token slots)")
            plot_heatmap(table_EC, columns, title, column_kind, png_path)
            written += [csv_path, png_path]
    header = (["layer", "expert"] + [f"domain:{d}" for d in stats.domains]
              + [f"task:{t}" for t in stats.tasks] + [f"tgt:{g}" for g in stats.tgt_langs])
    rows = [[layer, e, *map(int, np.concatenate([t.expert_domain[e], t.expert_task[e],
                                                   t.expert_tgt_lang[e]]))]
            for layer, t in stats.layers.items() for e in range(t.expert_domain.shape[0])]
    all_path = out_dir / ALL_LAYERS_FILE
    write_text(all_path, _csv_text(header, rows))
    summary_path = out_dir / SUMMARY_FILE
    write_json(summary_path, stats.summary())
    return written + [all_path, summary_path]
