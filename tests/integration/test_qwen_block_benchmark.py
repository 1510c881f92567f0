"""benchmarks/qwen_block.py at --quick sizes: under each allocator (glibc defaults and
moe_train's tuning, each in its own child process) the record holds every contender's timing,
the ratios, the computed acceptance block, the transformers implementation it resolved and the
passed equality check; plus the calibration comparison and provenance (timing ratios are not
asserted: tiny sizes on a shared CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env

pytest.importorskip("transformers")

CONTENDERS = {"ours", "hf_default", "hf_eager", "per_expert_floor", "dense_floor",
              "shared_router", "per_expert_floor_full", "dense_floor_full"}
RATIOS = {"ours_over_per_expert_floor", "ours_over_dense_floor", "hf_default_over_dense_floor",
          "hf_default_over_per_expert_floor", "hf_eager_over_dense_floor", "eager_over_ours"}


def test_qwen_block_quick(tmp_path) -> None:
    out = tmp_path / "qwen_block.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "qwen_block.py"),
                           "--quick", "--out", str(out)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "qwen_block_cpu_quick" and r["config"]["quick"]
    assert r["config"]["aux_loss_coef"] == 0 and r["config"]["z_loss_coef"] == 0
    prov = r["provenance"]
    assert prov["git"]["commit"] and prov["command"] and prov["finished_at"]
    assert prov["machine"]["torch_threads"] == r["config"]["threads"]
    assert "floors" in r and r["config"]["calibration_reference"]["hf_eager_over_dense_floor"] \
        == 11.8  # the issue's figure: an input of the record, not one of its results
    assert set(r["runs"]) == {"default", "tuned"} == set(r["acceptance"]["all_hold_per_allocator"])
    assert r["runs"]["tuned"]["allocator"]["applied"] is True
    assert r["runs"]["default"]["allocator"]["applied"] is False
    for name, run in r["runs"].items():
        check_run(run, r["config"])
        assert r["acceptance"][name] == run["acceptance"]
        assert r["acceptance"]["all_hold_per_allocator"][name] == run["acceptance"]["all_hold"]
        calib = r["calibration_check"][name]["hf_eager_over_dense_floor"]
        e60 = next(row for row in run["results"] if row["E"] == 60)
        assert calib == e60["ratios_routed_only_floors"]["hf_eager_over_dense_floor"]


def check_run(run: dict, config: dict) -> None:
    """One allocator's measurements are complete and self-consistent."""
    hf = run["transformers"]
    assert hf["version"] and "eager" in hf["available"] and hf["hf_eager_resolved"] == ["eager"]
    assert hf["hf_default_resolved"] and hf["hf_default_resolved"] != ["eager"]
    assert [(row["E"], row["k"]) for row in run["results"]] == [tuple(c) for c in
                                                                config["experts_topk"]]
    for row in run["results"]:
        check = row["equality_check"]
        assert check["passed"] is True
        for name in ("ours_vs_hf_default", "ours_vs_hf_eager"):
            assert max(check[name].values()) <= 1e-4
        assert len(check["weights_compared"]) == 7  # router, 2 expert, 4 shared-expert tensors
        assert row["ours_dropped_slots"] == 0
        assert sum(row["tokens_per_expert"]["counts"]) == row["N"] == row["T"] * row["k"]
        assert set(row["ms"]) == CONTENDERS and min(row["ms"].values()) > 0
        assert all(len(v) == config["reps"] for v in row["ms_reps"].values())
        assert set(row["ratios"]) == RATIOS == set(row["ratios_routed_only_floors"])
        ms = row["ms"]
        assert abs(row["ratios"]["ours_over_per_expert_floor"]
                   - ms["ours"] / ms["per_expert_floor_full"]) < 0.01
        assert abs(row["ratios"]["eager_over_ours"] - ms["hf_eager"] / ms["ours"]) < 0.01
        acc = run["acceptance"][f"E{row['E']}_k{row['k']}"]
        assert acc["ours_over_per_expert_floor"]["holds"] == (
            row["ratios"]["ours_over_per_expert_floor"] <= 1.05)
        assert acc["eager_over_ours"]["holds"] == (row["ratios"]["eager_over_ours"] >= 5.0)
    assert run["acceptance"]["all_hold"] == all(
        c["holds"] for c in run["acceptance"]["E60_k4"].values())  # the calibration size
