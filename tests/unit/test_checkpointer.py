"""The checkpointer's best-checkpoint decisions (train.export_best), with a fake engine: which
step's tag is kept, when a resumed best is adopted, and which checkpoint the export reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import CheckpointError
from moe_train.train import checkpointer as ckpt_mod
from moe_train.train.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[2]


def _checkpointer(tmp_path: Path, *overrides: str) -> Checkpointer:
    cfg = load_config(ROOT / "configs" / "debug-cpu.yaml",
                      [f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2))
    rt = SimpleNamespace(world_size=1, distributed=False, is_main=True, device="cpu")
    return Checkpointer(engine, rt, cfg, {}, [], log=lambda msg: None)


def test_best_is_kept_only_with_export_best_and_patience(tmp_path):
    off = _checkpointer(tmp_path, "train.export_best=false", "train.patience=3")
    assert not off.keeps_best and not off.mark_best(10) and off.best_tag is None
    no_patience = _checkpointer(tmp_path, "train.export_best=true", "train.patience=0")
    assert not no_patience.keeps_best
    on = _checkpointer(tmp_path, "train.export_best=true", "train.patience=3")
    assert on.mark_best(10) and on.best_tag == "step_00000010"
    assert on.mark_best(30) and on.best_tag == "step_00000030"


def test_resumed_best_is_adopted_only_when_complete(tmp_path, monkeypatch):
    cp = _checkpointer(tmp_path, "train.export_best=true", "train.patience=3")
    complete = {"step_00000010"}
    monkeypatch.setattr(ckpt_mod, "verify",
                        lambda tag_dir: None if Path(tag_dir).name in complete else "incomplete")
    said = []
    cp.log = said.append
    cp.adopt_best("step_00000020")
    assert cp.best_tag is None
    assert len(said) == 1 and "step_00000020 is gone or incomplete" in said[0], said
    cp.adopt_best(None)
    assert cp.best_tag is None
    cp.adopt_best("step_00000010")
    assert cp.best_tag == "step_00000010" and len(said) == 1
    off = _checkpointer(tmp_path, "train.export_best=false", "train.patience=3")
    off.adopt_best("step_00000010")
    assert off.best_tag is None


def test_restore_best_loads_the_best_unless_it_is_the_last(tmp_path, monkeypatch):
    cp = _checkpointer(tmp_path, "train.export_best=true", "train.patience=3")
    loaded = []
    monkeypatch.setattr(cp, "load", lambda tag, check_config=True: loaded.append(
        (tag, check_config)) or {})
    last = cp.dir / "step_00000040"
    assert cp.restore_best(last) == last and loaded == []  # no best yet
    cp.mark_best(40)
    assert cp.restore_best(last) == last and loaded == []  # the best is the last
    cp.mark_best(20)
    assert cp.restore_best(last) == cp.dir / "step_00000020"
    assert loaded == [("step_00000020", False)]  # the run's own checkpoint: no config check


def test_save_refuses_a_nan_model_and_names_the_last_good_checkpoint(tmp_path):
    cp = _checkpointer(tmp_path)
    with torch.no_grad():
        cp.engine.module.weight[0, 0] = float("nan")
    built = []
    with pytest.raises(CheckpointError, match=r"refusing to save step 7: .* none complete in"):
        cp.save(7, lambda: built.append(7) or {"step": 7})
    assert not (cp.dir / "step_00000007").exists()
    assert built == []  # the run's state (token counts) is not touched by a refused save


def test_an_ended_run_s_record(tmp_path):
    """What `--resume` of an ended run returns: the record of the step it resumes from, when
    that step ended the run and the export follows this config; paths under this run's
    checkpoint.dir (which may have moved); a damaged record counts as none."""
    cp = _checkpointer(tmp_path)
    (tmp_path / "ckpt").mkdir()
    summary = {"step": 8, "stopped_early": False, "dev/loss": 3.5,
               "checkpoint": "/old/step_00000008", "export": "/old/export"}
    cp.record_end(summary)
    moved = _checkpointer(tmp_path / "moved")
    (tmp_path / "moved" / "ckpt").mkdir(parents=True)
    (tmp_path / "ckpt" / "ended.json").rename(tmp_path / "moved" / "ckpt" / "ended.json")
    got = moved.ended_at(8, max_steps=8)
    assert got == {**summary, "checkpoint": str(tmp_path / "moved" / "ckpt" / "step_00000008"),
                   "export": str(tmp_path / "moved" / "ckpt" / "export")}
    assert moved.ended_at(8, max_steps=20) is None  # a raised max_steps trains on
    assert moved.ended_at(6, max_steps=8) is None  # another step: not this record
    other = _checkpointer(tmp_path / "moved", "train.export_best=false")
    assert other.ended_at(8, max_steps=8) is None  # exports otherwise now: export again
    (tmp_path / "moved" / "ckpt" / "ended.json").write_text("{torn")
    assert moved.ended_at(8, max_steps=8) is None
    moved.forget_end()
    assert not (tmp_path / "moved" / "ckpt" / "ended.json").exists()
