"""Frozen experts (an MoE backbone under the adapter stage) are saved and resumed under ZeRO
1-3 (saving used to fail: a frozen parameter has no optimizer partition)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env, debug_overrides

WORKER = ROOT / "tests" / "distributed" / "frozen_experts_worker.py"


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_frozen_experts_save_and_resume(tiny_prepared, tmp_path, zero_stage):
    overrides = debug_overrides(tiny_prepared, tmp_path, "moe.num_experts=4", "moe.k=2",
                                f"optim.zero_stage={zero_stage}", "train.max_steps=1",
                                "train.validate_every=0", "train.bleu_sentences=2",
                                "data.max_tokens=300", "eval.beam=1")
    proc = subprocess.run([sys.executable, str(WORKER), str(ROOT / "configs" / "debug-cpu.yaml"),
                           *overrides], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trained"] == 0.0  # frozen: the step left them as they were
    assert result["resumed"] == 0.0 and result["step"] == 1  # restored from the checkpoint
