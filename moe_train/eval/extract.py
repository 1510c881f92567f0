"""Task sub-network extraction (`moe-train extract`, seed 002 Sec. 3.2).

A side whose MoE layers route by task sends every token of a task to the same k experts with
the same combine weights, so a server for one task needs only those experts. Extraction
evaluates GATE(task) in each task-routed layer (`TaskRouter.table`: a learned gate frozen into
a table, or the fixed assignment), keeps the k chosen experts and writes a standalone export
whose task routers hold a frozen table (``moe.{side}_task_table``) with only this task's row
filled. Token-routed sides keep all their experts.

The kept experts stay in ascending global order (the slot -> expert map is in the table), so
the dispatcher sorts a token's copies exactly as in the full model and the combine adds them in
the same order: on that task's inputs the sub-network's output equals the full model's bit for
bit (fp32, dropless evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from moe_train.config.loader import config_from_dict
from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.eval.params import SIDES, count_parameters
from moe_train.models.build import build_model, moe_layers
from moe_train.moe.sentence_router import TaskRouter

EXTRACT_REPORT = "extract.json"
"""The extraction's parameter report, written into the export directory."""


def task_sides(cfg: ExperimentConfig) -> list[str]:
    """The sides whose MoE layers route by task (what extraction can shrink)."""
    return [s for s in SIDES if cfg.moe.enabled and cfg.moe.router_name(s) == "task"]


def task_sources(cfg: ExperimentConfig) -> dict[str, str]:
    """{side: what it routes by} of the task-routed sides."""
    return {s: getattr(cfg.moe, f"{s}_task_source") for s in task_sides(cfg)}


def resolve_task(task: str, source: str, manifest: dict[str, Any]) -> int:
    """The task id of `task` for a side routing by `source`, one the model was trained on:
    a language pair ``xx-yy`` (any source but domain), a language (tgt_lang / src_lang), a
    domain name, or an integer (task_ids)."""
    task_id = _task_id(task, source, manifest)
    trained = _trained_tasks(source, manifest)
    if trained and task_id not in trained:
        raise ConfigError(f"--task: the model never trained on {task!r} for its {source} "
                          f"routing; it serves {', '.join(trained.values())}")
    return task_id


def side_tasks(task: str, sources: dict[str, str], manifest: dict[str, Any]) -> dict[str, int]:
    """The task id of each task-routed side (`sources`: side -> what it routes by) for `task`:
    one task every side resolves (``de-en`` for a src_lang encoder and a tgt_lang decoder,
    ``law`` for domain-routed sides), or, where that names nothing for some side, one
    comma-separated part per side (``law,de``): in side order (encoder first), or in any order
    where each side has exactly one part naming one of its tasks. A part that names no side's
    task is refused, and so is a choice no training corpus had (it would serve nothing)."""
    parts = [p.strip() for p in task.split(",")]
    if len(parts) == 1:
        try:
            ids = {s: resolve_task(task, src, manifest) for s, src in sources.items()}
        except ConfigError:
            if len(set(sources.values())) < 2:
                raise
            raise ConfigError("--task: " + " and ".join(f"the {s} routes by {src}" for s, src
                                                         in sources.items())
                              + "; give one task for each, comma-separated (e.g. law,de)"
                              ) from None
    else:
        ids = _parts_by_side(task, parts, sources, manifest)
    _check_served(task, ids, sources, manifest)
    return ids


