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
