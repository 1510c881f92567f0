"""`deepspeed --num_gpus 2` (two CPU gloo ranks) trains and checkpoints, launched as users do."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env, debug_overrides

DEEPSPEED = shutil.which("deepspeed") or str(Path(__import__("sys").executable).with_name("deepspeed"))


@pytest.mark.skipif(not Path(DEEPSPEED).exists(), reason="deepspeed launcher not installed")
def test_deepspeed_launcher_two_ranks(tiny_prepared, tmp_path):
    from moe_train.parallel.runtime import deepspeed_shm_buffer, free_port

    work = tmp_path / "w"
    port = free_port()
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), "--module",
           "moe_train", "train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
           *debug_overrides(tiny_prepared, work, "train.max_steps=12", "checkpoint.save_every=6",
                            "optim.zero_stage=1", "train.validate_every=6",
                            "train.bleu_sentences=10", "data.max_tokens=400")]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "world 2 (env, gloo)" in out
    ckpt = work / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_00000012"
    step_dir = ckpt / "step_00000012"
    assert (step_dir / "rng_rank0.pt").is_file() and (step_dir / "rng_rank1.pt").is_file()
    assert sorted(p.name for p in step_dir.glob("*optim_states.pt"))  # ZeRO-1 shards
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["step"] == 12 and meta["world_size"] == 2
    assert (ckpt / "export" / "model.safetensors").is_file()
    summary = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert summary["step"] == 12 and "dev/bleu" in summary
    # DeepSpeed's CPU shared-memory all-reduce (a C++ JIT build, 67 MB of RAM per rank) was
    # never loaded, and left no buffer behind.
    assert "shm_comm" not in out, out[-3000:]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for rank in (0, 1):
        assert not Path(deepspeed_shm_buffer(rank, env)).exists()
    assert f"_{port}_0" in deepspeed_shm_buffer(0, env)
