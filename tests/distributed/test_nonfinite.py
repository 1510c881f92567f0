"""Non-finite steps through the real Trainer on two gloo ranks (one spawn, MoE with ep_size 2).

Per ZeRO stage 0, 1 and 2: step 1 is normal; step 2 has a NaN loss (and NaN gradients) on rank
1 only; step 3 reports an infinite loss on rank 0 while its gradients stay finite (DeepSpeed
alone would apply that step); step 4 is normal. Steps 2 and 3 must be skipped on both ranks:
parameters, optimizer moments, fp32 master partitions and the lr scheduler bitwise unchanged,
`engine.skipped_steps` counting them. Then `fit()` with `optim.max_nonfinite_steps=2` and NaN
losses from step 4 on stops at step 5 with one MoeTrainError line naming the step 3 checkpoint,
after logging each skip (console line, train/nonfinite_steps scalar); and `save()` refuses a
NaN parameter held by one rank only, writing nothing, also when it is in one rank's ZeRO-3
partition.
"""

import logging
import math
import os
from pathlib import Path

import pytest
import torch

from tests.distributed.two_ranks import spawn_ranks
from tests.conftest import ROOT, debug_overrides, run_cli

COMMON = ["model.dropout=0.0", "optim.warmup_steps=1", "optim.lr=1e-3", "data.max_tokens=300",
          "train.progress_bar=false", "train.validate_every=0", "train.log_every=1",
          "moe.num_experts=4", "moe.k=2", "moe.ep_size=2", "optim.clip_norm=0.5"]


def _inject(trainer, plan: dict[int, tuple[int, str]]) -> None:
    """Make step `s` (1-based) non-finite on rank `r` per plan {s: (r, 'nan' | 'loss')}."""
    forward = trainer._forward_loss

    def forward_loss(batch):
        scaled, loss_sum, nll_sum = forward(batch)
        rank, how = plan.get(trainer.step + 1, (-1, ""))
        if rank == trainer.rt.rank and how == "nan":
            return scaled * float("nan"), float("nan"), nll_sum
        if rank == trainer.rt.rank and how == "loss":  # reported loss only; gradients finite
            return scaled, float("inf"), nll_sum
        return scaled, loss_sum, nll_sum

    trainer._forward_loss = forward_loss


