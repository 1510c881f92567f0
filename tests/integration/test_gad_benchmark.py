"""benchmarks/gad.py end to end at --quick sizes (tiny corpus and model, a few steps per stage):
the JSON holds every system's tables, the CE ablation, an external --test-dir and acceptance
checks computed from the same numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env

SYSTEMS = {"MIX", "TAG", "TAG_CLF", "AD_ORACLE", "AD_CLF", "GAD"}


@pytest.mark.benchmark_smoke
def test_quick_run(tmp_path) -> None:
    from moe_train.data.synthetic import generate_synthetic

    ext = tmp_path / "ext"  # 5 domains: "religion" is not one of the model's 4
    generate_synthetic(ext, num_domains=5, train_per_domain=1, dev_per_domain=0,
                       test_per_domain=3, seed=7)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gad.py"), "--data", "synthetic", "--quick",
         "--work", str(tmp_path / "w"), "--out", str(out), "--test-dir", str(ext)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "gad_synthetic_cpu_quick" and "git" in r["provenance"]
    assert r["stages"]["backbone"]["step"] == 12 and r["stages"]["gad"]["step"] == 4
    ev = r["evaluate"]
    assert set(ev["systems"]) == SYSTEMS and ev["test_sentences"] == 16
    acc = r["acceptance"]
    assert acc["avg_bleu"] == {n: s["avg"]["bleu"] for n, s in ev["systems"].items()}
    assert acc["gad_bleu_ge_mix"] == (acc["avg_bleu"]["GAD"] >= acc["avg_bleu"]["MIX"])
    ratio = ev["efficiency"]["sentences_per_s_ratios"]["GAD/AD_CLF"]
    assert acc["gad_speed_ge_1.1x_ad_clf"] == (ratio >= 1.1)
    assert acc["frozen_parameters_bitwise_unchanged"] is True
    ab = r["ablation_gate_ce"]
    kd, ce = ab["kd"]["quality"], ab["ce"]["quality"]
    assert ab["kd"]["split"] == ab["ce"]["split"] == "dev" and ce["all"]["sentences"] == 16
    assert ab["kd_minus_ce_avg_bleu"] == round(kd["avg"]["bleu"] - ce["avg"]["bleu"], 2)
    td = r["test_dir"]
    assert set(td["systems"]) == SYSTEMS and td["test_sentences"] == 12  # 4 domains x 3
    assert len(td["skipped"]) == 1 and "religion" in td["skipped"][0]
