"""Checkpoint lifecycle without training: save once, completeness, fallback, strict resume, RNG.

A fake engine stands in for DeepSpeed (it writes one model-states file); a crash at a phase of
`save_checkpoint` is simulated by making the test hook raise where the kill tests SIGKILL.
"""

import errno
import json
import random
import re

import numpy as np
import pytest
import torch

from moe_train.errors import CheckpointError
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train import checkpoint as ckpt
from moe_train.train.resume import RESUME_MAY_CHANGE, check_resume_config
from moe_train.utils import atomic


class FakeEngine:
    """What save_checkpoint needs of a DeepSpeed engine: save_checkpoint and a module."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.AdamW(self.module.parameters())

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        path = f"{save_dir}/{tag}"
        __import__("os").makedirs(path, exist_ok=True)
        torch.save({"module": self.module.state_dict(), **client_state},
                   f"{path}/mp_rank_00_model_states.pt")


def _meta(step):
    return {"step": step, "config": {"train": {"seed": 1}}, "world_size": 1}


def _save(d, step, keep_last=2):
    return ckpt.save_checkpoint(FakeEngine(), ParallelRuntime(), d, step, _meta(step), {},
                                keep_last)


def test_save_once_rotate_and_never_touch_latest(tmp_path):
    d = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(d, step)
    assert ckpt.list_tags(d) == ["step_00000002", "step_00000003"]  # rotated, keep_last 2
    assert (d / "latest").read_text().strip() == "step_00000003"
    before = {p.name: p.stat().st_mtime_ns for p in (d / "step_00000003").iterdir()}
    ino = (d / "step_00000003").stat().st_ino
    _save(d, 3)  # the end-of-fit save of a step already saved: nothing is rewritten
    assert (d / "step_00000003").stat().st_ino == ino
    assert {p.name: p.stat().st_mtime_ns for p in (d / "step_00000003").iterdir()} == before
    assert ckpt.verify(d / "step_00000003") is None
    listed = json.loads((d / "step_00000003" / ckpt.COMPLETE).read_text())["files"]
    assert {"meta.json", "rng_rank0.pt", "mp_rank_00_model_states.pt"} <= set(listed)
    assert not list(d.glob(".tmp-*"))


class FullDiskEngine(FakeEngine):
    """torch.save on a full disk: part of a file, then a RuntimeError with no errno or name."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        __import__("os").makedirs(f"{save_dir}/{tag}", exist_ok=True)
        __import__("pathlib").Path(f"{save_dir}/{tag}/part").write_bytes(b"x" * 64)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")


