"""TensorBoard logs across a resume: the resumed run replaces what the interrupted one logged
after its checkpoint instead of adding a second point per step."""

from __future__ import annotations

from types import SimpleNamespace

from moe_train.train.monitor import Monitor


def _points(tb) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_a_resumed_run_purges_the_steps_after_its_checkpoint(tmp_path) -> None:
    rt = SimpleNamespace(is_main=True)
    first = Monitor(rt, str(tmp_path), total_steps=4, initial_step=0, progress_bar=False)
    for step in range(1, 5):  # steps 3 and 4 are lost with the interruption
        first.scalars(step, {"train/loss": float(step)})
    first.close()
    resumed = Monitor(rt, str(tmp_path), total_steps=4, initial_step=2, progress_bar=False)
    for step in (3, 4):
        resumed.scalars(step, {"train/loss": 10.0 * step})
    resumed.close()
    assert _points(tmp_path) == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_run_from_step_0_replaces_an_attempt_that_never_saved(tmp_path) -> None:
    """`--resume` with no checkpoint yet (the first attempt died before its first save) starts
    at step 0: that attempt's points go, instead of two per step and steps going back."""
    rt = SimpleNamespace(is_main=True)
    for scale in (1.0, 10.0):
        run = Monitor(rt, str(tmp_path), total_steps=4, initial_step=0, progress_bar=False)
        for step in range(1, 3 if scale == 1.0 else 5):
            run.scalars(step, {"train/loss": scale * step})
        run.close()
    assert _points(tmp_path) == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_a_failed_tensorboard_write_is_one_warning_and_training_goes_on(tmp_path, capsys):
    """A full disk under logging.tensorboard_dir: one warning line, logging stops, no error
    reaches the training loop, and the writer thread's own traceback is not printed."""
    import threading

    import torch

    from moe_train.train.monitor import _quiet_tensorboard_thread

    calls = []

    class FullWriter:
        def add_scalar(self, *args):
            calls.append(args)
            raise OSError(28, "No space left on device")

        def close(self):
            raise OSError(28, "No space left on device")

    mon = Monitor(SimpleNamespace(is_main=True), str(tmp_path / "tb"), 10, 0, False)
    mon.writer = FullWriter()
    for step in (1, 2):
        mon.scalars(step, {"train/loss": 1.0, "train/nll": 1.0})
        mon.histogram(step, "h", torch.zeros(2))
    mon.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: logging.tensorboard_dir {tmp_path / 'tb'}: No space left on "
                   "device; TensorBoard logging stopped, training goes on"]
    assert len(calls) == 1 and mon.writer is None

    class _AsyncWriterThread(threading.Thread):
        pass

    seen = []
    thread = SimpleNamespace(thread=_AsyncWriterThread(), exc_type=OSError)
    _quiet_tensorboard_thread(thread, previous=seen.append)
    other = SimpleNamespace(thread=threading.Thread(), exc_type=OSError)
    _quiet_tensorboard_thread(other, previous=seen.append)
    assert seen == [other]
