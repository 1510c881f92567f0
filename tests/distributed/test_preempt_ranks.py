"""SIGUSR1 to one rank of a 2-rank run (SLURM's `--signal=USR1@...` reaches each task; here
only rank 1 gets it): both ranks stop after the same step with one checkpoint there, and
`--resume` goes on from it."""

import signal
import time

from moe_train.train.checkpoint import latest_tag
from tests.distributed.test_kill_resume import _finish, _start


def test_one_signalled_rank_stops_both_at_one_saved_step(tiny_prepared, tmp_path) -> None:
    save = ["checkpoint.save_every=1000", "train.max_steps=100000"]
    ranks = _start(tiny_prepared, tmp_path, *save)
    deadline = time.time() + 300
    while "| step      3 |" not in ranks.log.read_text(errors="replace") and \
            time.time() < deadline:
        assert ranks.poll() is None, ranks.log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)
    ranks.send_signal(signal.SIGUSR1, rank=1)
    text = _finish(ranks, expect_ok=False)
    tag = latest_tag(tmp_path / "ckpt")
    step = int(tag[len("step_"):])
    assert step >= 3 and f"| stopped: SIGUSR1 at step {step}: saved" in text, text[-3000:]
    # both ranks stopped there, each with its CLI line (rank 0 learnt it from rank 1)
    assert text.count(f"\nstopped: SIGUSR1 at step {step}: saved") == 2, text[-3000:]
    assert not (tmp_path / "ckpt" / "export").exists()
    text = _finish(_start(tiny_prepared, tmp_path, f"train.max_steps={step + 2}",
                          "checkpoint.save_every=1000", "--resume"))
    assert f"resume from step {step}" in text and f"| step {step + 2:>6} |" in text
