"""A tiny THOR run through the CLI: `routing-stats` writes the THOR tables and `evaluate` reports
task accuracy and experts per token."""

import csv
import json

from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
THOR = ["moe.num_experts=4", "moe.encoder_router=thor", "moe.decoder_router=thor",
        "thor.num_candidates=2", "train.max_steps=3", "train.validate_every=0",
        "train.log_every=1"]


def test_thor_routing_stats_and_evaluate(tiny_prepared, tmp_path):
    work = tmp_path / "w"
    run_cli(["train", "--config", CONFIG, *debug_overrides(tiny_prepared, work, *THOR)],
            cwd=tmp_path)
    ckpt = str(work / "ckpt" / "export")

    out = tmp_path / "stats"
    proc = run_cli(["routing-stats", "--checkpoint", ckpt, "--split", "dev", "--out", str(out)],
                   cwd=tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    task = summary["task_prediction"]
    assert task["source"] == "domain" and task["sentences"] == 5 * 8
    assert len(task["tasks"]) == 5 and 0.0 <= task["accuracy"] <= 1.0
    layers = ["encoder_layers.1.ffn", "decoder_layers.1.ffn"]
    for layer in layers:
        for kind in ("expert_gold_task", "expert_pred_task", "candidate_gold_task"):
            assert (out / f"{layer}.{kind}.png").is_file()
            with open(out / f"{layer}.{kind}.csv", newline="") as f:
                rows = list(csv.reader(f))
            assert rows[0] == ["expert", *task["tasks"]] and len(rows) == 1 + 4
        assert summary["layers"][layer]["candidate_set_size"] == 2
        assert 1.0 <= summary["layers"][layer]["experts_per_token"] <= 2.0
    assert (out / "task_confusion.csv").is_file() and (out / "task_confusion.png").is_file()
    prov = json.loads((out / "summary.json").read_text())["provenance"]
    assert "routing-stats" in prov["command"] and {"git", "machine", "libraries"} <= set(prov)
    with open(out / "layers.csv", newline="") as f:
        assert [r["layer"] for r in csv.DictReader(f)] == layers

    ev = run_cli(["evaluate", "--checkpoint", ckpt, "--split", "dev", "--beam", "1",
                  "--json", str(tmp_path / "m.json")], cwd=tmp_path)
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["all"]["task_accuracy"] == task["accuracy"]  # same sentences, same model
    assert result["all"]["experts_per_token"] == summary["experts_per_token"]["all"]
    assert set(result["routing"]["layers"]) == set(layers)
    assert all("task_accuracy" in m for m in result["domains"].values())
    assert "taskacc" in ev.stdout