def _parts_by_side(task: str, parts: list[str], sources: dict[str, str],
                   manifest: dict[str, Any]) -> dict[str, int]:
    """`side_tasks` of a comma-separated `task`."""
    def attempt(part: str, source: str) -> int | None:
        try:
            return resolve_task(part, source, manifest)
        except ConfigError:
            return None

    found = {p: {s: attempt(p, src) for s, src in sources.items()} for p in parts}
    for part, ids in found.items():
        if all(i is None for i in ids.values()):
            names = "; ".join(f"{s} ({src}): "
                              + (", ".join(_trained_tasks(src, manifest).values()) or "any")
                              for s, src in sources.items())
            raise ConfigError(f"--task {task}: {part!r} names no task of this model's sides "
                              f"(trained tasks by side: {names})")
    sides = list(sources)
    if len(parts) == len(sides) and all(found[p][s] is not None for p, s in zip(parts, sides)):
        return {s: int(found[p][s]) for p, s in zip(parts, sides)}
    out: dict[str, int] = {}
    for side, source in sources.items():
        ids = {found[p][side] for p in parts} - {None}
        if len(ids) != 1:
            trained = ", ".join(_trained_tasks(source, manifest).values()) or "none named"
            raise ConfigError(f"--task {task}: expected exactly one part for the {source} "
                              f"routing ({trained}), found {len(ids)}")
        out[side] = int(ids.pop())
    return out


def _check_served(task: str, ids: dict[str, int], sources: dict[str, str],
                  manifest: dict[str, Any]) -> None:
    """Refuse side tasks that no training corpus had together (e.g. source and target
    language both de): the sub-network would serve nothing."""
    corpora = manifest.get("corpora", [])
    if not corpora or any(_has_tasks(c, ids, sources, manifest) for c in corpora):
        return
    raise ConfigError(f"--task {task}: no corpus the model trained on has these tasks together "
                      "(" + ", ".join(f"{s} {sources[s]} id {i}" for s, i in ids.items())
                      + "); it would serve nothing")


def _has_tasks(corpus: dict[str, Any], ids: dict[str, int], sources: dict[str, str],
               manifest: dict[str, Any]) -> bool:
    """Whether `corpus` has task `ids[side]` on every side (a corpus of given task ids names
    none: it has any)."""
    for side, source in sources.items():
        task = _corpus_task(corpus, source, manifest)
        if task is not None and task[0] != ids[side]:
            return False
    return True


def _corpus_task(corpus: dict[str, Any], source: str, manifest: dict[str, Any]
                 ) -> tuple[int, str] | None:
    """(task id, name) of one corpus for a side routing by `source`; None for given task ids."""
    langs, domains = list(manifest.get("langs", [])), list(manifest.get("domains", []))
    if source == "domain":
        return domains.index(corpus["domain"]), corpus["domain"]
    if source == "lang_pair":
        src, tgt = corpus["src_lang"], corpus["tgt_lang"]
        return langs.index(src) * len(langs) + langs.index(tgt), f"{src}-{tgt}"
    if source in ("tgt_lang", "src_lang"):
        return langs.index(corpus[source]), corpus[source]
    return None


def _trained_tasks(source: str, manifest: dict[str, Any]) -> dict[int, str]:
    """{task id: name} of the tasks the training data held for `source` (its corpora); empty
    when it names none (a converted model, or task_ids given by the caller)."""
    found = (_corpus_task(c, source, manifest) for c in manifest.get("corpora", []))
    return dict(sorted(t for t in found if t is not None))


