"""Routing tables of a split (numpy), their metrics, and the files written from them.

`RoutingStats` holds, per MoE layer, expert x domain / language-pair / target-language slot
counts, real tokens per domain and pair, and for THOR models (a task predictor) expert x
gold-task and expert x predicted-task slot counts, how many sentences of each gold task hold
each expert in their candidate set S^t, and how many (sentence, candidate) pairs received a
token; plus the predicted x gold task confusion table. `write_routing_stats` writes them as CSV,
heatmaps normalised per column (seed 001, Figs. 4-5) as PNG and summary metrics as JSON.

Experts per token (003 Table 7) is the number of used expert slots (id >= 0) of the real
tokens over the real tokens; the model-level value averages the layers' values (per side too).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.errors import DataError
from moe_train.utils import atomic
from moe_train.utils.atomic import atomic_dir, atomic_path, write_json, write_text

SUMMARY_FILE = "summary.json"
ALL_LAYERS_FILE = "all_layers.csv"
LAYERS_FILE = "layers.csv"
"""One row per MoE layer: tokens, experts per token (overall and per domain), candidate usage."""
CONFUSION_FILE = "task_confusion"
"""``task_confusion.csv`` / ``.png``: predicted task (rows) x gold task (columns), sentences."""
TABLE_KINDS = ("expert_domain", "expert_task", "expert_tgt_lang")
"""Per-layer tables written as ``{layer}.{kind}.csv`` and ``{layer}.{kind}.png``."""
THOR_TABLE_KINDS = ("expert_gold_task", "expert_pred_task", "candidate_gold_task")
"""Per-layer tables of a model with a task predictor (the last one only for layers with
candidate sets): token slots per expert and gold / predicted task, and sentences of each gold
task whose candidate set S^t holds the expert."""


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
    tokens_domain: np.ndarray | None = None
    """(domains,) real tokens, int64."""
    tokens_task: np.ndarray | None = None
    """(language pairs,) real tokens, int64."""
    expert_gold_task: np.ndarray | None = None
    """(E, predictor tasks) token slots by the sentence's gold task; None without predictor."""
    expert_pred_task: np.ndarray | None = None
    """(E, predictor tasks) token slots by the sentence's predicted (argmax) task."""
    candidate_gold_task: np.ndarray | None = None
    """(E, predictor tasks) sentences whose S^t holds the expert; None without candidate sets."""
    candidates_per_expert: np.ndarray | None = None
    """(E,) sentences whose S^t holds the expert (with or without gold labels)."""
    candidate_sentences: int = 0
    """Sentences whose candidate set was recorded."""
    candidate_pairs: int = 0
    """(sentence, candidate) pairs seen."""
    candidate_used: int = 0
    """Those whose candidate received at least one real token slot."""

    @property
    def experts_per_token(self) -> float | None:
        """Used expert slots per real token (003 Table 7)."""
        return float(self.expert_domain.sum()) / self.tokens if self.tokens else None

    @property
    def set_size(self) -> int:
        """|S^t| (0 without candidate sets)."""
        return self.candidate_pairs // self.candidate_sentences if self.candidate_sentences else 0

    @property
    def candidate_usage(self) -> float | None:
        """Share of (sentence, candidate) pairs that received a token; None without S^t."""
        return self.candidate_used / self.candidate_pairs if self.candidate_pairs else None

    def experts_per_token_by(self, kind: str) -> np.ndarray:
        """Experts per real token of each domain ("domain") or language pair ("task"); NaN
        where a column has no token."""
        slots_C = getattr(self, f"expert_{kind}").sum(0).astype(np.float64)
        tokens_C = getattr(self, f"tokens_{kind}")
        if tokens_C is None:
            return np.full(slots_C.shape, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tokens_C > 0, slots_C / np.maximum(tokens_C, 1), np.nan)


@dataclass
class TaskPrediction:
    """Task-predictor accuracy over the split: argmax of P^t against the gold task."""

    source: str
    """What the task is (thor.task_source)."""
    confusion: np.ndarray
    """(tasks, tasks) sentences, rows predicted, columns gold, int64."""
    correct_domain: np.ndarray
    """(domains,) correctly predicted sentences, int64."""
    sentences_domain: np.ndarray
    """(domains,) sentences with a gold task, int64."""
    correct_task: np.ndarray
    """(language pairs,) correctly predicted sentences, int64."""
    sentences_task: np.ndarray
    """(language pairs,) sentences with a gold task, int64."""

    @property
    def sentences(self) -> int:
        """Sentences with a gold task."""
        return int(self.confusion.sum())

    @property
    def accuracy(self) -> float | None:
        """Share of them whose argmax task is the gold one."""
        return float(np.trace(self.confusion)) / self.sentences if self.sentences else None


