"""Recorded real-data run: OPUS multi-domain de->en (7 domains), CPU-sized Transformer.

    .venv/bin/python benchmarks/real_data.py [--minutes 30] [--data ../shared/data/opus-multidomain]

Prepares the de-en part (dev/test carved per domain), trains for a fixed wall-clock budget,
then scores the dev and test sets with beam search per domain, and writes
benchmarks/results/real_data_de_en_cpu.json (per-domain BLEU/chrF, training tokens/s, budget).
A benchmark, not a test: it needs ../shared and takes as long as its budget.
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "opus-multidomain"


def run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "moe_train", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sys.stdout.write(proc.stdout[-6000:])
    if proc.returncode != 0:
        raise SystemExit(f"moe-train {args[0]} failed with status {proc.returncode}")
    return proc.stdout


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--work", default=str(ROOT / "work" / "opus-de-en"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "real_data_de_en_cpu.json"))
    ap.add_argument("--beam", type=int, default=5)
    args = ap.parse_args()
    if not Path(args.data).is_dir():
        print(f"skipped: {args.data} not found (the OPUS multi-domain data lives in ../shared)")
        return
    config = ROOT / "configs" / "opus-de-en-cpu.yaml"
    work = Path(args.work)
    paths = [f"data.prepared_dir={work / 'prepared'}", f"checkpoint.dir={work / 'checkpoints'}",
             f"logging.tensorboard_dir={work / 'tensorboard'}"]
    t0 = time.time()
    if not (work / "prepared" / "manifest.json").is_file():
        run(["prepare", "--data", args.data, "--out", str(work / "prepared"), "--config",
             str(config), *paths[:1]])
    t_prep = time.time() - t0
    resume = ["--resume"] if (work / "checkpoints" / "latest").is_file() else []
    summary = last_json(run(["train", "--config", str(config), *resume, *paths,
                             f"train.max_minutes={args.minutes}", "train.progress_bar=false"]))
    t_train = time.time() - t0 - t_prep
    results = {}
    for split in ("dev", "test"):
        out = run(["evaluate", "--checkpoint", str(work / "checkpoints" / "export"), "--split",
                   split, "--beam", str(args.beam), "--prepared", str(work / "prepared")])
        results[split] = last_json(out)
    manifest = json.loads((work / "prepared" / "manifest.json").read_text())
    record = {
        "benchmark": "real_data_de_en_cpu",
        "data": "OPUS multi-domain de->en, 7 domains, 5000 pairs each; dev/test carved per domain",
        "splits": {k: v["sentences"] for k, v in manifest["splits"].items()},
        "config": str(config.relative_to(ROOT)),
        "cpu_budget": {"train_minutes": args.minutes, "cores": os.cpu_count(),
                       "machine": platform.processor() or platform.machine(),
                       "torch_threads": "all cores, one process"},
        "train": {k: summary[k] for k in ("step", "train_seconds", "train_tokens_per_s",
                                          "dev/loss", "dev/ppl")},
        "beam": args.beam,
        "dev_bleu_per_domain": {d: m["bleu"] for d, m in results["dev"]["domains"].items()},
        "dev_chrf_per_domain": {d: m["chrf"] for d, m in results["dev"]["domains"].items()},
        "dev_all": {k: results["dev"]["all"][k] for k in ("bleu", "chrf", "sentences")},
        "test_bleu_per_domain": {d: m["bleu"] for d, m in results["test"]["domains"].items()},
        "test_all": {k: results["test"]["all"][k] for k in ("bleu", "chrf", "sentences")},
        "bleu_signature": results["dev"]["all"]["bleu_signature"],
        "wall_seconds": {"prepare": round(t_prep, 1), "train": round(t_train, 1),
                         "total": round(time.time() - t0, 1)},
    }
    from moe_train.utils.atomic import write_json

    write_json(args.out, record)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
