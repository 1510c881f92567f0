"""A training run with early stopping stops on its dev plateau and exports its best validation's
weights (train.export_best), or the last step's when that is off (CPU)."""

import json
import re

import pytest
import torch

from moe_train.train.checkpoint import consolidated_state_dict, read_meta
from moe_train.train.export import load_export_weights
from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def test_training_stops_after_patience_validations_without_a_gain(tiny_prepared, tmp_path):
    # min_delta is out of reach: the first validation sets the best, the next two do not
    # improve on it, so patience 2 stops the run at step 15 of 100
    overrides = debug_overrides(tiny_prepared, tmp_path, "train.max_steps=100",
                                "train.validate_every=5", "train.patience=2",
                                "train.early_stop_metric=loss", "train.min_delta=1e9",
                                "checkpoint.save_every=50", "train.bleu_sentences=4",
                                "data.max_tokens=400")
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "| early stop at step 15: dev/loss best" in out and "at step 5," in out, out[-2000:]
    # training time leaves out the three validations (greedy BLEU) and the checkpoints
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < summary["train_seconds"] < summary["wall_seconds"] - 0.05
    # what follows the loop is timed apart, for a margin under a scheduler's limit
    said = re.search(r"\| saved \S+ \| exported \S+ \| final validation, save and export took "
                     r"([\d.]+) s", out)
    assert said and 0 < summary["end_seconds"] and f"{summary['end_seconds']:.1f}" == said[1]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000015"
    assert (tmp_path / "ckpt" / "export" / "model.safetensors").is_file()
    assert read_meta(tmp_path / "ckpt" / "step_00000015")["step"] == 15
    assert not (tmp_path / "ckpt" / "step_00000020").exists()
    # train.export_best: the best validation (step 5) was checkpointed, kept through rotation
    # (keep_last 1) and exported; step 10 was rotated away
    assert "| export: the best validation, step 5" in out, out[-2000:]
    assert read_meta(tmp_path / "ckpt" / "step_00000005")["early_stop"]["best_step"] == 5
    assert not (tmp_path / "ckpt" / "step_00000010").exists()
    best = consolidated_state_dict(tmp_path / "ckpt" / "step_00000005")
    last = consolidated_state_dict(tmp_path / "ckpt" / "step_00000015")
    exported = load_export_weights(tmp_path / "ckpt" / "export")
    name = next(k for k in exported if k.endswith("weight") and not torch.equal(best[k], last[k]))
    assert torch.equal(exported[name], best[name])
    # resumed, the ended run neither trains on past its plateau nor validates and exports again:
    # it returns the summary it ended with
    export_mtime = (tmp_path / "ckpt" / "export" / "model.safetensors").stat().st_mtime_ns
    again = run_cli(["train", "--config", CONFIG, "--resume", *overrides], cwd=ROOT)
    assert "| resume: the run already ended at step 15 (early stop)" in again.stdout, \
        again.stdout[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == summary | {"already_ended": True}
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000015"
    assert (tmp_path / "ckpt" / "export" / "model.safetensors").stat().st_mtime_ns == export_mtime
    # killed in its export, before ended.json: the resumed run trains no step, validates
    # without writing step 15's events again and measures no throughput
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "ckpt" / "ended.json").unlink()
    third = run_cli(["train", "--config", CONFIG, "--resume", *overrides], cwd=ROOT)
    resumed = json.loads(third.stdout.strip().splitlines()[-1])
    assert resumed["step"] == 15 and resumed["train_tokens_per_s"] is None, resumed
    assert resumed["dev/loss"] == summary["dev/loss"]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("dev/loss")] == [5, 10, 15]


def test_export_best_off_exports_the_last_step(tiny_prepared, tmp_path):
    overrides = debug_overrides(tiny_prepared, tmp_path, "train.max_steps=100",
                                "train.validate_every=5", "train.patience=1",
                                "train.early_stop_metric=loss", "train.min_delta=1e9",
                                "train.export_best=false", "checkpoint.save_every=50",
                                "train.bleu_sentences=4", "data.max_tokens=400")
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "| early stop at step 10" in out and "export: the best" not in out, out[-2000:]
    assert not (tmp_path / "ckpt" / "step_00000005").exists()  # no best kept
    last = consolidated_state_dict(tmp_path / "ckpt" / "step_00000010")
    exported = load_export_weights(tmp_path / "ckpt" / "export")
    assert all(torch.equal(exported[k], last[k]) for k in exported if k in last)


