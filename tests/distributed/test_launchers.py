"""The same `train` command under torchrun, mpirun (ranks discovered through mpi4py) and a bare
`srun` (SLURM_PROCID / SLURM_NTASKS; the SLURM test needs ../shared/tools/local-cluster.sh)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env, debug_overrides

BIN = Path(sys.executable).parent


def _which(name: str) -> str | None:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name)


def _train_args(prepared: Path, work: Path) -> list[str]:
    return ["-m", "moe_train", "train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
            *debug_overrides(prepared, work, "train.max_steps=6", "checkpoint.save_every=3",
                             "train.validate_every=0", "train.bleu_sentences=5",
                             "data.max_tokens=400", "optim.zero_stage=2")]


def _check(proc: subprocess.CompletedProcess, work: Path, launcher: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert f"world 2 ({launcher}, gloo)" in out, out[-3000:]
    step = work / "ckpt" / "step_00000006"
    assert (step / "rng_rank0.pt").is_file() and (step / "rng_rank1.pt").is_file()
    summaries = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["step"] == 6  # printed by rank 0 only


@pytest.mark.skipif(_which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_two_ranks(tiny_prepared, tmp_path):
    from moe_train.parallel.runtime import free_port

    work = tmp_path / "w"
    cmd = [_which("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           *_train_args(tiny_prepared, work)]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    _check(proc, work, "env")


@pytest.mark.skipif(_which("mpirun") is None, reason="mpirun (openmpi) not installed")
def test_mpirun_two_ranks(tiny_prepared, tmp_path):
    work = tmp_path / "w"
    env = cli_env()
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    cmd = [_which("mpirun"), "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x",
           "OMP_NUM_THREADS", sys.executable, *_train_args(tiny_prepared, work)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    _check(proc, work, "mpi")


def test_srun_two_ranks_without_launcher(tiny_prepared, tmp_path):
    """`srun -n 2 python -m moe_train train`: ranks, master host and port all from SLURM's env."""
    from tests.distributed.test_multinode import _slurm_partition, skip_unless_cluster

    partition, why = _slurm_partition()
    skip_unless_cluster(why, "slurm")
    work = tmp_path / "w"
    cmd = ["srun", "-p", partition, "-N", "1", "-n", "2", "--kill-on-bad-exit=1", "--time=5",
           sys.executable, *_train_args(tiny_prepared, work)]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    _check(proc, work, "slurm")
