"""SIGTERM (a scheduler's preemption or time limit) stops training at the next step with a
checkpoint there: one line on stderr, exit status 128 + 15, and `--resume` goes on from it."""

import signal
import subprocess
import sys
import time

from moe_train.train.checkpoint import latest_tag
from tests.conftest import ROOT, cli_env, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def test_sigterm_saves_the_step_and_resume_goes_on(tiny_prepared, tmp_path) -> None:
    common = ["train.validate_every=0", "checkpoint.save_every=1000", "train.log_every=1",
              "data.max_tokens=400"]
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "moe_train", "train", "--config", CONFIG,
           *debug_overrides(tiny_prepared, tmp_path, *common, "train.max_steps=100000")]
    with open(log, "w") as out, open(tmp_path / "err.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=out, stderr=err)
        deadline = time.time() + 300
        while "| step      3 |" not in log.read_text() and time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    stderr = [line for line in (tmp_path / "err.log").read_text().splitlines()
              if "[WARNING]" not in line]
    tag = latest_tag(tmp_path / "ckpt")
    step = int(tag[len("step_"):])
    assert step >= 3 and stderr == [f"stopped: SIGTERM at step {step}: saved "
                                    f"{tmp_path / 'ckpt' / tag}; run the same command again to "
                                    "continue (train: with --resume)"], stderr
    assert f"| stopped: SIGTERM at step {step}" in log.read_text()
    assert not (tmp_path / "ckpt" / "export").exists()  # saved, not ended
    proc = run_cli(["train", "--config", CONFIG, "--resume",
                    *debug_overrides(tiny_prepared, tmp_path, *common,
                                     f"train.max_steps={step + 2}")], cwd=ROOT)
    assert f"resume from step {step}" in proc.stdout and f"| step {step + 2:>6} |" in proc.stdout
    assert (tmp_path / "ckpt" / "export").is_dir()


def test_a_signal_during_the_final_validation_stops_after_the_export(tiny_prepared, tmp_path):
    """The run is saved and exported as usual, then stops with the signal's status, so that a
    pipeline's next stage would not start (before, the signal was dropped with the handler)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import os, signal, sys\n"
        "from moe_train.train.trainer import Trainer\n"
        "validate = Trainer._validate\n"
        "def final(self, *args, **kwargs):\n"
        "    if self.step == self.cfg.train.max_steps:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return validate(self, *args, **kwargs)\n"
        "Trainer._validate = final\n"
        "from moe_train.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run(
        [sys.executable, str(script), "train", "--config", CONFIG,
         *debug_overrides(tiny_prepared, tmp_path, "train.validate_every=0",
                          "train.max_steps=3", "data.max_tokens=400")],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "| exported" in proc.stdout and (tmp_path / "ckpt" / "export").is_dir()
    assert f"stopped: SIGTERM at step 3: saved {tmp_path / 'ckpt' / 'step_00000003'}" \
        in proc.stderr


def test_a_signal_during_a_periodic_save_stops_at_that_checkpoint(tiny_prepared, tmp_path):
    """No further step and no second save: the checkpoint just written is where to go on (a
    launcher's grace period after SIGTERM may not hold another step and save)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import os, signal, sys\n"
        "from moe_train.train.checkpointer import Checkpointer\n"
        "save = Checkpointer.save\n"
        "def during(self, step, *args, **kwargs):\n"
        "    out = save(self, step, *args, **kwargs)\n"
        "    if step == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return out\n"
        "Checkpointer.save = during\n"
        "from moe_train.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run(
        [sys.executable, str(script), "train", "--config", CONFIG,
         *debug_overrides(tiny_prepared, tmp_path, "train.validate_every=0", "train.log_every=1",
                          "train.max_steps=10", "checkpoint.save_every=2",
                          "data.max_tokens=400")],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert f"stopped: SIGTERM at step 2: saved {tmp_path / 'ckpt' / 'step_00000002'}" \
        in proc.stderr
    assert "| step      3 |" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000002"]