def _ratios(num: np.ndarray, den: np.ndarray, names: list[str]) -> dict[str, float | None]:
    return {n: (float(a) / float(b) if b > 0 else None) for n, a, b in zip(names, num, den)}


def _side(layer: str) -> str:
    """encoder / decoder of a layer name; a decoder-only model's layers are its decoder."""
    from moe_train.eval.params import DECODER_ONLY_PREFIXES

    head = layer.split(".", 1)[0]
    if head.startswith("encoder"):
        return "encoder"
    if head.startswith("decoder") or layer.startswith(DECODER_ONLY_PREFIXES):
        return "decoder"
    return "other"


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(kept)) if kept else None


def _side_means(per_layer: dict[str, float | None]) -> dict[str, float | None]:
    out = {"all": _mean(list(per_layer.values()))}
    for side in ("encoder", "decoder"):
        out[side] = _mean([v for n, v in per_layer.items() if _side(n) == side])
    return out


@dataclass
class RoutingStats:
    """Routing tables of every MoE layer plus the column names shared by all layers."""

    layers: dict[str, LayerTables]
    domains: list[str]
    tasks: list[str]
    """Language pairs as src-tgt."""
    tgt_langs: list[str]
    sentences: int
    pred_tasks: list[str] | None = None
    """Names of the predictor's task columns of the THOR tables (None: no task predictor)."""
    task_prediction: TaskPrediction | None = None
    expert_ids: dict[str, list[int]] | None = None
    """An extracted sub-network's layers: the full model's id of each row (extract.json's
    experts_kept), so its tables name the same experts as the full model's."""

    def row_names(self, layer: str) -> list[str]:
        """The expert id of each row of `layer`'s tables (the full model's, when extracted)."""
        E = self.layers[layer].expert_domain.shape[0]
        ids = (self.expert_ids or {}).get(layer, list(range(E)))
        return [str(i) for i in ids]

    def table(self, layer: str, kind: str) -> tuple[np.ndarray, list[str]]:
        """(E, C) table of `kind` (TABLE_KINDS or THOR_TABLE_KINDS) and its column names."""
        if kind in TABLE_KINDS:
            columns = {"expert_domain": self.domains, "expert_task": self.tasks,
                       "expert_tgt_lang": self.tgt_langs}[kind]
        elif kind in THOR_TABLE_KINDS and self.pred_tasks is not None:
            columns = self.pred_tasks
        else:
            raise ValueError(f"table kind: expected one of {', '.join(self.table_kinds(layer))}"
                             f", got {kind!r}")
        table = getattr(self.layers[layer], kind)
        if table is None:
            raise ValueError(f"{layer}: has no {kind} table (no candidate sets)")
        return table, columns

    def table_kinds(self, layer: str) -> tuple[str, ...]:
        """The tables `layer` has."""
        t = self.layers[layer]
        return TABLE_KINDS + tuple(k for k in THOR_TABLE_KINDS if getattr(t, k) is not None)

    def experts_per_token(self) -> dict[str, float | None]:
        """Table 7: the mean over layers of experts per token, overall and per side."""
        return _side_means({name: t.experts_per_token for name, t in self.layers.items()})

    def candidate_usage(self) -> dict[str, float | None] | None:
        """Mean over the layers with candidate sets of their usage (None: no such layer)."""
        usage = {name: t.candidate_usage for name, t in self.layers.items()
                 if t.candidate_usage is not None}
        return _side_means(usage) if usage else None

    def group_metrics(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """{"domains": {domain: {...}}, "pairs": {src-tgt: {...}}}: experts per token (mean
        over layers) and, with a task predictor, task accuracy of each group's sentences."""
        out: dict[str, dict[str, dict[str, float | None]]] = {}
        for group, kind, names in (("domains", "domain", self.domains),
                                   ("pairs", "task", self.tasks)):
            by_layer = np.stack([t.experts_per_token_by(kind) for t in self.layers.values()]) \
                if self.layers else np.zeros((0, len(names)))
            entries = {n: {"experts_per_token": _mean(by_layer[:, c].tolist())}
                       for c, n in enumerate(names)}
            tp = self.task_prediction
            if tp is not None:
                acc = _ratios(getattr(tp, f"correct_{kind}"), getattr(tp, f"sentences_{kind}"),
                              names)
                for n in names:
                    entries[n]["task_accuracy"] = acc[n]
            out[group] = entries
        return out

    def task_summary(self) -> dict[str, Any] | None:
        """Task-prediction accuracy overall, per gold task and per domain; None without one."""
        tp = self.task_prediction
        if tp is None:
            return None
        names = self.pred_tasks or []
        return {"source": tp.source, "tasks": names, "sentences": tp.sentences,
                "accuracy": tp.accuracy,
                "accuracy_by_task": _ratios(np.diag(tp.confusion), tp.confusion.sum(0), names),
                "accuracy_by_domain": _ratios(tp.correct_domain, tp.sentences_domain,
                                              self.domains),
                "confusion_pred_x_gold": tp.confusion.tolist()}

    def summary(self) -> dict[str, Any]:
        """Per-layer metrics (JSON-serialisable): load, entropy, purity, NMI, experts per token,
        candidate usage; model-level experts per token and task prediction."""
        layers = {}
        for name, t in self.layers.items():
            per_expert_E = t.expert_domain.sum(1)
            entry = {
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
                "experts_per_token": t.experts_per_token,
                "experts_per_token_by_domain": {
                    d: (None if math.isnan(v) else v)
                    for d, v in zip(self.domains, t.experts_per_token_by("domain").tolist())},
            }
            if self.expert_ids and name in self.expert_ids:
                entry["expert_ids"] = list(self.expert_ids[name])
            if t.expert_gold_task is not None:
                entry["gold_task_purity"] = dict(zip(self.pred_tasks or [],
                                                     column_purity(t.expert_gold_task)))
            if t.candidate_gold_task is not None:
                entry["candidate_set_size"] = t.set_size
                entry["candidate_usage"] = t.candidate_usage
                entry["candidates_per_expert"] = t.candidates_per_expert.tolist()
            layers[name] = entry
        out = {"sentences": self.sentences, "domains": self.domains, "tasks": self.tasks,
               "tgt_langs": self.tgt_langs, "experts_per_token": self.experts_per_token(),
               "layers": layers}
        usage = self.candidate_usage()
        if usage is not None:
            out["candidate_usage"] = usage
        task = self.task_summary()
        if task is not None:
            out["task_prediction"] = task
        return out


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


# ---------------------------------------------------------------------------------- writing
def _file_stem(layer: str) -> str:
    return re.sub(r"[^\w.-]", "_", layer)


def _csv_text(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def table_csv(table_EC: np.ndarray, columns: list[str], row_kind: str = "expert",
              rows: list[str] | None = None) -> str:
    """CSV text: header ``<row_kind>,<columns>``, one row per table row (named by its index,
    or by `rows`)."""
    table_EC = np.asarray(table_EC)
    names = rows if rows is not None else [str(e) for e in range(table_EC.shape[0])]
    return _csv_text([row_kind, *columns],
                     [[name, *map(int, row)] for name, row in zip(names, table_EC)])


def plot_heatmap(table_EC: np.ndarray, columns: list[str], title: str, column_kind: str,
                 path: str | Path, row_kind: str = "expert", unit: str = "token slots",
                 rows: list[str] | None = None, totals_C: np.ndarray | None = None) -> None:
    """PNG heatmap of an (experts x columns) count table, each column divided by its sum (or by
    `totals_C`: e.g. the column's sentences when a sentence counts in several rows), i.e. the
    share of that domain's / task's `unit` per row; cells show the raw counts."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts_EC = np.asarray(table_EC, dtype=np.float64)
    E, C = counts_EC.shape
    total_C = counts_EC.sum(0) if totals_C is None else np.asarray(totals_C, dtype=np.float64)
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
    ax.set_yticks(range(E), labels=rows if rows is not None else [str(e) for e in range(E)])
    ax.set_xlabel(column_kind)
    ax.set_ylabel(row_kind)
    # wrapped to the figure (about 12 characters an inch at these font sizes), never cut off
    ax.set_title("\n".join(textwrap.wrap(title, max(20, int(width * 11)))), fontsize=10)
    colorbar = fig.colorbar(image, ax=ax)
    colorbar.set_label("\n".join(textwrap.wrap(f"share of the {column_kind}'s {unit}",
                                               max(16, int(height * 11)))))
    if E * C <= 600:
        for e in range(E):
            for c in range(C):
                dark = not math.isnan(share_EC[e, c]) and share_EC[e, c] > 0.6
                ax.text(c, e, f"{int(counts_EC[e, c])}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


WRITTEN_BY = "moe-train routing-stats"
"""summary.json's `written_by`: what tells an earlier output from any directory that happens
to hold a summary.json (which --out would otherwise replace whole)."""


def check_out_dir(out_dir: str | Path, sources: list[str | Path] | tuple = ()) -> Path:
    """`out_dir` if routing-stats may write it: new, empty, or an earlier routing-stats output
    (its summary.json says so), and none of `sources` (the model, the data) nor above one."""
    summary = Path(out_dir) / SUMMARY_FILE
    if summary.is_file():
        try:
            ours = json.loads(summary.read_text(encoding="utf-8")).get("written_by") == WRITTEN_BY
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise DataError(f"--out {out_dir}: its {SUMMARY_FILE} was not written by "
                            "routing-stats; refusing to replace the directory (choose a new one)")
    return atomic.check_out_dir(out_dir, "--out", SUMMARY_FILE, "routing-stats run", sources)


def write_routing_stats(stats: RoutingStats, out_dir: str | Path,
                        scored: dict[str, Any] | None = None) -> list[Path]:
    """Write per-layer CSV tables and PNG heatmaps, `all_layers.csv`, `layers.csv`, the task
    confusion table (THOR) and `summary.json` (headed by `scored`: what was routed, e.g. the
    checkpoint and the split) into `out_dir`; returns the paths written. The
    directory appears complete or not at all: it is built under a temporary name and renamed,
    replacing an earlier routing-stats output but never a directory of other files."""
    out_dir = check_out_dir(out_dir)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        written = _write_files(stats, tmp, scored or {})
    return [out_dir / p.name for p in written]


_COLUMN_KINDS = {"expert_domain": "domain", "expert_task": "language pair",
                 "expert_tgt_lang": "target language", "expert_gold_task": "gold task",
                 "expert_pred_task": "predicted task", "candidate_gold_task": "gold task"}


def _write_table(out_dir: Path, stem: str, table: np.ndarray, columns: list[str], title: str,
                 column_kind: str, **plot: Any) -> list[Path]:
    csv_path, png_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.png"
    write_text(csv_path, table_csv(table, columns, plot.get("row_kind", "expert"),
                                   plot.get("rows")))
    plot_heatmap(table, columns, title, column_kind, png_path, **plot)
    return [csv_path, png_path]


def _write_files(stats: RoutingStats, out_dir: Path, scored: dict[str, Any]) -> list[Path]:
    written: list[Path] = []
    for layer in stats.layers:
        stem = _file_stem(layer)
        for kind in stats.table_kinds(layer):
            table_EC, columns = stats.table(layer, kind)
            column_kind = _COLUMN_KINDS[kind]
            plot: dict[str, Any] = {}
            if kind == "candidate_gold_task":  # a sentence holds |S^t| experts: per sentence
                t = stats.layers[layer]
                plot = {"unit": "sentences", "totals_C": table_EC.sum(0) / max(1, t.set_size)}
                title = (f"{layer}: candidate sets S^t (size {t.set_size}) x gold tasks, "
                         f"usage {_fmt(t.candidate_usage)}")
            else:
                title = (f"{layer}: experts x {column_kind}s "
                         f"({int(table_EC.sum())} token slots)")
            written += _write_table(out_dir, f"{stem}.{kind}", table_EC, columns, title,
                                    column_kind, rows=stats.row_names(layer), **plot)
    tp = stats.task_prediction
    if tp is not None:
        names = stats.pred_tasks or []
        written += _write_table(
            out_dir, CONFUSION_FILE, tp.confusion, names,
            f"task prediction ({tp.source}): accuracy {_fmt(tp.accuracy)} over "
            f"{tp.sentences} sentences", "gold task", row_kind="predicted task", rows=names,
            unit="sentences")
    header = (["layer", "expert"] + [f"domain:{d}" for d in stats.domains]
              + [f"task:{t}" for t in stats.tasks] + [f"tgt:{g}" for g in stats.tgt_langs])
    rows = [[layer, name, *map(int, np.concatenate([t.expert_domain[e], t.expert_task[e],
                                                      t.expert_tgt_lang[e]]))]
            for layer, t in stats.layers.items()
            for e, name in enumerate(stats.row_names(layer))]
    all_path = out_dir / ALL_LAYERS_FILE
    write_text(all_path, _csv_text(header, rows))
    layers_path = out_dir / LAYERS_FILE
    write_text(layers_path, _layers_csv(stats))
    summary_path = out_dir / SUMMARY_FILE
    write_json(summary_path, {"written_by": WRITTEN_BY, **scored, **stats.summary()})
    return written + [all_path, layers_path, summary_path]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _layers_csv(stats: RoutingStats) -> str:
    """One row per layer: side, tokens, experts per token (overall and per domain), candidate
    usage (empty where not defined)."""
    def cell(v: float | None) -> str:
        return "" if v is None or math.isnan(v) else f"{v:.6g}"

    header = ["layer", "side", "tokens", "experts_per_token", "candidate_usage",
              *(f"experts_per_token:{d}" for d in stats.domains)]
    rows = [[layer, _side(layer), t.tokens, cell(t.experts_per_token), cell(t.candidate_usage),
             *map(cell, t.experts_per_token_by("domain").tolist())]
            for layer, t in stats.layers.items()]
    return _csv_text(header, rows)
