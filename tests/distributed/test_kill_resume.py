"""SIGKILL a 2-rank MoE run (ep_size 2, ZeRO 1) at random points, resume, and end bitwise equal.

Kill points (drawn from a printed seed; set KILL_TEST_SEED to replay): inside a checkpoint save at
a random phase (the MOE_TRAIN_TEST_KILL_AT hook of train/checkpoint.py), at a random moment right
after a random training step, and inside a later save at another phase. After every kill
`latest_tag` finds a complete step and `train --resume` continues; the final parameters and expert
Adam moments equal an uninterrupted run's bitwise. Two more tests resume the uninterrupted run's
ep_size 2 checkpoint at ep_size 1 (the next step equals the ep_size 2 continuation to 1e-6) and
in one process (world size 2 -> 1: the Adam moments are carried over).
"""

import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from moe_train.parallel.expert_checkpoint import read_expert_moments
from moe_train.train.checkpoint import (KILL_ENV, consolidated_state_dict, latest_tag,
                                       read_dense_state, read_meta)
from tests.cli_runner import Ranks
from tests.conftest import ROOT, cli_env, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
STEPS = 8
PHASES = ("engine_saved", "before_rename", "before_latest", "before_rotate")
COMMON = ["moe.num_experts=4", "moe.k=2", "moe.capacity_factor=0", "moe.ep_size=2",
          "optim.zero_stage=1", "data.max_tokens=400", "train.validate_every=0",
          "train.bleu_sentences=4", "train.log_every=1", f"train.max_steps={STEPS}"]


def _start(prepared: Path, work: Path, *extra: str, env: dict | None = None) -> Ranks:
    log = work.with_name(work.name + f"-{time.monotonic_ns()}.log")
    work.mkdir(parents=True, exist_ok=True)
    return Ranks(["train", "--config", CONFIG, *debug_overrides(prepared, work, *COMMON, *extra)],
                 ROOT, {**cli_env(), **(env or {})}, log)


def _finish(ranks: Ranks, expect_ok: bool = True) -> str:
    return ranks.finish(expect_ok, timeout=400)


def _train(prepared: Path, work: Path, *extra: str) -> str:
    return _finish(_start(prepared, work, *extra))


@pytest.fixture(scope="module")
def full_run(tiny_prepared, tmp_path_factory) -> Path:
    """The uninterrupted run, every step saved and kept."""
    work = tmp_path_factory.mktemp("kill") / "full"
    _train(tiny_prepared, work, "checkpoint.save_every=1", "checkpoint.keep_last=0")
    return work


def _expert_moments(tag_dir: Path) -> dict[str, torch.Tensor]:
    """{name/moment: global tensor [E, ...]} from the expert files (any ep size)."""
    return {f"{name}/{k}": value for name, m in read_expert_moments(tag_dir).items()
            for k, value in m.items()}


def _dense_moments(tag_dir: Path) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    """(Adam's step, {name: {moment: tensor}}) of the dense parameters' optim_dense store."""
    src, meta = read_dense_state(tag_dir)
    names = [k[len("param/"):] for k in src.names() if k.startswith("param/")]
    return meta["step"], {n: {k: src.get(f"{k}/{n}") for k in ("exp_avg", "exp_avg_sq")}
                          for n in names if f"exp_avg/{n}" in src.shapes}


def _resumable_step(ckpt: Path) -> int:
    """The step `--resume` continues from (0: killed before the first checkpoint existed)."""
    tag = latest_tag(ckpt, warn=None)
    return int(tag[5:]) if tag else 0


def test_kill_anywhere_then_resume_is_bitwise_equal(tiny_prepared, full_run, tmp_path):
    seed = int(os.environ.get("KILL_TEST_SEED", random.randrange(10**6)))
    print(f"kill test seed {seed} (KILL_TEST_SEED={seed} replays it)")
    rng = random.Random(seed)
    work = tmp_path / "killed"
    ckpt = work / "ckpt"
    save = ["checkpoint.save_every=2", "checkpoint.keep_last=2"]
    report = []

    # 1. inside a save, at a random phase
    phase, step = rng.choice(PHASES), rng.choice([2, 4])
    text = _finish(_start(tiny_prepared, work, *save, env={KILL_ENV: f"{phase}@{step}"}),
                   expect_ok=False)
    assert f"| step {step:>6} |" in text and "exported" not in text
    report.append((f"save of step {step} at {phase}", _resumable_step(ckpt)))

    # 2. at a random moment right after a random training step
    resumed = report[-1][1]
    step, delay = rng.randint(resumed + 1, STEPS - 1), rng.uniform(0.0, 0.3)
    ranks = _start(tiny_prepared, work, *save, "--resume")
    deadline = time.time() + 400
    while ranks.poll() is None and time.time() < deadline:
        if f"| step {step:>6} |" in ranks.log.read_text(errors="replace"):
            time.sleep(delay)
            ranks.kill()
            break
        time.sleep(0.02)
    text = _finish(ranks, expect_ok=False)
    assert ranks.returncode == -signal.SIGKILL, text[-3000:]
    report.append((f"{delay:.2f}s after step {step}", _resumable_step(ckpt)))

    # 3. inside a later save, at another phase
    resumed = report[-1][1]
    phase = rng.choice([p for p in PHASES if p != phase])
    step = rng.choice([s for s in range(2, STEPS + 1, 2) if s > resumed])
    text = _finish(_start(tiny_prepared, work, *save, "--resume",
                          env={KILL_ENV: f"{phase}@{step}"}), expect_ok=False)
    assert "exported" not in text, text[-3000:]
    report.append((f"save of step {step} at {phase}", _resumable_step(ckpt)))

    text = _train(tiny_prepared, work, *save, "--resume")
    assert f"resume from step {report[-1][1]}" in text
    for point, tag_step in report:
        print(f"killed {point}: resumed from step {tag_step}")
    tag = f"step_{STEPS:08d}"
    a, b = consolidated_state_dict(full_run / "ckpt" / tag), consolidated_state_dict(ckpt / tag)
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    ma, mb = _expert_moments(full_run / "ckpt" / tag), _expert_moments(ckpt / tag)
    unequal += [k for k in ma if not torch.equal(ma[k], mb[k])]
    print(f"final parameters and expert moments bitwise equal: {not unequal} "
          f"({len(a)} tensors, {len(ma)} expert moment sets)")
    assert not unequal, unequal
    assert ckpt.joinpath("latest").read_text().strip() == tag


