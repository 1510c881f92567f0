"""Recorded real-data run of the stage-wise MoA recipe: OPUS multi-domain de->en, 7 domains, CPU.

    .venv/bin/python benchmarks/moa_real_data.py [--anchors 50] [--out ...]

Reuses the backbone of benchmarks/real_data.py (work/opus-de-en, written there first) as the
backbone stage of three stage-wise runs, each stage a `python -m moe_train pipeline moa --stage S`
subprocess:
- rs: MoA without anchors (configs/moa-opus-de-en.yaml): features, cluster, distill, adapters,
  evaluate;
- di: the same with domain anchors (``moa.anchors_per_domain`` dev sentences per domain, its own
  workdir): features, cluster, distill, and evaluate (no adapter stage, so evaluate decodes the
  backbone and reports the test-set routing of clusterer and distilled gate);
- switch_sl: the learned sentence-gate baseline (configs/moa-opus-de-en-switch-sl.yaml): adapters,
  evaluate.
Finished stages (their done.json) are reused, with the wall-clock time recorded when they ran
(``timings.json`` in each workdir). Writes benchmarks/results/moa_real_data_de_en_cpu.json:
PUR/NMI of clusterer, distilled gate and Switch-SL gate against the true domains (training
sample and test set), per-domain BLEU/chrF of backbone, MoA and Switch-SL, RND, extra parameters,
minutes per stage, CPU cores. A benchmark, not a test: it takes about half an hour on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_train.utils.atomic import write_json  # noqa: E402

BACKBONE = ROOT / "work" / "opus-de-en"
BACKBONE_RESULT = ROOT / "benchmarks" / "results" / "real_data_de_en_cpu.json"
MOA_CONFIG = "configs/moa-opus-de-en.yaml"
SWITCH_CONFIG = "configs/moa-opus-de-en-switch-sl.yaml"
WORK = ROOT / "work" / "moa-opus-de-en"
TIMINGS = "timings.json"


def ensure_backbone_record() -> dict[str, Any]:
    """The backbone stage's done.json in work/opus-de-en, written once from the recorded run."""
    done = BACKBONE / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    rec = json.loads(BACKBONE_RESULT.read_text())
    train = rec["train"]
    summary = {"step": train["step"], "train_seconds": train["train_seconds"],
               "train_tokens_per_s": train["train_tokens_per_s"],
               "export": str(BACKBONE / "checkpoints" / "export"),
               "dev_loss": train["dev/loss"], "dev_bleu": rec["dev_all"]["bleu"],
               "dev_chrf": rec["dev_all"]["chrf"], "pre_inject": False,
               "source": {"record": str(BACKBONE_RESULT.relative_to(ROOT)),
                          "command": "python benchmarks/real_data.py",
                          "config": rec["config"]}}
    write_json(done, summary)
    return summary