@pytest.mark.parametrize("save_every", [50, 5])
def test_a_resumed_run_keeps_its_best_and_its_patience(tiny_prepared, tmp_path, save_every):
    # 10 steps: best at step 5, one validation without a gain; resumed to 100 steps, the
    # count carries on (patience 2 ends the run at step 15, not 20) and step 5 is exported.
    # save_every 5: the last step is also a save step, and its checkpoint must still hold the
    # final validation's count
    common = ["train.validate_every=5", "train.patience=2", "train.early_stop_metric=loss",
              "train.min_delta=1e9", f"checkpoint.save_every={save_every}",
              "checkpoint.keep_last=1",
              "train.bleu_sentences=4", "data.max_tokens=400"]
    run_cli(["train", "--config", CONFIG,
             *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=10", *common)], cwd=ROOT)
    meta = read_meta(tmp_path / "ckpt" / "step_00000010")["early_stop"]
    assert meta["best_step"] == 5 and meta["bad"] == 1 and meta["best_tag"] == "step_00000005"
    proc = run_cli(["train", "--config", CONFIG, "--resume",
                    *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=100", *common)],
                   cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "| early stop at step 15: dev/loss best" in out and "at step 5," in out, out[-2000:]
    assert "| export: the best validation, step 5" in out, out[-2000:]
    best = consolidated_state_dict(tmp_path / "ckpt" / "step_00000005")
    exported = load_export_weights(tmp_path / "ckpt" / "export")
    assert all(torch.equal(exported[k], best[k]) for k in exported if k in best)


def test_a_run_stopped_off_the_validation_schedule_resumes_as_an_uninterrupted_one(
        tiny_prepared, tmp_path):
    """Stopped at step 7 (max_steps or the time limit), the end-of-run validation may set the
    best but does not count towards patience; resumed, the run stops where an uninterrupted
    one does (step 20, not 15), and no step is validated twice (once on the schedule, again at
    the end)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["train.validate_every=5", "train.patience=3", "train.early_stop_metric=loss",
              "train.min_delta=1e9", "checkpoint.save_every=5", "train.bleu_sentences=4",
              "data.max_tokens=400"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    runs = [(whole, ["train.max_steps=100"]), (parts, ["train.max_steps=7"]),
            (parts, ["--resume", "train.max_steps=100"])]
    outs = []
    for work, extra in runs:
        resume = [e for e in extra if e == "--resume"]
        steps = [e for e in extra if e != "--resume"]
        proc = run_cli(["train", "--config", CONFIG, *resume,
                        *debug_overrides(tiny_prepared, work, *steps, *common)], cwd=ROOT)
        outs.append(proc.stdout + proc.stderr)
        if not resume and work == parts:  # step 7: patience counts step 5's validation only
            assert read_meta(parts / "ckpt" / "step_00000007")["early_stop"]["bad"] == 0
    for out in (outs[0], outs[2]):
        assert "| early stop at step 20: dev/loss best" in out, out[-2000:]
    acc = EventAccumulator(str(whole / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("dev/loss")] == [5, 10, 15, 20]  # once each


def test_a_resume_at_a_step_never_validated_validates_and_notes_it(tiny_prepared, tmp_path):
    """Killed in the save of step 8, resumed from step 6 (saved, never validated) with
    max_steps 6: step 6 is validated, written and given to early stopping (so exported when
    best), as an uninterrupted 6-step run does; not skipped as a step validated before."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import cli_env

    common = ["train.validate_every=4", "checkpoint.save_every=6", "checkpoint.keep_last=5",
              "train.patience=100", "train.early_stop_metric=loss", "train.min_delta=0",
              "train.bleu_sentences=4", "data.max_tokens=400"]
    killed = run_cli(["train", "--config", CONFIG,
                      *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=8", *common)],
                     cwd=ROOT, env={**cli_env(), "MOE_TRAIN_TEST_KILL_AT": "engine_saved@8"},
                     check=False)
    assert killed.returncode != 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000006"
    proc = run_cli(["train", "--config", CONFIG, "--resume",
                    *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=6", *common)],
                   cwd=ROOT)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["early_stop"]["best_step"] in (4, 6)
    assert summary["exported_step"] == summary["early_stop"]["best_step"]
    assert summary["early_stop"]["best"] == pytest.approx(min(
        read_meta(tmp_path / "ckpt" / "step_00000006")["early_stop"]["best_values"]
        ["dev/loss"], summary["dev/loss"]))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("dev/loss")] == [4, 6]


def test_a_final_best_checkpoint_records_its_validation(tiny_prepared, tmp_path):
    """The last validation sets a new best: its checkpoint (written for the best as soon as
    it is noted) records that validation, so a run killed before its end record resumes with
    that validation's values, neither counting it twice for patience nor writing its events
    twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = debug_overrides(tiny_prepared, tmp_path, "train.max_steps=4",
                                "train.validate_every=2", "train.patience=3",
                                "train.early_stop_metric=loss", "train.min_delta=0",
                                "checkpoint.save_every=2", "train.bleu_sentences=4",
                                "data.max_tokens=400")
    first = json.loads(run_cli(["train", "--config", CONFIG, *overrides],
                               cwd=ROOT).stdout.strip().splitlines()[-1])
    meta = read_meta(tmp_path / "ckpt" / "step_00000004")
    assert first["early_stop"]["best_step"] == 4  # the loss still falls at step 4
    assert meta["validated_step"] == 4 and meta["early_stop"]["bad"] == 0
    (tmp_path / "ckpt" / "ended.json").unlink()  # killed after the final save
    again = run_cli(["train", "--config", CONFIG, "--resume", *overrides], cwd=ROOT)
    assert json.loads(again.stdout.strip().splitlines()[-1])["dev/loss"] == first["dev/loss"]
    assert read_meta(tmp_path / "ckpt" / "step_00000004")["early_stop"]["bad"] == 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("dev/loss")] == [2, 4]


PLATEAU = ["train.validate_every=3", "train.patience=2", "train.early_stop_metric=loss",
           "train.min_delta=1e9", "checkpoint.save_every=50", "train.bleu_sentences=4",
           "data.max_tokens=400"]
"""Validations at 3, 6, 9, ...: the first sets the best, which nothing beats (min_delta), so
patience 2 ends the run at step 9."""


def test_a_plateau_at_the_last_scheduled_validation_ends_the_run_early(tiny_prepared, tmp_path):
    """Reached at max_steps, it is still early stopping: said, and recorded, so a resume with
    a larger max_steps says the run ended (it skipped training without a word, and replaced
    ended.json with an empty run's figures)."""
    overrides = debug_overrides(tiny_prepared, tmp_path, *PLATEAU)
    proc = run_cli(["train", "--config", CONFIG, *overrides, "train.max_steps=9"], cwd=ROOT)
    assert "| early stop at step 9: dev/loss best" in proc.stdout, proc.stdout[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["stopped_early"] is True
    ended = json.loads((tmp_path / "ckpt" / "ended.json").read_text())
    again = run_cli(["train", "--config", CONFIG, "--resume", *overrides, "train.max_steps=20"],
                    cwd=ROOT)
    assert "the run already ended at step 9 (early stop)" in again.stdout, again.stdout[-2000:]
    assert json.loads((tmp_path / "ckpt" / "ended.json").read_text()) == ended


def test_a_signal_at_the_last_step_keeps_the_final_validation_for_the_resume(tiny_prepared,
                                                                             tmp_path):
    """SIGTERM during step 6 of 6 saves step 6 before its final validation; the resume
    validates it and must write that into step 6's checkpoint (it kept the old state, so a
    later resume with max_steps 12 trained past the plateau at step 9, to step 12)."""
    from tests.conftest import cli_env

    script = tmp_path / "signal_at_6.py"
    script.write_text(
        "import os, signal, sys\n"
        "from moe_train.train.trainer import Trainer\n"
        "step = Trainer.train_step\n"
        "def signalled(self):\n"
        "    out = step(self)\n"
        "    if self.step == 6:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return out\n"
        "Trainer.train_step = signalled\n"
        "from moe_train.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    overrides = debug_overrides(tiny_prepared, tmp_path, *PLATEAU)
    import subprocess
    import sys

    stopped = subprocess.run([sys.executable, str(script), "train", "--config", CONFIG,
                              *overrides, "train.max_steps=6"], cwd=ROOT, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert read_meta(tmp_path / "ckpt" / "step_00000006")["validated_step"] == 3
    run_cli(["train", "--config", CONFIG, "--resume", *overrides, "train.max_steps=6"], cwd=ROOT)
    # what a later resume starts from: the validation at 6 and the patience it used (an
    # uninterrupted run has bad 1 here, and stops at step 9)
    meta = read_meta(tmp_path / "ckpt" / "step_00000006")
    assert meta["validated_step"] == 6 and meta["early_stop"]["bad"] == 1, meta["early_stop"]


def test_a_plateau_on_the_step_the_time_limit_ends_is_early_stopping(tiny_prepared, tmp_path):
    overrides = debug_overrides(tiny_prepared, tmp_path, "train.validate_every=1",
                                "train.patience=1", "train.early_stop_metric=loss",
                                "train.min_delta=1e9", "checkpoint.save_every=50",
                                "train.bleu_sentences=4", "data.max_tokens=400")
    run_cli(["train", "--config", CONFIG, *overrides, "train.max_steps=1"], cwd=ROOT)
    proc = run_cli(["train", "--config", CONFIG, "--resume", *overrides, "train.max_steps=10",
                    "train.max_minutes=1e-6"], cwd=ROOT)
    assert "| early stop at step 2" in proc.stdout and "time limit" not in proc.stdout, \
        proc.stdout[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["stopped_early"] is True
    assert (tmp_path / "ckpt" / "ended.json").is_file()


def test_the_saved_log_window_holds_training_time_only(tiny_prepared, tmp_path):
    """The final validation (greedy BLEU of 40 sentences up to 200 tokens here) and save come
    after the loop: a resumed run's first log line divides the window's tokens by its seconds,
    which must not include them (it reported a fraction of the uninterrupted run's tok/s)."""
    from moe_train.train.log_window import window_file
    from moe_train.utils.safe_load import load_torch

    overrides = debug_overrides(tiny_prepared, tmp_path, "train.max_steps=3",
                                "train.log_every=6", "train.validate_every=0",
                                "train.bleu_sentences=40", "eval.max_len_b=200",
                                "data.max_tokens=400")
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=ROOT)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["end_seconds"] > 0.3, summary  # the case: a final validation that costs
    window = load_torch(window_file(tmp_path / "ckpt" / "step_00000003", 0))
    assert float(window["seconds"]) <= summary["train_seconds"] + 0.05, (window, summary)
