"""benchmarks/thor.py end to end at --quick sizes (tiny corpus and model, a 3-step budget per variant):
the JSON holds per-domain scores, experts per token, task accuracy, an external --test-dir and
the TF-IDF classifier, each consistent with the others."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import pytest

from tests.conftest import ROOT, cli_env


@pytest.mark.benchmark_smoke
def test_quick_run(tmp_path) -> None:
    from moe_train.data.synthetic import generate_synthetic

    ext = tmp_path / "ext"  # 6 domains: "news" is not one of the model's 5
    generate_synthetic(ext, num_domains=6, train_per_domain=1, dev_per_domain=0,
                       test_per_domain=4, seed=7)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "thor.py"), "--data", "synthetic", "--quick",
         "--variants", "thor_topp,topp,dense", "--steps", "3", "--work", str(tmp_path / "w"), "--out", str(out),
         "--test-dir", str(ext)], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "thor_synthetic_cpu_quick" and "git" in r["provenance"]
    domains = r["domains"]
    assert len(domains) == 5 and r["splits"]["test"] == 50
    thor, topp, dense = (r["variants"][n] for n in ("thor_topp", "topp", "dense"))
    for v in (thor, topp, dense):
        assert v["training"]["summary"]["step"] == 3 and not v["training"]["reused"]
        assert v["training"]["steps"] == 3 and not v["training"]["cut_by_time_guard"]
        assert set(v["test"]["bleu"]) == set(v["test"]["chrf"]) == {*domains, "all"}
        assert v["test"]["sentences"] == 50
    # THOR top-p: 1 MoE layer per side at --quick sizes, 1 to |S^t| = 4 experts per token.
    ept = thor["test"]["experts_per_token"]
    assert set(ept["layers"]) == {"encoder_layers.0.ffn", "decoder_layers.0.ffn"}
    assert all(1.0 <= x <= 4.0 for x in ept["layers"].values())
    assert abs(ept["mean"] - np.mean(list(ept["layers"].values()))) < 1e-3
    assert 1.0 <= topp["test"]["experts_per_token"]["mean"] <= 8.0
    task = thor["test"]["task_accuracy"]
    confusion = np.asarray(task["confusion_gold_x_predicted"])
    assert confusion.shape == (5, 5) and confusion.sum() == task["sentences"] == 50
    assert task["all"] == round(np.trace(confusion) / 50, 4)
    assert dense["test"]["experts_per_token"] is None and dense["test"]["task_accuracy"] is None
    assert topp["test"]["task_accuracy"] is None
    if "moe_train_evaluate" in thor["test"]:  # evaluate's own routing metrics agree
        assert thor["test"]["moe_train_evaluate"]["experts_per_token_mean_agrees"]
    # The external test set: the model's 5 domains scored, "news" skipped.
    assert thor["test_dir"]["sentences"] == 5 * 4
    assert set(thor["test_dir"]["bleu"]) == {*domains, "all"}
    assert [s for s in thor["test_dir_skipped"] if "domain news" in s]
    clf = r["task_classifier_tfidf_logreg"]
    assert clf["test"]["sentences"] == 50 and clf["test_dir"]["sentences"] == 20
    assert 0.0 <= clf["test"]["all"] <= 1.0
    acc = r["acceptance"]
    assert acc["variants_cut_by_time_guard"] == [] and r["config"]["steps_per_variant"] == 3
    assert acc["thor_topp_fewer_experts_than_topp"] == \
        (ept["mean"] < topp["test"]["experts_per_token"]["mean"])
    assert acc["thor_topp_task_accuracy_ge_0.95"] == (task["all"] >= 0.95)
