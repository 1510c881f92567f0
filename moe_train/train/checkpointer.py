"""A training run's checkpoint directory: save (never NaN), resume, keep the best, export.

The trainer owns the loop and what a checkpoint's meta holds; this owns the engine's side of
`checkpoint.dir`: the DeepSpeed state with the expert shards beside it (DeepSpeed's own MoE
checkpointing off), the best validation's tag that rotation keeps (``train.export_best``), and
the standalone export read from a chosen tag.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Sequence

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import CheckpointError, MoeTrainError
from moe_train.parallel.collectives import all_reduce_floats, parameters_are_finite
from moe_train.parallel.expert_checkpoint import (expert_tensors, full_expert_state,
                                                  load_expert_shards, save_expert_shards)
from moe_train.parallel.expert_parallel import without_deepspeed_moe_checkpointing
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.optim_state import master_tensors
from moe_train.parallel.zero3 import is_partitioned
from moe_train.train.checkpoint import (latest_tag, read_meta, save_checkpoint,
                                        step_tag, verify)
from moe_train.train.checkpoint_load import load_checkpoint
from moe_train.train.export import export_inference, export_streamed
from moe_train.train.resume import check_resume_config, check_resume_data
from moe_train.utils.atomic import write_json
from moe_train.utils.safe_load import read_json_object

ENDED = "ended.json"
"""The summary of a run that ended (max_steps or early stopping), beside its checkpoints."""


class Checkpointer:
    """Saves and loads one engine's checkpoints in ``cfg.checkpoint.dir``; every method that
    touches the engine is collective (all ranks call it)."""

    def __init__(self, engine: Any, rt: ParallelRuntime, cfg: ExperimentConfig,
                 manifest: dict[str, Any], tokenizer_files: Sequence[Path],
                 log: Callable[[str], None]) -> None:
        self.engine, self.rt, self.cfg = engine, rt, cfg
        self.manifest, self.tokenizer_files, self.log = manifest, tokenizer_files, log
        self.dir = Path(cfg.checkpoint.dir)
        self.export_dir = self.dir / "export"
        """Where `export` writes the standalone weights."""
        self.keeps_best = cfg.train.export_best and cfg.train.patience > 0
        """Whether the best validation's checkpoint is kept and exported."""
        self.best_tag: str | None = None
        """The best validation's checkpoint, kept through rotation."""

    def last_good(self) -> str:
        """The checkpoint `--resume` would load, for one-line stop messages."""
        try:
            tag = latest_tag(self.dir, warn=None)
        except CheckpointError:
            tag = None
        return str(self.dir / tag) if tag else f"none complete in {self.dir}"

    def save(self, step: int, meta: Callable[[], dict[str, Any]],
             rank_extra: Callable[[Path], None] | None = None) -> Path:
        """Checkpoint `step` with the tokenizer and manifest attached; refuses a model with a
        NaN or infinite parameter. `meta` builds the run's JSON state once the model is known
        to be finite, so a refused save leaves the run's counters as they were.
        `rank_extra(tag_dir)`: every rank's own files (its log window)."""
        if not parameters_are_finite(self.rt, self.engine.module):
            raise CheckpointError(f"{self.dir}: refusing to save step {step}: a parameter is NaN "
                                  f"or infinite; last good checkpoint: {self.last_good()}")
        state = meta()
        attachments = {**{path.name: path for path in self.tokenizer_files},
                       "manifest.json": Path(self.cfg.data.prepared_dir) / "manifest.json"}
        with without_deepspeed_moe_checkpointing(self.engine):
            return save_checkpoint(self.engine, self.rt, self.dir, step, state, attachments,
                                   self.cfg.checkpoint.keep_last,
                                   save_extra=lambda tag_dir: self._save_rank_files(tag_dir,
                                                                                    rank_extra),
                                   keep=() if self.best_tag is None else (self.best_tag,))

    def load(self, tag: str, check_config: bool = True) -> dict[str, Any]:
        """Load `tag` into the engine; its meta. `check_config`: refuse a checkpoint whose
        config or prepared data differs from the run's in what a resume must keep
        (train/resume.py)."""
        if check_config:
            check_resume_config(read_meta(self.dir / tag)["config"], self.cfg.to_dict(),
                                str(self.dir / tag), log=self.log)
            check_resume_data(self.dir / tag, self.manifest, self.tokenizer_files)
        with without_deepspeed_moe_checkpointing(self.engine):
            return load_checkpoint(self.engine, self.rt, self.dir, tag=tag,
                                   load_extra=self._load_experts, log=self.log)

    def adopt_best(self, tag: str | None) -> None:
        """Keep a resumed run's best checkpoint, if it is still complete; say so when it is
        not (rotated away while export_best was off, or damaged): the export is then the best
        of the validations from here on, or the last step."""
        if not tag or not self.keeps_best:
            return
        if verify(self.dir / tag) is None:
            self.best_tag = tag
        else:
            self.log(f"| export_best: the best validation's checkpoint {self.dir / tag} is "
                     "gone or incomplete (rotated away while export_best was off?); the export "
                     "will be the best validation from here on, or the last step")

    def mark_best(self, step: int) -> bool:
        """`step` set a new best: remember its tag; True when it must be saved now."""
        if not self.keeps_best:
            return False
        self.best_tag = step_tag(step)
        return True

    def restore_best(self, last: Path) -> Path:
        """Load the best checkpoint into the engine when it is not `last`; the checkpoint the
        export should read."""
        if not self.keeps_best or self.best_tag is None or self.best_tag == last.name:
            return last
        self.load(self.best_tag, check_config=False)
        return self.dir / self.best_tag

    def export(self, tag_dir: Path) -> Path | None:
        """Standalone fp32 weights (experts assembled from the checkpoint `tag_dir`), written
        by rank 0: every trainable parameter as its fp32 master, which 16-bit training keeps
        beside the module's rounded copy (`master_tensors`; collective under ZeRO 1-3). Under
        ZeRO-3 streamed (`export_streamed`): one parameter at a time, then the experts one at
        a time from the files."""
        module, out, main = self.engine.module, self.export_dir, self.rt.is_main
        dense = master_tensors(module, self.engine.optimizer, keep=main)
        if is_partitioned(module):
            tensors = itertools.chain(dense, expert_tensors(tag_dir) if main else ())
            return export_streamed(out, tensors, self.cfg, self.manifest, self.tokenizer_files,
                                   active=main)
        state = {name: t for name, t in dense if t is not None}
        if not main:
            return None
        state.update(full_expert_state(tag_dir))
        return export_inference(out, state, self.cfg, self.manifest, self.tokenizer_files)

    def record_end(self, summary: dict[str, Any]) -> None:
        """Rank 0 notes that the run ended at ``summary["step"]``, after its export, so that a
        later ``--resume`` returns this summary instead of validating and exporting again."""
        if self.rt.is_main:
            write_json(self.dir / ENDED, {"summary": summary,
                                          "export_best": self.cfg.train.export_best})

    def forget_end(self) -> None:
        """A fresh run in this directory: an earlier run's end record is not this run's."""
        if self.rt.is_main:
            (self.dir / ENDED).unlink(missing_ok=True)

    def ended_at(self, step: int, max_steps: int) -> dict[str, Any] | None:
        """The recorded summary when the run already ended at `step`, the step it resumes
        from: it reached `max_steps` or stopped early (a raised max_steps continues a run that
        only reached the old one; patience cannot change on resume), and exported as this
        config would (train.export_best may change on resume: then it exports again). Paths
        name this run's checkpoint.dir. A damaged record counts as none. Collective: rank 0
        reads the record and every rank follows its answer; other ranks get ``{"step"}``."""
        summary = None
        if self.rt.is_main and (self.dir / ENDED).is_file():
            try:
                record = read_json_object(self.dir / ENDED, "the summary of the run's end")
            except MoeTrainError:
                record = {}
            found = record.get("summary")
            if isinstance(found, dict) and found.get("step") == step and \
                    record.get("export_best") == self.cfg.train.export_best and \
                    (found.get("stopped_early") or step >= max_steps):
                summary = {**found, "checkpoint": str(self.dir / step_tag(step)),
                           "export": str(self.export_dir)}
        ended = summary is not None
        if self.rt.world_size > 1:
            ended = all_reduce_floats(self.rt, float(ended))[0] > 0
        return (summary or {"step": step}) if ended else None

    def _save_rank_files(self, tag_dir: Path, extra: Callable[[Path], None] | None) -> None:
        if self.cfg.uses_experts:
            save_expert_shards(self.engine.module, self.engine.optimizer, self.rt, tag_dir)
        if extra is not None:
            extra(tag_dir)

    def _load_experts(self, tag_dir: Path) -> None:
        if self.cfg.uses_experts:
            load_expert_shards(self.engine.module, self.engine.optimizer, self.rt, tag_dir)
