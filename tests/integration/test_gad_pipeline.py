"""`moe-train pipeline gad` on a small synthetic corpus: every stage and every system of 004's
tables (MIX, TAG, TAG_CLF, AD_ORACLE, AD_CLF, GAD), frozen parameters bitwise unchanged, the
teacher's probabilities, the TF-IDF classifier, finished stages reused, one-line errors, and
the data-parallel encoder classifier on two ranks equal to one rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_train.train.export import load_export_weights
from tests.cli_runner import Ranks
from tests.conftest import ROOT, cli_env, run_cli

CONFIG = str(ROOT / "configs" / "gad-synthetic.yaml")
SYSTEMS = {"MIX", "TAG", "TAG_CLF", "AD_ORACLE", "AD_CLF", "GAD"}
SHORT = ["train.max_steps=40", "gated.tag_steps=10", "gated.ad_steps=10", "gated.gad_steps=10",
         "gated.classifier_steps=30", "moa.eval_sentences=4", "gated.efficiency_repeats=1"]


@pytest.fixture(scope="module")
def gad_run(tmp_path_factory):
    """A finished gad pipeline run with the TAG baselines (about a minute on two cores)."""
    from moe_train.config import load_config
    from moe_train.data.corpus import discover
    from moe_train.data.prepare import prepare
    from moe_train.data.synthetic import generate_synthetic

    root = tmp_path_factory.mktemp("gad")
    generate_synthetic(root / "corpus", num_domains=4, train_per_domain=200, dev_per_domain=10,
                       test_per_domain=10, seed=5)
    cfg = load_config(CONFIG, ["data.domain_tags=true"])
    pairs = cfg.data.pairs  # en -> de, as the recipe reads the de-en files
    prepare(discover(root / "corpus", pairs), root / "prepared", load_config(CONFIG).data, seed=1)
    prepare(discover(root / "corpus", pairs), root / "tagged", cfg.data, seed=1)
    overrides = [f"data.prepared_dir={root / 'prepared'}", f"moa.workdir={root / 'run'}",
                 f"gated.tag_prepared_dir={root / 'tagged'}", *SHORT]
    proc = run_cli(["pipeline", "gad", "--config", CONFIG, *overrides], ROOT, timeout=900)
    return root, overrides, json.loads(proc.stdout.strip().splitlines()[-1])


def _export(root: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_export_weights(root / "run" / stage / "checkpoints" / "export")


def test_every_stage_and_system_is_reported(gad_run):
    root, _, summary = gad_run
    assert set(summary) == {"backbone", "tag", "classifier", "ad", "gad", "evaluate"}
    ev = json.loads((root / "run" / "evaluate" / "eval.json").read_text())
    assert set(ev["systems"]) == SYSTEMS
    for name, system in ev["systems"].items():
        assert set(system["domains"]) == {"it", "law", "medical", "subtitles"}, name
        assert set(system["avg"]) == set(system["wavg"]) == {"bleu", "chrf"}
        assert system["signatures"]["chrf"].startswith("nrefs:1")
    assert sum(ev["training_share"].values()) == pytest.approx(1, abs=1e-3)
    eff = ev["efficiency"]
    assert set(eff["systems"]) == {"AD_ORACLE", "AD_CLF", "GAD"} and eff["batch"] == 64
    assert all(s["sentences"] == 16 and s["sentences_per_s"] > 0
               for s in eff["systems"].values())
    assert set(eff["sentences_per_s_ratios"]) == {"GAD/AD_CLF", "GAD/AD_ORACLE",
                                                  "AD_CLF/AD_ORACLE"}
    agree = ev["gate_agreement"]
    assert len(agree["per_layer_with_classifier"]) == 2  # one per encoder layer
    assert 0 <= agree["with_classifier"] <= 1


def test_classifier_reports_dev_and_stores_teacher_probabilities(gad_run):
    root, _, summary = gad_run
    clf = summary["classifier"]
    assert clf["kind"] == "encoder"
    matrix = np.array(clf["dev"]["confusion"]["matrix"])
    assert matrix.shape == (4, 4) and matrix.sum() == clf["dev"]["sentences"] == 40
    assert clf["dev"]["micro_f1"] == pytest.approx(np.trace(matrix) / 40)
    probs = np.load(root / "run" / "classifier" / "probs_train.npy")
    assert probs.shape == (800, 4) and np.allclose(probs.sum(1), 1, atol=1e-4)


def test_frozen_parameters_are_bitwise_unchanged(gad_run):
    root, _, summary = gad_run
    mix, ad, gad, tag = (_export(root, s) for s in ("backbone", "ad", "gad", "tag"))
    base = [k for k in mix]
    assert base and all(".adapter." not in k for k in base)
    assert all(torch.equal(mix[k], ad[k]) and torch.equal(mix[k], gad[k]) for k in base)
    assert summary["ad"]["frozen_unchanged"] and summary["gad"]["frozen_unchanged"]
    mix_export = str(root / "run" / "backbone" / "checkpoints" / "export")
    assert summary["ad"]["initialised_from"] == summary["gad"]["initialised_from"] == mix_export
    gates = [k for k in gad if k.endswith("router.gate.weight")]
    assert len(gates) == 4 and not any(k in ad for k in gates)  # one gate per layer, new
    adapter = "encoder_layers.0.adapter.moe.experts.w_down_EDR"
    assert adapter in ad and not torch.equal(ad[adapter], gad[adapter])  # GAD trains them
    assert any(not torch.equal(mix[k], tag[k]) for k in base)  # TAG trains everything


def test_finished_stages_are_reused(gad_run):
    root, overrides, summary = gad_run
    proc = run_cli(["pipeline", "gad", "--config", CONFIG, *overrides], ROOT, timeout=300)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary


def test_tfidf_classifier_stage(gad_run, tmp_path):
    root, _, _ = gad_run
    proc = run_cli(["pipeline", "gad", "--config", CONFIG, "--stage", "classifier",
                    f"data.prepared_dir={root / 'prepared'}", f"moa.workdir={tmp_path}",
                    "gated.classifier=tfidf"], ROOT)
    out = json.loads(proc.stdout.strip().splitlines()[-1])["classifier"]
    assert out["kind"] == "tfidf" and out["dev"]["micro_f1"] > 0.5
    assert (tmp_path / "classifier" / "tfidf.skops").is_file()


def test_bad_input_fails_in_one_line(gad_run, tmp_path):
    root, _, _ = gad_run
    base = [f"data.prepared_dir={root / 'prepared'}",
            f"moa.backbone_dir={root / 'run' / 'backbone'}"]

    def fails(*args: str) -> str:
        proc = run_cli(["pipeline", "gad", "--config", CONFIG, *args], ROOT, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, proc.stderr[-2000:]
        return lines[0]

    assert "stage gad: needs the output of stage classifier" in fails(
        "--stage", "gad", *base, f"moa.workdir={tmp_path / 'a'}")
    assert "adapters.num_experts: expected one adapter per domain (4" in fails(
        "--stage", "ad", *base, f"moa.workdir={tmp_path / 'b'}", "adapters.num_experts=3")
    # the whole recipe checks its adapters before the backbone trains
    assert "adapters.num_experts: expected one adapter per domain (4" in fails(
        f"data.prepared_dir={root / 'prepared'}", f"moa.workdir={tmp_path / 'd'}",
        "adapters.num_experts=3")
    assert not (tmp_path / "d" / "backbone").exists()
    assert "was prepared without domain tags" in fails(
        "--stage", "tag", *base, f"moa.workdir={tmp_path / 'c'}",
        f"gated.tag_prepared_dir={root / 'prepared'}")
    assert "gated.tag_prepared_dir: the tag stage needs the corpora prepared" in fails(
        "--stage", "tag", *base, f"moa.workdir={tmp_path / 'e'}", "gated.tag_prepared_dir=")
    assert "unknown stage 'features' of recipe gad" in fails("--stage", "features", *base)
    assert "gated.classifier: expected one of encoder, tfidf" in fails("gated.classifier=bert")


def test_two_rank_encoder_classifier_equals_one_rank(gad_run, tmp_path):
    """The classifier stage on two ranks of one job (test_moa_pipeline launches its stages
    with the deepspeed launcher itself)."""
    root, _, _ = gad_run
    args = ["pipeline", "gad", "--config", CONFIG, "--stage", "classifier",
            f"data.prepared_dir={root / 'prepared'}", f"moa.workdir={tmp_path}",
            f"moa.backbone_dir={root / 'run' / 'backbone'}", *SHORT]
    Ranks(args, ROOT, cli_env(), tmp_path / "classifier.log").finish(timeout=600)
    for split in ("train", "dev", "test"):
        one = np.load(root / "run" / "classifier" / f"probs_{split}.npy")
        two = np.load(tmp_path / "classifier" / f"probs_{split}.npy")
        np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)
