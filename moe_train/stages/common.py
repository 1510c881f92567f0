"""What every stage of a stage-wise recipe shares: its directory, its "done" record, its inputs.

A stage is a function ``run(ctx) -> dict`` writing its artifact under ``<moa.workdir>/<stage>/``
and, last, ``done.json`` (atomically): a stage whose ``done.json`` exists is finished and is
reused, not run again, as long as it was made from the same config, data and inputs
(stages/record.py; otherwise the run stops naming what changed). A stage whose inputs are
missing fails in one line naming the stage to run first. Every rank runs every stage;
rank-0-only work is followed by a barrier.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import EvalConfig, ExperimentConfig
from moe_train.data.prepare import tokenizer_files
from moe_train.data.shards import read_manifest
from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.parallel.collectives import agreed_exit, barrier
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.stages.record import differences, made_from, stale_error
from moe_train.train.checkpoint import latest_tag, read_meta
from moe_train.train.resume import check_resume_config, check_resume_data
from moe_train.utils.atomic import remove_stale_temporaries, write_json
from moe_train.utils.provenance import finish as finish_provenance, now_iso, provenance

DONE = "done.json"
LOCK = ".lock"


class NotFinished(Exception):
    """Raised by `StageContext.reuse` for an unfinished stage while only looking it over."""


@dataclass
class StageContext:
    """The recipe's config, the process group container and the recipe's working directory."""

    cfg: ExperimentConfig
    rt: ParallelRuntime
    recipe: str = "moa"
    """The recipe whose stages these are (named in errors)."""
    rerun_stale: bool = False
    """A finished stage made from something else is deleted and run again (instead of a
    ConfigError); `moe-train pipeline --rerun-stale`."""
    upstream_of: str | None = None
    """Set while `moe-train pipeline --stage S` looks over the stages before S (S here): none
    of them runs; a finished one made from something else is named in a warning line (S reads
    it as it is), a missing one is left to S's own `require`."""
    read: dict[str, Path] = field(default_factory=dict)
    """The finished stages whose output the running stage has read ({stage: its done.json}),
    recorded in its `made_from`."""
    process_provenance: dict[str, Any] = field(default_factory=provenance)
    """The commit, command, machine and libraries of this process, taken when it built the
    context (before any stage ran): the code a stage runs is what was loaded then, whatever
    is committed while it trains."""
    _stage_started: str | None = field(default=None, repr=False)
    _locks: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def workdir(self) -> Path:
        return Path(self.cfg.moa.workdir)

    def stage_dir(self, stage: str) -> Path:
        """Where `stage` keeps its artifact (the backbone may live in another recipe's workdir)."""
        if stage == "backbone" and self.cfg.moa.backbone_dir:
            return Path(self.cfg.moa.backbone_dir)
        return self.workdir / stage

    def _record(self, stage: str) -> dict[str, Any] | None:
        path = self.stage_dir(stage) / DONE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{path}: unreadable stage record ({err}); delete it to rerun "
                            f"the stage") from None
        made = record.get("made_from", {"inputs": {}}) if isinstance(record, dict) else None
        if not isinstance(made, dict) or not isinstance(made.get("inputs"), dict) or \
                not isinstance(made.get("config", {}), dict) or \
                not isinstance(made.get("data"), (str, type(None))):
            raise DataError(f"{path}: not a stage record (expected an object whose made_from "
                            "is an object with the inputs' digests); delete it to rerun the "
                            "stage")
        return record

    def done(self, stage: str) -> dict[str, Any] | None:
        """The summary a finished stage recorded, or None. The running stage depends on what
        it looks up here (`read`)."""
        record = self._record(stage)
        if record is not None:
            self.read[stage] = self.stage_dir(stage) / DONE
        return record

    def reuse(self, stage: str, cfg: ExperimentConfig) -> dict[str, Any] | None:
        """Called first by every stage, with the config it runs with: the record of `stage`
        when it is finished and was made from what it would be made from now, None when it
        has to run. A record made from another config, data or inputs is a ConfigError naming
        what changed."""
        self.read = {}  # a new stage starts: what it reads from here on
        self._stage_started = now_iso()
        record = self._record(stage)
        if record is None:
            if self.upstream_of is not None:
                raise NotFinished(stage)
            self._lock(stage)
            return None
        where = self.stage_dir(stage)
        if "made_from" not in record:
            if self.rt.is_main and self.upstream_of is None:
                print(f"| stage {stage}: {where} does not record what it was made from "
                      f"(an older moe_train wrote it); reusing it unchecked", flush=True)
            return record
        owner = record["made_from"].get("recipe")
        if owner is not None and owner != self.recipe:  # never deleted, even --rerun-stale
            raise ConfigError(f"stage {stage}: {where} belongs to the {owner} recipe, whose "
                              f"{stage} stage is another; give this {self.recipe} run another "
                              "moa.workdir")
        inputs = {name: self.stage_dir(name) / DONE for name in record["made_from"]["inputs"]}
        changed = differences(record["made_from"], made_from(stage, cfg, inputs, self.recipe))
        if not changed:
            return record
        if self.upstream_of is not None:
            if self.rt.is_main:
                print(f"| warning: stage {stage} ({where}), before {self.upstream_of}, was made "
                      f"from something else ({'; '.join(changed[:3])}); "
                      f"`moe-train pipeline {self.recipe}` without --stage would stop there",
                      flush=True)
            return record
        shared = where.resolve() != (self.workdir / stage).resolve()  # moa.backbone_dir
        if not self.rerun_stale or shared:
            raise stale_error(stage, where, changed, self.recipe, shared)
        if self.rt.is_main:
            print(f"| stage {stage}: {where} was made from something else "
                  f"({'; '.join(changed[:3])}); deleting it and running the stage again",
                  flush=True)
            (where / DONE).unlink()  # first: a delete cut short leaves no record to reuse
            shutil.rmtree(where)
        barrier(self.rt)
        self._lock(stage)
        return None

    def resume_training(self, stage: str, cfg: ExperimentConfig) -> bool:
        """Whether `stage`'s training continues from its checkpoints (a run stopped before the
        stage finished). Checkpoints trained with a config that may not change on resume, or
        on other prepared data (tokenizer, vocabulary, corpora, the training split's sizes or
        content), are deleted with `--rerun-stale` (one line says so) and the stage trains
        anew; without it they are a one-line error saying so."""
        ckpt = Path(cfg.checkpoint.dir)
        tag = latest_tag(ckpt, warn=None)
        if tag is None:
            return False
        stored = read_meta(ckpt / tag)["config"]  # unreadable: its own error, nothing deleted
        try:
            check_resume_config(stored, cfg.to_dict(), str(ckpt / tag), log=lambda _: None)
            prepared = Path(cfg.data.prepared_dir)
            manifest = read_manifest(prepared)
            check_resume_data(ckpt / tag, manifest, tokenizer_files(prepared, manifest))
            return True
        except CheckpointError as exc:
            if self.stage_dir(stage).resolve() != (self.workdir / stage).resolve():
                raise  # moa.backbone_dir: another run's, never deleted
            if not self.rerun_stale:
                raise CheckpointError(f"{exc}; stage {stage} has not finished: with "
                                      f"--rerun-stale it is trained anew ({ckpt} deleted)"
                                      ) from None
        barrier(self.rt)  # every rank has looked before rank 0 deletes
        if self.rt.is_main:
            print(f"| stage {stage}: its unfinished training ({ckpt / tag}) used another "
                  f"config or other data; deleting {ckpt} and training the stage anew",
                  flush=True)
            shutil.rmtree(ckpt)
        barrier(self.rt)
        return False

    def _lock(self, stage: str) -> None:
        """Hold `stage`'s directory for this run until `finish` (rank 0; released when the
        process ends): a second run that would train into it, e.g. through moa.backbone_dir
        while the first still trains it, stops in one line instead of taking its checkpoints
        for its own."""
        if not self.rt.is_main or stage in self._locks:
            return
        where = self.stage_dir(stage)
        made = [p for p in (where, *where.parents) if not p.exists()]
        where.mkdir(parents=True, exist_ok=True)
        handle = open(where / LOCK, "w")  # noqa: SIM115 (held until finish)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise ConfigError(f"stage {stage}: {where} is being written by another run (it "
                              f"holds {where / LOCK}); wait for it, or use another "
                              "moa.workdir / moa.backbone_dir") from None
        self._locks[stage] = (handle, made)
        remove_stale_temporaries(where)  # a killed run's half-written files

    def release(self, stage: str) -> None:
        """Give `stage`'s directory free (`finish` does; a recipe does when a stage fails):
        the lock file goes, and so do the directories taking it made, if nothing else is in
        them (a stage that failed before writing leaves nothing behind)."""
        handle, made = self._locks.pop(stage, (None, []))
        if handle is None:
            return
        Path(handle.name).unlink(missing_ok=True)
        handle.close()
        for directory in made:  # innermost first
            try:
                directory.rmdir()
            except OSError:  # not empty: the stage wrote there
                break

    def require(self, stage: str, by: str) -> Path:
        """The directory of finished stage `stage`, which stage `by` needs."""
        if self.done(stage) is None:
            raise ConfigError(f"stage {by}: needs the output of stage {stage} "
                              f"({self.stage_dir(stage) / DONE} is missing); run "
                              f"`moe-train pipeline {self.recipe} --stage {stage}` first")
        return self.stage_dir(stage)

    def stage_provenance(self) -> dict[str, Any]:
        """The process's provenance with the running stage's start, end and wall time."""
        started = self._stage_started or self.process_provenance["started_at"]
        return finish_provenance(dict(self.process_provenance, started_at=started))

    def finish(self, stage: str, summary: dict[str, Any], cfg: ExperimentConfig
               ) -> dict[str, Any]:
        """Record `stage` as finished (rank 0 writes, everyone waits), with what it was made
        from (`cfg`, the config it ran with; the data; the stages it read) and the
        provenance of the process that ran it (commit, command, machine, libraries, time)."""
        inputs = {name: path for name, path in self.read.items() if name != stage}
        # A new id per run: a rerun's record differs from the old one even where all else is
        # equal, so the stages that read the old output see that it changed.
        summary = summary | {"record_id": uuid.uuid4().hex,
                             "made_from": made_from(stage, cfg, inputs, self.recipe),
                             "provenance": self.stage_provenance()}
        with agreed_exit(self.rt, f"stage {stage}: rank 0 failed writing "
                         f"{self.stage_dir(stage) / DONE} (its error line says why)"):
            if self.rt.is_main:
                write_json(self.stage_dir(stage) / DONE, summary)
        self.release(stage)
        return summary


