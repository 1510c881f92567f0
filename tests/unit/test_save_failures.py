"""A write that fails part-way through a checkpoint save does not cut the rank's collectives
short: the tensor store's writer and DeepSpeed's own writes keep the first error until the
loop or `save_checkpoint` is done, every part of a step runs, and rank 0's rename into place
ends in the same agreement as the other phases (tests/distributed/test_rank0_write_failure.py
runs these on two ranks)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train import checkpoint as ckpt
from moe_train.utils import tensor_store


def full_disk(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def test_the_store_writer_keeps_a_failed_shard_for_close(tmp_path, monkeypatch):
    written = []

    def save(path, tensors, metadata=None):
        if not written:
            written.append(path.name)
            raise full_disk(path)
        written.append(path.name)

    monkeypatch.setattr(tensor_store, "save_tensors", save)
    writer = tensor_store.TensorStoreWriter(tmp_path, "s", max_bytes=8)
    for i in range(5):  # a gather loop: every add returns, the first flush failed
        writer.add(f"t{i}", torch.ones(2))
    with pytest.raises(OSError, match="No space left on device") as err:
        writer.close({"x": 1})
    assert err.value.filename == str(tmp_path / "s-00001.safetensors")
    assert written == ["s-00001.safetensors"]  # nothing more was written after it
    assert not tensor_store.index_path(tmp_path, "s").exists()


class Writes:
    """DeepSpeed's checkpoint engine: save and makedirs."""

    def __init__(self, fail: str) -> None:
        self.fail, self.saved = fail, []

    def save(self, state_dict, path):
        if self.fail in str(path):
            raise full_disk(path)
        self.saved.append(Path(path).name)

    def makedirs(self, path, exist_ok=False):
        Path(path).mkdir(parents=True, exist_ok=exist_ok)


class Engine:
    """What save_checkpoint needs of a DeepSpeed engine; its own save_checkpoint writes two
    files, then runs a collective (its final barrier) that must not be skipped."""

    def __init__(self, fail: str = "never") -> None:
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.AdamW(self.module.parameters())
        self.checkpoint_engine = Writes(fail)
        self.fail, self.after_writes = fail, 0

    def _copy_recovery_script(self, save_path):  # ZeRO 1-3: shutil.copyfile on rank 0
        if self.fail == "zero_to_fp32.py":
            raise full_disk(Path(save_path) / self.fail)

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        self.checkpoint_engine.makedirs(Path(save_dir) / tag, exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_optim_states.pt"):
            self.checkpoint_engine.save({}, Path(save_dir) / tag / name)
        self._copy_recovery_script(save_dir)
        self.after_writes += 1  # DeepSpeed's dist.barrier()


def test_deepspeed_s_failed_write_is_raised_after_its_save_checkpoint(tmp_path):
    engine = Engine(fail="mp_rank_00")
    rt = ParallelRuntime()
    with pytest.raises(OSError, match="No space left on device") as err:
        ckpt.save_checkpoint(engine, rt, tmp_path / "ckpt", 2, {"step": 2, "config": {}}, {}, 2)
    assert err.value.filename == str(tmp_path / "ckpt" / "step_00000002" /
                                      "mp_rank_00_model_states.pt")  # the final name
    assert engine.after_writes == 1  # the collective after the failed write still ran
    assert engine.checkpoint_engine.saved == []  # the writes after the first failure: skipped
    assert "save" not in vars(engine.checkpoint_engine)  # its own methods back
    assert not list((tmp_path / "ckpt").iterdir())  # temporary directory removed
    ckpt.save_checkpoint(Engine(), rt, tmp_path / "ckpt", 3, {"step": 3, "config": {}}, {}, 2)
    assert ckpt.latest_tag(tmp_path / "ckpt", warn=None) == "step_00000003"


def test_deepspeed_s_recovery_script_copy_is_deferred_too(tmp_path):
    """DeepSpeed copies zero_to_fp32.py beside the steps with shutil.copyfile, outside its
    checkpoint engine, before its final barrier."""
    engine = Engine(fail="zero_to_fp32.py")
    with pytest.raises(OSError, match="No space left on device") as err:
        ckpt.save_checkpoint(engine, ParallelRuntime(), tmp_path / "ckpt", 2,
                             {"step": 2, "config": {}}, {}, 2)
    assert err.value.filename.endswith("zero_to_fp32.py") and engine.after_writes == 1
    assert "_copy_recovery_script" not in vars(engine)  # its own method back
    assert engine.checkpoint_engine.saved == ["mp_rank_00_model_states.pt",
                                              "zero_pp_rank_0_optim_states.pt"]


def test_every_part_of_a_step_runs_when_one_fails(tmp_path, monkeypatch):
    """The rng file cannot be written: the expert shards (collective gathers) are still
    saved, then the rng error is raised."""
    ran = []
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "rng_rank" in str(path):
            raise full_disk(path)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(OSError, match="No space left on device") as err:
        ckpt.save_checkpoint(Engine(), ParallelRuntime(), tmp_path / "ckpt", 2,
                             {"step": 2, "config": {}}, {}, 2,
                             save_extra=lambda tag_dir: ran.append(tag_dir.name))
    assert "rng_rank0.pt" in err.value.filename and ran == [".tmp-step_00000002"]


def test_a_failed_rename_into_place_is_one_error_and_leaves_latest(tmp_path, monkeypatch):
    rt = ParallelRuntime()
    ckpt.save_checkpoint(Engine(), rt, tmp_path / "ckpt", 1, {"step": 1, "config": {}}, {}, 2)
    real = ckpt.os.replace

    def replace(src, dst):
        if Path(src).name == ".tmp-step_00000002":
            raise OSError(errno.EIO, "Input/output error", str(src))
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        ckpt.save_checkpoint(Engine(), rt, tmp_path / "ckpt", 2, {"step": 2, "config": {}}, {},
                             2)
    assert ckpt.latest_tag(tmp_path / "ckpt", warn=None) == "step_00000001"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000001"]