def serves(cfg: ExperimentConfig, manifest: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """Whether the model of `cfg` and `manifest` serves a corpus (a manifest entry): an
    extracted sub-network only its task's (a corpus of given task ids names none: kept); a full
    model every one."""
    task = cfg.moe.extracted_task
    sources = task_sources(cfg) if task else {}
    ids = side_tasks(task, sources, manifest) if task else {}
    return lambda corpus: _has_tasks(corpus, ids, sources, manifest)


def serving_manifest(cfg: ExperimentConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` as its model serves it (`serves`): translate's language / domain choices and
    defaults become an extracted sub-network's task's. The id lists (langs, domains) stay
    whole: they number the tasks."""
    if not cfg.moe.extracted_task:
        return manifest
    check = serves(cfg, manifest)
    return {**manifest, "corpora": [c for c in manifest.get("corpora", []) if check(c)]}


def _task_id(task: str, source: str, manifest: dict[str, Any]) -> int:
    """`task` as an id of `source`'s numbering (see `resolve_task`)."""
    langs, domains = list(manifest.get("langs", [])), list(manifest.get("domains", []))
    if source == "domain":
        if task in domains:
            return domains.index(task)
        raise ConfigError(f"--task: this model routes by domain; expected one of "
                          f"{', '.join(domains) or 'none'}, got {task!r}")
    if source == "task_ids":
        if task.isdigit():
            return int(task)
        raise ConfigError(f"--task: this model routes by given task ids; expected an integer, "
                          f"got {task!r}")
    src, sep, tgt = task.partition("-")
    pair = bool(sep) and src in langs and tgt in langs
    if source == "lang_pair":
        if pair:
            return langs.index(src) * len(langs) + langs.index(tgt)
        raise ConfigError(f"--task: this model routes by language pair; expected xx-yy with "
                          f"xx, yy among {', '.join(langs) or 'none'}, got {task!r}")
    if pair:
        return langs.index(tgt if source == "tgt_lang" else src)
    if task in langs:
        return langs.index(task)
    what = "target" if source == "tgt_lang" else "source"
    known = list(_trained_tasks(source, manifest).values()) or langs  # the ones it serves
    raise ConfigError(f"--task: this model routes by {what} language; expected a language "
                      f"({', '.join(known) or 'none'}) or a pair xx-yy, got {task!r}")


def extracted_config(cfg: ExperimentConfig, task: str, num_tasks: dict[str, int]
                     ) -> ExperimentConfig:
    """The config of `task`'s sub-network: each task-routed side keeps moe.k experts behind a
    frozen table of `num_tasks[side]` rows; expert parallelism off (a serving copy)."""
    sides = task_sides(cfg)
    if not sides:
        raise ConfigError("moe.encoder_router / moe.decoder_router: neither side routes by task, "
                          "so no sub-network can be extracted (every expert may serve any input)")
    values = cfg.to_dict()
    moe = values["moe"]
    for side in sides:
        moe[f"{side}_num_experts"] = cfg.moe.k
        moe[f"{side}_task_table"] = num_tasks[side]
    moe.update(ep_size=1, extracted_task=task, assignment=[], assignment_weights=[])
    return config_from_dict(values)


@dataclass
class Extraction:
    """An extracted sub-network: its config, weights and the per-layer choices."""

    cfg: ExperimentConfig
    state: dict[str, torch.Tensor]
    task_ids: dict[str, int]
    """Task id per task-routed side."""
    experts: dict[str, list[int]]
    """Layer name -> the global expert ids kept (ascending)."""


def extract(model: torch.nn.Module, cfg: ExperimentConfig, manifest: dict[str, Any],
            task: str) -> Extraction:
    """`task`'s sub-network of a loaded full model (see the module docstring)."""
    if cfg.decoder_only:
        raise ConfigError("--checkpoint: a decoder-only (Qwen2-MoE) model; task sub-network "
                          "extraction is for the encoder-decoder Transformer")
    if cfg.moe.extracted_task:
        raise ConfigError(f"--checkpoint: already a sub-network (of task "
                          f"{cfg.moe.extracted_task!r}); extract from the full model")
    sides = task_sides(cfg)
    task_ids = side_tasks(task, task_sources(cfg), manifest)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    num_tasks: dict[str, int] = {}
    kept: dict[str, list[int]] = {}
    for name, layer in moe_layers(model):
        side = name.split("_layers.")[0]
        if side not in sides or not name.endswith(".ffn"):  # adapters stay whole
            continue
        router = layer.router
        assert isinstance(router, TaskRouter), f"{name}: a task-routed side without TaskRouter"
        task_id = task_ids[side]
        if task_id >= router.num_tasks:
            raise ConfigError(f"--task: {task!r} is {side} task id {task_id}, but the model has "
                              f"{router.num_tasks} tasks")
        num_tasks[side] = router.num_tasks
        ids_NK, weights_NK = (t.cpu() for t in router.table())
        slots = ids_NK[task_id].tolist()
        keep = sorted(slots)
        table_ids_NK = torch.full_like(ids_NK, -1)
        table_ids_NK[task_id] = torch.tensor([keep.index(e) for e in slots])
        table_weights_NK = torch.zeros_like(weights_NK)
        table_weights_NK[task_id] = weights_NK[task_id]
        for key in [k for k in state if k.startswith(f"{name}.router.")]:
            del state[key]
        state[f"{name}.router.table_ids_NK"] = table_ids_NK
        state[f"{name}.router.table_weights_NK"] = table_weights_NK
        index = torch.tensor(keep)
        for pname, _ in layer.experts.expert_parameters():
            key = f"{name}.experts.{pname}"
            state[key] = state[key].index_select(0, index).clone()
        kept[name] = keep
    sub_cfg = extracted_config(cfg, task, num_tasks)
    return Extraction(cfg=sub_cfg, state=state, task_ids=task_ids, experts=kept)


def read_experts_kept(export_dir: str | Path) -> dict[str, list[int]]:
    """Layer name -> the full model's ids of the experts an extracted export kept (its
    extract.json), checked to be lists of integers."""
    from moe_train.errors import CheckpointError
    from moe_train.utils.safe_load import read_json_object

    path = Path(export_dir) / EXTRACT_REPORT
    kept = read_json_object(path, "the report of the extraction (experts_kept)").get(
        "experts_kept")
    if not isinstance(kept, dict) or not all(
            isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                          for i in ids) for ids in kept.values()):
        raise CheckpointError(f"{path}: no 'experts_kept' of layer names to expert ids; "
                              "expected the report `moe-train extract` writes")
    return kept


def load_extracted(ext: Extraction, manifest: dict[str, Any]) -> torch.nn.Module:
    """The sub-network as a model (strict load: every weight accounted for), in eval mode."""
    model = build_model(ext.cfg, manifest)
    model.load_state_dict(ext.state, strict=True)
    return model.eval()


def extraction_report(full_cfg: ExperimentConfig, ext: Extraction, manifest: dict[str, Any]
                      ) -> dict[str, Any]:
    """Seed 002 Table 1's columns for the full model (train all, serving all, serving decoder)
    and the sub-network's own counts (meta device, no weights)."""
    vocab_size = int(manifest["vocab_size"])
    full = count_parameters(full_cfg, vocab_size, manifest)
    sub = count_parameters(ext.cfg, vocab_size, manifest)
    return {"task": ext.cfg.moe.extracted_task, "task_ids": ext.task_ids,
            "experts_kept": ext.experts,
            "full": {key: full[key] for key in ("total", "serving_all", "serving_decoder",
                                                "encoder", "decoder")},
            "extracted": {key: sub[key] for key in ("total", "serving_all", "serving_decoder",
                                                    "encoder", "decoder")}}


def format_report(report: dict[str, Any]) -> str:
    """The report as Table 1's columns, full model against the sub-network."""
    from moe_train.eval.params import human

    full, sub = report["full"], report["extracted"]
    ids = ", ".join(f"{side} id {i}" for side, i in report["task_ids"].items())
    rows = [f"| task {report['task']} ({ids})",
            f"| {'':<22} {'train all':>10} {'serving all':>12} {'serving dec.':>13}",
            f"| {'full model':<22} {human(full['total']):>10} {human(full['serving_all']):>12} "
            f"{human(full['serving_decoder']):>13}",
            f"| {'extracted sub-network':<22} {human(sub['total']):>10} "
            f"{human(sub['serving_all']):>12} {human(sub['serving_decoder']):>13}",
            f"| the sub-network holds {sub['total'] / full['total']:.1%} of the full model's "
            f"parameters ({full['decoder'] / max(sub['decoder'], 1):.2f}x fewer in the decoder)"]
    return "\n".join(rows)


def write_extraction(out_dir: str | Path, ext: Extraction, manifest: dict[str, Any],
                     source: Path, report: dict[str, Any]) -> Path:
    """A standalone export of the sub-network (loads without DeepSpeed), with its report and
    the tokenizer files of `source`, the model it was extracted from (sentencepiece's or a
    Hugging Face tokenizer's, as its manifest says)."""
    from moe_train.data.prepare import tokenizer_files
    from moe_train.train.export import export_inference

    return export_inference(out_dir, ext.state, ext.cfg, manifest,
                            tokenizer_files(source, manifest), extra_json={EXTRACT_REPORT: report})