def moa_stages(cfg: ExperimentConfig) -> list[str]:
    """The stages of the moa recipe for `cfg`, in order: the clustering stages only for
    Gumbel-Max adapters (K = moa.num_clusters), the adapter stage only with adapters."""
    a = cfg.adapters
    if a.router == "gumbel":
        return ["backbone", "features", "cluster", "distill", "adapters", "evaluate"]
    if not a.enabled:
        return ["backbone", "evaluate"]
    return ["backbone", "adapters", "evaluate"]


def quality_decoding(cfg: ExperimentConfig) -> EvalConfig:
    """The search of a recipe's quality tables: beam moa.eval_beam, the config's eval length
    settings and batch."""
    e = cfg.eval
    return EvalConfig(beam=cfg.moa.eval_beam, lenpen=e.lenpen, max_len_a=e.max_len_a,
                      max_len_b=e.max_len_b, max_sentences=e.max_sentences)


def stage_config(cfg: ExperimentConfig, stage_dir: Path, **sections: dict[str, Any]
                 ) -> ExperimentConfig:
    """A copy of `cfg` for a training stage: its checkpoints and TensorBoard logs under
    `stage_dir`, and the given sections' fields replaced (e.g. ``adapters={"num_experts": 1}``).
    Validation runs again on the result."""
    changes: dict[str, Any] = {
        "checkpoint": dataclasses.replace(cfg.checkpoint, dir=str(stage_dir / "checkpoints")),
        "logging": dataclasses.replace(
            cfg.logging, tensorboard_dir=str(stage_dir / "tensorboard")
            if cfg.logging.tensorboard_dir else ""),
    }
    for name, fields in sections.items():
        changes[name] = dataclasses.replace(changes.get(name, getattr(cfg, name)), **fields)
    return dataclasses.replace(cfg, **changes)


def training_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The part of `Trainer.fit`'s summary a training stage records: the last step's dev
    figures, and ``exported_step`` / ``exported_dev`` when the export holds the best
    validation's weights instead (train.export_best)."""
    keep = ("step", "train_seconds", "train_tokens_per_s", "export", "dev/loss", "dev/ppl",
            "dev/bleu", "dev/chrf", "stopped_early", "early_stop", "exported_step")
    out = {k.replace("/", "_"): summary[k] for k in keep if k in summary}
    if "exported_dev" in summary:
        out["exported_dev"] = {k.replace("/", "_"): v for k, v in summary["exported_dev"].items()
                               if k in keep}
    return out


def load_matching(model: nn.Module, weights: dict[str, torch.Tensor], source: Path,
                  new: set[str]) -> None:
    """Load `weights` into `model`: every model parameter but those in `new` must be there with
    its shape, and nothing else may be."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights and k not in new]
    unexpected = [k for k in weights if k not in own]
    wrong = [k for k in weights if k in own and own[k].shape != weights[k].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{source}: does not match this stage's model (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes "
                              f"{wrong[:3]})")
    model.load_state_dict(weights, strict=False)