def _state(trainer) -> dict[str, torch.Tensor]:
    """Parameters, optimizer moments and fp32 master partitions, cloned."""
    engine = trainer.engine
    out = {f"param.{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the client optimizer
    for i, st in enumerate(inner.state.values()):
        for k, v in st.items():
            out[f"moment.{i}.{k}"] = torch.as_tensor(v).detach().clone()
    for i, t in enumerate(getattr(opt, "single_partition_of_fp32_groups", [])):
        out[f"master.{i}"] = t.detach().clone()
    return out


def _steps(trainer) -> dict:
    plan = {2: (1, "nan"), 3: (0, "loss")}
    _inject(trainer, plan)
    engine = trainer.engine
    rec: dict = {"nonfinite": [], "changed": [], "finite_after": [], "skipped": [], "sched": [],
                 "moments": 0, "aux_micro_batches": []}
    for _ in range(4):
        before = _state(trainer)
        sched = engine.lr_scheduler.last_epoch
        sums = trainer.train_step()
        after = _state(trainer)
        rec["nonfinite"].append(sums["nonfinite"])
        rec["changed"].append(sorted(k for k in before if not torch.equal(before[k], after[k])))
        rec["finite_after"].append(all(bool(torch.isfinite(v.float()).all())
                                       for v in after.values()))
        rec["skipped"].append(engine.skipped_steps)
        rec["sched"].append(engine.lr_scheduler.last_epoch - sched)
        rec["aux_micro_batches"].append(trainer.window.aux_micro_batches)
        rec["moments"] = sum(k.startswith("moment.") for k in after)
    return rec


def _fit(trainer, ckpt: Path) -> dict:
    from moe_train.errors import CheckpointError, MoeTrainError

    _inject(trainer, {s: (1, "nan") for s in range(4, 10)})
    printed, scalars = [], []
    print_, scalars_ = trainer.monitor.print, trainer.monitor.scalars
    trainer.monitor.print = lambda msg: (printed.append(msg), print_(msg))
    trainer.monitor.scalars = lambda step, v: (scalars.append((step, dict(v))), scalars_(step, v))
    rec: dict = {}
    try:
        trainer.fit()
    except MoeTrainError as exc:
        rec["error"] = str(exc)
    rec["step"] = trainer.step
    rec["printed"] = printed
    writer = trainer.monitor.writer  # rank 0 writes TensorBoard; the error closed it
    rec["writer"] = None if writer is None else writer.all_writers is None
    rec["nonfinite_scalars"] = [(s, v["train/nonfinite_steps"]) for s, v in scalars
                                if "train/nonfinite_steps" in v]
    dirs = sorted(p.name for p in ckpt.iterdir())
    if trainer.rt.rank == 1:
        next(trainer.engine.module.parameters()).data.view(-1)[0] = float("nan")
    try:
        trainer.save()
    except CheckpointError as exc:
        rec["save_error"] = str(exc)
    rec["dirs_unchanged"] = sorted(p.name for p in ckpt.iterdir()) == dirs
    return rec


def _zero3_save(trainer) -> dict:
    """Under ZeRO-3 `parameters()` are empty placeholders outside a forward: a NaN in rank 1's
    partition must still stop the save."""
    from moe_train.errors import CheckpointError

    trainer.train_step()
    first = next(trainer.engine.module.parameters())
    rec: dict = {"placeholder_numel": first.numel()}
    if trainer.rt.rank == 1:
        first.ds_tensor.view(-1)[0] = float("nan")
    try:
        trainer.save()
    except CheckpointError as exc:
        rec["save_error"] = str(exc)
    return rec


def _worker(rank: int, port: int, prepared: str, work: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from moe_train.config import load_config
    from moe_train.parallel.runtime import init_runtime, shutdown
    from moe_train.train.trainer import Trainer

    rt = init_runtime()
    out: dict = {}
    for zero in (0, 1, 2):
        over = debug_overrides(Path(prepared), Path(work) / f"z{zero}", *COMMON,
                               f"optim.zero_stage={zero}")
        out[f"zero{zero}"] = _steps(Trainer(load_config(ROOT / "configs" / "debug-cpu.yaml",
                                                        over), rt))
    ckpt = Path(work) / "fit" / "ckpt"
    over = debug_overrides(Path(prepared), Path(work) / "fit", *COMMON, "optim.zero_stage=1",
                           "optim.max_nonfinite_steps=2", "train.max_steps=8",
                           "checkpoint.save_every=3")
    out["fit"] = _fit(Trainer(load_config(ROOT / "configs" / "debug-cpu.yaml", over), rt), ckpt)
    over = debug_overrides(Path(prepared), Path(work) / "z3", *COMMON, "moe.ep_size=1",
                           "optim.zero_stage=3",  # every parameter partitioned, however small
                           "deepspeed.zero_optimization.stage3_param_persistence_threshold=0")
    out["zero3"] = _zero3_save(Trainer(load_config(ROOT / "configs" / "debug-cpu.yaml", over),
                                       rt))
    torch.save(out, Path(work) / f"rank{rank}.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def runs(tiny_prepared, tmp_path_factory) -> list[dict]:
    from moe_train.parallel.runtime import free_port

    work = tmp_path_factory.mktemp("nonfinite")
    spawn_ranks(_worker, (free_port(), str(tiny_prepared), str(work)), 2)
    return [torch.load(work / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_nonfinite_step_applies_no_update_on_any_rank(runs, zero):
    for rank in range(2):
        rec = runs[rank][f"zero{zero}"]
        assert rec["nonfinite"] == [0.0, 1.0, 1.0, 0.0]
        assert rec["moments"] > 0  # Adam moments exist and are compared
        # steps 1 and 4 move parameters and moments; the skipped steps 2 and 3 change nothing
        assert any(k.startswith("param.") for k in rec["changed"][0])
        assert any(k.startswith("moment.") for k in rec["changed"][3])
        assert rec["changed"][1] == [] and rec["changed"][2] == []
        assert rec["finite_after"] == [True] * 4
        assert rec["skipped"] == [0, 1, 2, 2]  # DeepSpeed's own count of skipped steps
        assert rec["sched"] == [1, 0, 0, 1]  # the lr scheduler does not advance on a skip
        # the log window's aux losses leave the skipped steps out, as its loss does
        assert rec["aux_micro_batches"] == [1, 1, 1, 2]


def test_consecutive_nonfinite_steps_stop_the_run_naming_the_last_checkpoint(runs):
    for rank in range(2):
        rec = runs[rank]["fit"]
        assert rec["step"] == 5
        assert rec["error"].startswith("optim.max_nonfinite_steps: 2 consecutive steps")
        assert "\n" not in rec["error"]
        assert rec["error"].endswith(os.path.join("fit", "ckpt", "step_00000003"))
    printed = runs[0]["fit"]["printed"]
    skips = [m for m in printed if "update skipped on every rank" in m]
    assert len(skips) == 2 and "2 in a row, 2 in total" in skips[1]
    # TensorBoard: the count is written at each skip and with every log line
    values = dict(runs[0]["fit"]["nonfinite_scalars"])
    assert values[3] == 0.0 and values[4] == 1.0 and values[5] == 2.0
    assert [s for s, _ in runs[0]["fit"]["nonfinite_scalars"]] == [1, 2, 3, 4, 5]  # once each
    assert runs[0]["fit"]["writer"] is True and runs[1]["fit"]["writer"] is None
    assert all(math.isfinite(v) for v in values.values())


def test_save_refuses_a_nonfinite_parameter_on_any_rank(runs):
    for rank in range(2):
        rec = runs[rank]["fit"]
        assert "refusing to save step 5: a parameter is NaN or infinite" in rec["save_error"]
        assert rec["save_error"].endswith("step_00000003")
        assert rec["dirs_unchanged"]


def test_save_refuses_a_nonfinite_zero3_partition(runs):
    for rank in range(2):
        rec = runs[rank]["zero3"]
        assert rec["placeholder_numel"] == 0  # the parameters themselves show nothing
        assert "refusing to save step 1: a parameter is NaN or infinite" in rec["save_error"]


def test_cli_stops_a_diverging_run_with_exit_2(tiny_prepared, tmp_path):
    """A learning rate of 1e30 makes step 2's forward overflow: every later step is skipped,
    the third in a row stops `moe-train train` with one `error:` line and exit status 2."""
    train = ["train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
             *debug_overrides(tiny_prepared, tmp_path, "optim.lr=1e30", "optim.warmup_steps=1",
                              "optim.clip_norm=0", "optim.max_nonfinite_steps=3",
                              "train.max_steps=20", "train.log_every=1",
                              "checkpoint.save_every=1", "train.validate_every=0",
                              "data.max_tokens=300")]
    proc = run_cli(train, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert errors == [f"error: optim.max_nonfinite_steps: 3 consecutive steps (up to step 4) "
                      f"had a non-finite loss or gradient norm; stopped; last good checkpoint: "
                      f"{tmp_path / 'ckpt' / 'step_00000003'}"]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("update skipped on every rank") == 3
    assert "| step      2 | loss nan |" in proc.stdout  # a window of skipped steps only
    # the writer was closed on the error: the event file holds every skipped step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/nonfinite_steps")] == [
        (1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0)]
    # Step 3's checkpoint was saved two skips into the streak: resumed, the streak goes on and
    # the next skip is the third in a row (a requeued job gets no fresh allowance).
    proc = run_cli([*train, "--resume"], cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "| resume: 2 non-finite steps in a row so far" in proc.stdout
    assert proc.stdout.count("update skipped on every rank") == 1
    assert "3 consecutive steps (up to step 4)" in proc.stderr
    assert not (tmp_path / "ckpt" / "step_00000004").exists()