@pytest.mark.parametrize("free, code", [(0, errno.ENOSPC), (1 << 30, errno.EIO)])
def test_a_full_disk_is_one_error_naming_the_step_and_keeps_latest(tmp_path, monkeypatch, free,
                                                                   code):
    """The save fails as an OSError naming the step (the CLI's one line, exit 1), the
    temporary directory is removed and `latest` still names the last complete step."""
    d = tmp_path / "ckpt"
    _save(d, 1)
    vfs = __import__("os").statvfs(tmp_path)
    monkeypatch.setattr(atomic.os, "statvfs", lambda p: type("V", (), {
        "f_bavail": free // vfs.f_frsize, "f_frsize": vfs.f_frsize})())
    with pytest.raises(OSError) as err:
        ckpt.save_checkpoint(FullDiskEngine(), ParallelRuntime(), d, 2, _meta(2), {}, 2)
    assert (err.value.errno, err.value.filename) == (code, str(d / "step_00000002"))
    assert not list(d.glob(".tmp-*")) and ckpt.latest_tag(d, warn=None) == "step_00000001"
    with pytest.raises(RuntimeError, match="other"):  # any other error is left as it is
        with atomic.write_errors_naming(d / "x"):
            raise RuntimeError("other")


def test_a_safetensors_write_that_fails_names_the_output(tmp_path) -> None:
    from safetensors import SafetensorError

    with pytest.raises(OSError) as err:
        with atomic.write_errors_naming(tmp_path / "w.safetensors"):
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC,
                                                     str(tmp_path / "w.safetensors"))
    with pytest.raises(SafetensorError):  # not a write: left as it is
        with atomic.write_errors_naming(tmp_path / "w.safetensors"):
            raise SafetensorError("Error while deserializing header: HeaderTooLarge")


@pytest.mark.parametrize("phase", ["engine_saved", "before_rename", "before_latest",
                                   "before_rotate"])
def test_crash_inside_save_leaves_a_complete_latest(tmp_path, monkeypatch, phase):
    d = tmp_path / "ckpt"
    _save(d, 1)
    _save(d, 2)

    def crash(p, step):
        if p == phase:
            raise KeyboardInterrupt(p)

    monkeypatch.setattr(ckpt, "_test_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 3)
    tag = ckpt.latest_tag(d, warn=None)
    expect = "step_00000002" if phase in ("engine_saved", "before_rename") else "step_00000003"
    if phase == "before_latest":  # renamed in, pointer not yet moved: `latest` still names 2
        assert (d / "latest").read_text().strip() == "step_00000002"
        expect = "step_00000002"
    assert tag == expect and ckpt.verify(d / tag) is None
    monkeypatch.undo()
    _save(d, 3)  # the resumed run saves step 3 again (or finds it complete)
    assert ckpt.latest_tag(d, warn=None) == "step_00000003"
    assert ckpt.list_tags(d) == ["step_00000002", "step_00000003"]
    assert not list(d.glob(".tmp-*"))


def test_a_save_removes_what_an_interrupted_save_left(tmp_path, monkeypatch):
    """Ctrl-C inside the save of step 3; the resumed run's next save is step 5: the
    model-sized .tmp-step_00000003 must not stay behind for good."""
    d = tmp_path / "ckpt"
    _save(d, 2)

    def crash(p, step):
        if p == "engine_saved":
            raise KeyboardInterrupt(p)

    monkeypatch.setattr(ckpt, "_test_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 3)
    assert (d / ".tmp-step_00000003").is_dir()
    monkeypatch.undo()
    _save(d, 5)
    assert not list(d.glob(".tmp-*")) and ckpt.latest_tag(d, warn=None) == "step_00000005"


def test_a_complete_step_latest_does_not_name_is_replaced_by_the_new_save(tmp_path, monkeypatch):
    """Killed after the rename, before `latest` moved: the resumed run (from step 2, perhaps at
    another world size) trains its own step 3, which must replace the leftover, not be skipped."""
    d = tmp_path / "ckpt"
    _save(d, 2)
    monkeypatch.setattr(ckpt, "_test_hook", lambda p, step: (_ for _ in ()).throw(
        KeyboardInterrupt()) if p == "before_latest" else None)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 3)
    monkeypatch.undo()
    leftover = (d / "step_00000003").stat().st_ino
    assert ckpt.latest_tag(d, warn=None) == "step_00000002"
    meta = _meta(3) | {"resumed": True}
    ckpt.save_checkpoint(FakeEngine(), ParallelRuntime(), d, 3, meta, {}, 2)
    assert (d / "step_00000003").stat().st_ino != leftover
    assert ckpt.read_meta(d / "step_00000003")["resumed"] is True
    assert ckpt.latest_tag(d, warn=None) == "step_00000003"


def test_torn_and_dangling_checkpoints_fall_back_with_one_line(tmp_path):
    d = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(d, step, keep_last=0)
    warnings = []
    (d / "step_00000003" / "rng_rank0.pt").unlink()  # missing file
    assert ckpt.latest_tag(d, warn=warnings.append) == "step_00000002"
    assert len(warnings) == 1 and "step_00000003" in warnings[0] and \
        "step_00000002" in warnings[0] and "rng_rank0.pt is missing" in warnings[0]
    with open(d / "step_00000002" / "mp_rank_00_model_states.pt", "ab") as f:
        f.write(b"x")  # size differs from the manifest (torn write)
    assert ckpt.latest_tag(d, warn=None) == "step_00000001"
    (d / "step_00000001" / "meta.json").write_text("{not json")
    (d / "step_00000001" / ckpt.COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.latest_tag(d, warn=None)


def test_dangling_or_garbage_latest(tmp_path):
    d = tmp_path / "ckpt"
    _save(d, 4)
    (d / "latest").write_text("step_00000009\n")  # names a missing directory
    warnings = []
    assert ckpt.latest_tag(d, warn=warnings.append) == "step_00000004"
    assert "step_00000009" in warnings[0] and "does not exist" in warnings[0]
    (d / "latest").write_bytes(b"\xff\xfe garbage")
    assert ckpt.latest_tag(d, warn=None) == "step_00000004"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match="latest: does not hold a step tag"):
        ckpt.latest_tag(empty)
    assert ckpt.latest_tag(tmp_path / "nothing") is None


def test_corrupt_meta_and_model_states_are_checkpoint_errors(tmp_path):
    d = tmp_path / "ckpt"
    tag_dir = _save(d, 1)
    assert set(ckpt.consolidated_state_dict(tag_dir)) == {"weight", "bias"}  # weights_only
    for meta, why in (({"step": "1", "config": {}}, "'step' is '1'; expected a step number"),
                      ({"step": True, "config": {}}, "'step' is True"),
                      ({"step": 1, "config": "x"}, "'config' is str; expected the run's")):
        (tag_dir / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=re.escape(f"meta.json: {why}")):
            ckpt.read_meta(tag_dir)
    (tag_dir / "meta.json").write_bytes(b"\x00\xff")
    with pytest.raises(CheckpointError, match="meta.json: unreadable"):
        ckpt.read_meta(tag_dir)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: not a readable DeepSpeed model states"):
        ckpt.consolidated_state_dict(tag_dir)


def test_rng_state_round_trips_with_weights_only(tmp_path):
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    np.random.normal()  # a cached Gaussian in the NumPy state
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expect = (random.random(), np.random.normal(), torch.rand(3))
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert expect[0] == got[0] and expect[1] == got[1] and torch.equal(expect[2], got[2])


def test_strict_resume_names_every_refused_field_and_logs_allowed_ones():
    from moe_train.config import load_config
    from tests.conftest import ROOT

    old = load_config(ROOT / "configs" / "debug-cpu.yaml", []).to_dict()
    new = load_config(ROOT / "configs" / "debug-cpu.yaml",
                      ["model.d_model=32", "data.max_tokens=999", "train.max_steps=7",
                       "eval.beam=2"]).to_dict()
    logged = []
    with pytest.raises(CheckpointError) as err:
        check_resume_config(old, new, "ck/step_1", log=logged.append)
    msg = str(err.value)
    assert "\n" not in msg and "model.d_model 64 -> 32" in msg
    assert "data.max_tokens 1024 -> 999" in msg
    assert "train.max_steps" not in msg
    assert any("train.max_steps changed 100 -> 7" in line for line in logged)
    assert any("eval.beam changed 4 -> 2" in line for line in logged)
    ok = load_config(ROOT / "configs" / "debug-cpu.yaml", ["train.max_steps=7"]).to_dict()
    check_resume_config(old, ok, "ck/step_1", log=logged.append)  # allowed change: no error
    assert "moe.ep_size" in RESUME_MAY_CHANGE


def test_resume_data_check_compares_the_tokenizer_and_the_manifest(tmp_path):
    from moe_train.train.resume import check_resume_data

    tag, prepared = tmp_path / "step_1", tmp_path / "prepared"
    tag.mkdir()
    prepared.mkdir()
    manifest = {"vocab_size": 300, "pad_id": 0, "domains": ["law"], "langs": ["de", "en"],
                "corpora": [{"name": "law.en-de", "files": {"train": {"src": "/a/x"}}}],
                "splits": {"train": {"corpus_sizes": [100], "src_tokens": 900,
                                     "tgt_tokens": 950}}}
    (tag / "manifest.json").write_text(json.dumps(manifest))
    (tag / "spm.model").write_bytes(b"model A")
    (prepared / "spm.model").write_bytes(b"model A")
    moved = json.loads(json.dumps(manifest))
    moved["corpora"][0]["files"]["train"]["src"] = "/b/x"  # the data moved: fine
    check_resume_data(tag, moved, [prepared / "spm.model"])
    fewer = json.loads(json.dumps(manifest))
    fewer["splits"]["train"]["corpus_sizes"] = [99]
    with pytest.raises(CheckpointError, match=r"other prepared data .*train corpus_sizes "
                                              r"\[100\] -> \[99\]"):
        check_resume_data(tag, fewer, [prepared / "spm.model"])
    # the training split's content digest: compared where both manifests have one
    manifest["splits"]["train"]["sha256"] = "aaaa"
    (tag / "manifest.json").write_text(json.dumps(manifest))
    before = json.loads(json.dumps(manifest))
    del before["splits"]["train"]["sha256"]  # prepared before the digest existed: not compared
    check_resume_data(tag, before, [prepared / "spm.model"])
    edited = json.loads(json.dumps(manifest))
    edited["splits"]["train"]["sha256"] = "bbbb"
    edited["splits"]["dev"] = {"sha256": "cccc"}  # dev and test may change
    with pytest.raises(CheckpointError, match=r"train sha256 'aaaa' -> 'bbbb'"):
        check_resume_data(tag, edited, [prepared / "spm.model"])
    (prepared / "spm.model").write_bytes(b"model B")
    with pytest.raises(CheckpointError, match="spm.model: not the tokenizer that"):
        check_resume_data(tag, manifest, [prepared / "spm.model"])