def _tb_losses(tb: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def test_ep2_zero1_checkpoint_resumes_at_ep1_with_moments(tiny_prepared, full_run, tmp_path):
    work = tmp_path / "ep1"
    (work / "ckpt").mkdir(parents=True)
    shutil.copytree(full_run / "ckpt" / "step_00000004", work / "ckpt" / "step_00000004")
    (work / "ckpt" / "latest").write_text("step_00000004\n")
    text = _train(tiny_prepared, work, "moe.ep_size=1", "train.max_steps=5",
                  "checkpoint.save_every=5", "--resume")
    assert "moe.ep_size changed 2 -> 1" in text
    assert re.search(r"resharded to world 2 / ep_size 1", text), text[-3000:]

    ref, got = full_run / "ckpt" / "step_00000005", work / "ckpt" / "step_00000005"
    a, b, before = (consolidated_state_dict(ref), consolidated_state_dict(got),
                    consolidated_state_dict(full_run / "ckpt" / "step_00000004"))
    moved = max((a[k] - before[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    ma, mb = _expert_moments(ref), _expert_moments(got)
    mdiff = max((ma[k] - mb[k]).abs().max().item() for k in ma)
    dense_a, dense_b = _dense_moments(ref)[1], _dense_moments(got)[1]
    ddiff = max((dense_a[n][k] - dense_b[n][k]).abs().max().item()
                for n in dense_a for k in ("exp_avg", "exp_avg_sq"))
    la, lb = _tb_losses(full_run / "tb")[5], _tb_losses(work / "tb")[5]
    print(f"ep2->ep1 step 5: loss {la:.7f} vs {lb:.7f}; params max diff {diff:.2e} (step "
          f"moved them {moved:.2e}); expert moments {mdiff:.2e}; dense moments {ddiff:.2e}")
    assert moved > 1e-5  # the step did something, so equality to 1e-6 means something
    assert abs(la - lb) <= 1e-6 and diff <= 1e-6 and mdiff <= 1e-6 and ddiff <= 1e-6


def test_zero1_checkpoint_of_two_ranks_resumes_in_one_process(tiny_prepared, full_run, tmp_path):
    """World size 2 -> 1 under ZeRO 1: experts and dense parameters keep their Adam moments
    (the second moment only decays by beta2 in one step, so a lost one would show), and the
    log says that new RNG streams break bitwise continuation."""
    work = tmp_path / "world1"
    (work / "ckpt").mkdir(parents=True)
    shutil.copytree(full_run / "ckpt" / "step_00000004", work / "ckpt" / "step_00000004")
    (work / "ckpt" / "latest").write_text("step_00000004\n")
    text = run_cli(["train", "--config", CONFIG, "--resume",
                    *debug_overrides(tiny_prepared, work, *COMMON, "moe.ep_size=1",
                                     "train.max_steps=5", "checkpoint.save_every=5")],
                   cwd=ROOT).stdout
    assert "resharded to world 1 / ep_size 1" in text
    assert "bitwise continuation holds only at the same world size" in text
    old, new = work / "ckpt" / "step_00000004", work / "ckpt" / "step_00000005"
    beta2 = read_meta(old)["config"]["optim"]["betas"][1]
    v_old = {k: v for k, v in _expert_moments(old).items() if k.endswith("exp_avg_sq")}
    v_new = _expert_moments(new)
    (step_old, dense_old), (step_new, dense_new) = _dense_moments(old), _dense_moments(new)
    assert step_old == 4.0 and step_new == 5.0 and dense_old
    for name, m in dense_old.items():
        v_old[name] = m["exp_avg_sq"]
        v_new[name] = dense_new[name]["exp_avg_sq"]
    worst = min((v_new[k] - beta2 * v_old[k]).min().item() for k in v_old)
    print(f"world 2 -> 1: min(v5 - beta2 * v4) = {worst:.2e} over {len(v_old)} tensors")
    assert worst >= -1e-12 and max(v.abs().max().item() for v in v_old.values()) > 0
