"""A run killed in the middle and resumed ends bitwise equal to an uninterrupted run (CPU)."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from moe_train.train.checkpoint import KILL_ENV, consolidated_state_dict
from tests.conftest import ROOT, cli_env, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
STEPS = 40


def _overrides(prepared, work):
    # dropout stays on: resuming must restore the RNG streams too
    return debug_overrides(prepared, work, f"train.max_steps={STEPS}", "checkpoint.save_every=10",
                           "checkpoint.keep_last=0", "train.validate_every=0",
                           "train.bleu_sentences=8", "data.max_tokens=400", "train.log_every=5")


def _weights(work):
    return consolidated_state_dict(work / "ckpt" / f"step_{STEPS:08d}")


def test_resume_after_kill_is_bitwise_equal(tiny_prepared, tmp_path):
    full = tmp_path / "full"
    run_cli(["train", "--config", CONFIG, *_overrides(tiny_prepared, full)], cwd=ROOT)

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "moe_train", "train", "--config", CONFIG,
                             *_overrides(tiny_prepared, killed)], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "ckpt" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == "step_00000010":
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "ckpt" / "export").exists()
    assert latest.read_text().strip() in ("step_00000010", "step_00000020")

    # without --resume the existing checkpoint is refused, in one line
    refused = run_cli(["train", "--config", CONFIG, *_overrides(tiny_prepared, killed)],
                      cwd=ROOT, check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "--resume" in refused.stderr

    run_cli(["train", "--config", CONFIG, "--resume", *_overrides(tiny_prepared, killed)],
            cwd=ROOT)
    a, b = _weights(full), _weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    meta_full = (full / "ckpt" / "latest").read_text()
    assert meta_full.strip() == f"step_{STEPS:08d}"


def test_resume_needs_the_same_prepared_data_wherever_it_lives(tiny_corpus, tiny_prepared,
                                                               tmp_path):
    """data.prepared_dir may move on resume, but must hold the data the checkpoint trained on:
    other prepared data is one line and exit status 2, before any step."""
    from moe_train.config import load_config
    from moe_train.data.corpus import discover
    from moe_train.data.prepare import prepare

    def train(prepared, steps, *flags):
        return run_cli(["train", "--config", CONFIG, *flags, *debug_overrides(
            prepared, tmp_path, f"train.max_steps={steps}", "checkpoint.save_every=2",
            "train.validate_every=0", "data.max_tokens=400")], cwd=ROOT, check=False)

    assert train(tiny_prepared, 2).returncode == 0
    moved = tmp_path / "moved"
    shutil.copytree(tiny_prepared, moved)
    assert train(moved, 3, "--resume").returncode == 0  # the same data, moved
    other = tmp_path / "other"  # the same corpus, another sentencepiece model
    prepare(discover(tiny_corpus), other,
            load_config(CONFIG, ["data.vocab_size=280", "data.pairs=[en-de]"]).data, seed=1)
    proc = train(other, 4, "--resume")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0
    assert f"{other / 'spm.model'}: not the tokenizer that" in proc.stderr
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000003"


def _logged(work: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of the run's TensorBoard scalars (train/* and moe/aux_*)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(work / "tb"))
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"]
            if tag.startswith(("train/loss", "train/nll", "train/ppl", "moe/aux_"))
            for e in acc.Scalars(tag)}


def test_the_log_line_after_a_resume_between_two_lines_is_the_uninterrupted_one(
        tiny_prepared, tmp_path):
    """Saved at step 7 with lines every 5 steps: the resumed run's step-10 line averages
    steps 6-10 from the checkpoint's log window, as the uninterrupted run's does (the
    console and TensorBoard; the aux losses too), not steps 8-10."""
    def train(work, *flags, env=None):
        return run_cli(["train", "--config", CONFIG, *flags, *debug_overrides(
            tiny_prepared, work, "train.max_steps=15", "checkpoint.save_every=7",
            "checkpoint.keep_last=0", "train.validate_every=0", "train.log_every=5",
            "data.max_tokens=400", "moe.num_experts=4", "moe.k=2")],
            cwd=ROOT, env=env, check=False)

    full = train(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = train(tmp_path / "killed", env={**cli_env(), KILL_ENV: "before_rotate@7"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(tmp_path / "killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def lines(out: str) -> dict[str, str]:  # "| step 10 | loss 8.954 | nll 8.935 | ppl ..."
        return {" ".join(line.split("|")[1].split()): "|".join(line.split("|")[2:5])
                for line in out.splitlines() if line.startswith("| step ")}

    want, got = lines(full.stdout), lines(resumed.stdout)
    assert set(got) == {"step 10", "step 15"}, resumed.stdout
    assert {k: want[k] for k in got} == got
    want, got = _logged(tmp_path / "full"), _logged(tmp_path / "killed")
    assert want == got and any(tag.startswith("moe/aux_") for tag, _ in want)