def run_stage(config: str, workdir: Path, stage: str, overrides: list[str]) -> dict[str, Any]:
    """Run one stage (or reuse it); returns its done.json plus the minutes it took."""
    timings_path = workdir / TIMINGS
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    done = workdir / stage / "done.json"
    if not done.is_file():
        cmd = [sys.executable, "-m", "moe_train", "pipeline", "moa", "--config", config,
               "--stage", stage, f"moa.workdir={workdir}", *overrides]
        print(f"== {workdir.name}/{stage}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        minutes = (time.time() - t0) / 60
        log = workdir / f"{stage}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
        if proc.returncode != 0 or not done.is_file():
            sys.stdout.write(proc.stdout[-6000:])
            raise SystemExit(f"{workdir.name}/{stage} failed with status {proc.returncode} "
                             f"(log: {log})")
        timings[stage] = round(minutes, 2)
        write_json(timings_path, timings)
        print(f"   done in {minutes:.2f} min", flush=True)
    else:
        print(f"== {workdir.name}/{stage}: reused", flush=True)
    return {"done": json.loads(done.read_text()), "minutes": timings.get(stage)}


def _pur_nmi(report: dict[str, Any]) -> dict[str, float]:
    return {"pur": round(report["pur"], 4), "nmi": round(report["nmi"], 4)}


def _scores(entry: dict[str, Any]) -> dict[str, Any]:
    """BLEU/chrF per domain, overall and RND of one evaluated model."""
    return {"bleu": {d: m["bleu"] for d, m in entry["domains"].items()} | {
                "all": entry["all"]["bleu"]},
            "chrf": {d: m["chrf"] for d, m in entry["domains"].items()} | {
                "all": entry["all"]["chrf"]},
            "rnd": {"bleu": entry["rnd"]["bleu"], "chrf": entry["rnd"]["chrf"]},
            "parameters": entry["parameters"]}


def routing_record(stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """PUR/NMI against the true domains: on the clustered sample and on the test set."""
    out: dict[str, Any] = {}
    if "cluster" in stages:
        c = stages["cluster"]["done"]
        out["clusterer_train_sample"] = _pur_nmi(c["sampled_only"])
        out["clusterer_train_sample_and_anchors"] = _pur_nmi(c["all"])
    if "distill" in stages:
        d = stages["distill"]["done"]
        out["gate_train_features"] = _pur_nmi(d["gate_vs_domains"])
        out["gate_cluster_accuracy"] = round(d["cluster_accuracy"], 4)
    if "evaluate" in stages:
        for name, rep in stages["evaluate"]["done"]["routing"].items():
            out[f"{name}_test"] = _pur_nmi(rep)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", type=int, default=50, help="dev anchors per domain for di")
    ap.add_argument("--runs", default="rs,di,switch_sl", help="comma-separated subset")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "moa_real_data_de_en_cpu.json"))
    args = ap.parse_args()
    if not (BACKBONE / "checkpoints" / "export" / "config.json").is_file():
        print(f"skipped: {BACKBONE}/checkpoints/export not found (run benchmarks/real_data.py)")
        return
    backbone = ensure_backbone_record()
    plan = {
        "rs": (MOA_CONFIG, WORK / "rs", [],
               ["features", "cluster", "distill", "adapters", "evaluate"]),
        "di": (MOA_CONFIG, WORK / "di", [f"moa.anchors_per_domain={args.anchors}"],
               ["features", "cluster", "distill", "evaluate"]),
        "switch_sl": (SWITCH_CONFIG, WORK / "switch-sl", [], ["adapters", "evaluate"]),
    }
    wanted = [r for r in args.runs.split(",") if r]
    t0 = time.time()
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for name in wanted:
        config, workdir, overrides, stages = plan[name]
        runs[name] = {s: run_stage(config, workdir, s, overrides) for s in stages}

    record: dict[str, Any] = {
        "benchmark": "moa_real_data_de_en_cpu",
        "data": "OPUS multi-domain de->en, 7 domains x 5000 pairs; dev/test carved, 200/domain",
        "configs": {"moa": MOA_CONFIG, "switch_sl": SWITCH_CONFIG},
        "backbone": {"dir": str(BACKBONE.relative_to(ROOT)), "steps": backbone["step"],
                     "source": backbone.get("source")},
        "anchors_per_domain_di": args.anchors,
        "cpu": {"cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                "processes": 1, "torch_threads": "all cores, one process per stage"},
        "routing_vs_domains": {name: routing_record(st) for name, st in runs.items()},
        "minutes_per_stage": {name: {s: v["minutes"] for s, v in st.items()}
                              for name, st in runs.items()},
    }
    translation: dict[str, Any] = {}
    for name, st in runs.items():
        if "evaluate" not in st:
            continue
        ev = st["evaluate"]["done"]
        translation.setdefault("test_sentences", ev["test_sentences"])
        translation.setdefault("beam", ev["beam"])
        translation.setdefault("backbone", _scores(ev["backbone"]))
        if "adapters" in ev:
            model = "moa_rs" if name == "rs" else name
            translation[model] = _scores(ev["adapters"]) | {
                "extra_parameters": ev["extra_parameters"]}
    record["translation"] = translation
    keep = ("step", "train_seconds", "train_tokens_per_s", "dev_loss", "dev_bleu", "dev_chrf",
            "router", "num_adapters", "trainable_parameters_local")
    record["adapter_training"] = {
        name: {k: st["adapters"]["done"][k] for k in keep if k in st["adapters"]["done"]}
        for name, st in runs.items() if "adapters" in st}
    record["total_stage_minutes"] = round(sum(
        v["minutes"] or 0.0 for st in runs.values() for v in st.values()), 2)
    record["wall_minutes_this_invocation"] = round((time.time() - t0) / 60, 2)
    write_json(args.out, record)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
