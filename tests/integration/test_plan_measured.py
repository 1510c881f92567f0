"""The memory planner against real training steps on the CPU: `plan_memory` (fp32, ZeRO 0,
1 process, CPU kernels) within 15% of the peak live tensor bytes `measure_peak` records for a
seq2seq MoE and a decoder-only Qwen2-MoE (each a few seconds), in total and in the working set
the step adds to parameters, gradients and optimizer state (activations and the loss's
gradients: the part the activation model has to get right)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_train.config import load_config
from moe_train.eval.plan_measure import MEASURED_CHECKS, measured_vs_planned

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15


def _cfg(name: str, extra: list[str] | None = None):
    path, overrides, micro_batch, seq_len = MEASURED_CHECKS[name]
    return load_config(ROOT / path, overrides + (extra or [])), micro_batch, seq_len


@pytest.mark.parametrize("name", sorted(MEASURED_CHECKS))
def test_planned_peak_within_15_percent_of_measured(name: str) -> None:
    cfg, micro_batch, seq_len = _cfg(name)
    r = measured_vs_planned(cfg, micro_batch, seq_len)
    measured, planned = r["measured"], r["planned"]
    assert (20e6 if name == "seq2seq" else 10e6) <= measured["parameters"] <= 60e6
    # parameters + gradients + Adam's m and v alive at the step's start: 16 B per parameter
    assert abs(measured["static"] - 16 * measured["parameters"]) < 0.01 * measured["static"]
    assert measured["peak_phase"] == "backward"  # the start of the backward, as modelled
    assert abs(r["relative_error"]) <= TOLERANCE, r
    assert abs(r["working_relative_error"]) <= TOLERANCE, r
    # the optimizer step's own transient (foreach sqrt(v) of the larger group)
    step_error = planned["optimizer_step"] / measured["optimizer_working"] - 1
    assert abs(step_error) <= TOLERANCE, r


@pytest.mark.parametrize("config, overrides", [
    ("configs/gad-synthetic.yaml", ["gated.gate_loss=none"]),  # every adapter on every token
    ("configs/moa-synthetic-adpt.yaml", []),  # one adapter per sentence, by its domain
], ids=["gated", "adpt"])
def test_adapter_slots_within_5_percent_of_measured(config: str, overrides: list[str]) -> None:
    """Adapter slots are planned (they were left out: 37% / 20% of the working set short)."""
    r = measured_vs_planned(load_config(ROOT / config, overrides), 16, 64)
    assert abs(r["working_relative_error"]) <= 0.05, r
    assert abs(r["relative_error"]) <= 0.05, r


def test_activation_checkpointing_within_15_percent_of_measured() -> None:
    """transformers' per-layer checkpointing of the Qwen model; a small vocabulary makes the
    recomputed layer, not the loss, the larger of the two."""
    for extra, micro_batch, seq_len in (([], None, None), (["qwen.vocab_size=600"], 8, 256)):
        cfg, mb, sl = _cfg("qwen", extra)
        r = measured_vs_planned(cfg, micro_batch or mb, seq_len or sl,
                                activation_checkpointing=True)
        terms = r["planned"]["activation_terms"]
        if extra:
            assert terms["recomputed_layer"] > terms["loss"]
        assert abs(r["relative_error"]) <= TOLERANCE, r
        assert abs(r["working_relative_error"]) <= TOLERANCE, r


def test_plan_cli_prints_the_table_and_json_and_rejects_bad_flags(tmp_path) -> None:
    import json

    from tests.conftest import ROOT, run_cli

    config = str(ROOT / "configs" / "qwen1.5-moe-a2.7b.yaml")
    proc = run_cli(["plan", "--config", config, "--gpus-per-node", "8", "--gpu-mem", "80",
                    "--zero", "3", "--micro-batch", "1", "--seq-len", "2048"], cwd=tmp_path)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 8 and report["fits"] and "fits:" in proc.stdout
    for flags, field in ((["--zero", "3", "--ep", "4"], "--ep"), (["--ep", "7"], "--ep"),
                         (["--zero", "5"], "--zero")):
        proc = run_cli(["plan", "--config", config, *flags], cwd=tmp_path, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert field in proc.stderr and "Traceback" not in proc.stderr
