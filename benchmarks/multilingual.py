"""Recorded multilingual run (seed 002 Table 1 at CPU scale): OPUS, 7 languages to and from
English (14 directions), dense against the routing variants, each for a fixed budget.

    .venv/bin/python benchmarks/multilingual.py --fresh [--minutes 12] [--variants dense,...]
    .venv/bin/python benchmarks/multilingual.py --test-dir DIR   # + an external test set
    .venv/bin/python benchmarks/multilingual.py --quick --fresh  # checks the script

Variants are configs/opus-m14-<variant>-cpu.yaml: dense, token-token, token-target, token-lp,
target-target, lp-lp (all share one data section, so one preparation serves them). Prepares
../shared/data/opus-multidomain once (dev/test carved per corpus, the same lines for both
directions of a pair), trains each variant in its own `moe-train train` subprocess for
`--minutes` of wall-clock time, scores its export on the test split with `moe-train evaluate`
(per direction and per domain; greedy unless `--beam`), and averages BLEU over en->xx and xx->en
directions. A task-routed variant is also extracted for one direction (`--extract`, default
en-de) and its Table 1 parameter columns recorded. `--test-dir DIR` (OPUS layout with `test`
files) scores every model on DIR's sentences per direction too. Writes
benchmarks/results/multilingual_opus_cpu[_quick].json with provenance; skipped with one line
when the data is absent. A benchmark, not a test.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from real_data import (  # noqa: E402
    DEFAULT_DATA, QUICK_DATA, QUICK_TRAIN, cli, fresh_work, last_json, opus_test_dir,
    write_record)

from moe_train.utils.provenance import provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    comma_list, command_line, int_at_least, positive_float, results_path, script_parser)

VARIANTS = ("dense", "token-token", "token-target", "token-lp", "target-target", "lp-lp")
TASK_ROUTED = ("token-target", "token-lp", "target-target", "lp-lp")
BY_TARGET = ("token-target", "target-target")
"""Task-routed variants whose decoder routes by target language."""
QUICK_PAIRS = ["data.pairs=[de-en,en-de,fr-en,en-fr]", "data.domains=[EMEA,KDE4]"]
"""--quick: 4 directions of 2 domains."""


def config(variant: str) -> Path:
    return ROOT / "configs" / f"opus-m14-{variant}-cpu.yaml"


def averages(pairs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean BLEU / chrF over en->xx, xx->en and all directions."""
    def mean(keys: list[str], metric: str) -> float | None:
        return round(sum(pairs[k][metric] for k in keys) / len(keys), 2) if keys else None

    out_en = [p for p in pairs if p.startswith("en-")]
    into_en = [p for p in pairs if p.endswith("-en")]
    return {f"{name}_{metric}": mean(keys, metric) for name, keys in
            (("en_xx", out_en), ("xx_en", into_en), ("all_directions", list(pairs)))
            for metric in ("bleu", "chrf")}


def beam_args(args) -> list[str]:
    return [] if args.beam is None else ["--beam", str(args.beam)]


def run_variant(args, variant: str, work: Path, prepared: Path, common: list[str]
                ) -> dict[str, Any]:
    vdir = work / variant
    paths = [f"data.prepared_dir={prepared}", f"checkpoint.dir={vdir / 'checkpoints'}",
             f"logging.tensorboard_dir={vdir / 'tensorboard'}"]
    budget = [f"train.max_minutes={args.minutes}", "train.validate_every=0",
              "checkpoint.save_every=100000", "checkpoint.keep_last=1"]
    if args.fresh and vdir.exists():
        shutil.rmtree(vdir)
    t0 = time.time()
    summary = last_json(cli(["train", "--config", str(config(variant)), *paths, *common, *budget],
                            vdir / "train.log"))
    export = vdir / "checkpoints" / "export"
    evaluation = last_json(cli(["evaluate", "--checkpoint", str(export), "--prepared",
                                str(prepared), "--split", "test", "--json",
                                str(vdir / "test.json"), *beam_args(args)], vdir / "test.log"))
    pairs = {p: {k: m[k] for k in ("sentences", "bleu", "chrf")}
             for p, m in evaluation["pairs"].items()}
    record: dict[str, Any] = {
        "config": str(config(variant).relative_to(ROOT)),
        "steps": summary["step"], "train_seconds": round(summary["train_seconds"], 1),
        "train_tokens_per_s": (None if summary["train_tokens_per_s"] is None
                               else round(summary["train_tokens_per_s"], 1)),
        "dev_loss": summary.get("dev/loss"), "dev_ppl": summary.get("dev/ppl"),
        "params": {k: v for k, v in last_json(cli(["params", "--checkpoint", str(export)],
                                                  vdir / "params.log")).items()
                   if k in ("total", "serving_all", "serving_decoder", "active_all")},
        "test": {"sentences": evaluation["all"]["sentences"], "bleu": evaluation["all"]["bleu"],
                 "chrf": evaluation["all"]["chrf"], "pairs": pairs, **averages(pairs),
                 "domains": {d: {k: m[k] for k in ("sentences", "bleu", "chrf")}
                             for d, m in evaluation["domains"].items()},
                 "bleu_signature": evaluation["all"]["bleu_signature"]},
        "wall_seconds": None}
    if variant in TASK_ROUTED and args.extract:
        sub = vdir / f"extracted-{args.extract}"
        report = last_json(cli(["extract", "--checkpoint", str(export), "--task", args.extract,
                                "--out", str(sub)], vdir / "extract.log"))
        record["extraction"] = {k: report[k] for k in ("task", "task_ids", "full", "extracted")}
    if args.test_dir:
        from thor_eval import score_test_dir

        scores = score_test_dir(export, args.test_dir, args.beam)
        record["test_dir"] = scores and {**scores, **averages(scores["pairs"])}
    record["wall_seconds"] = round(time.time() - t0, 1)
    print(f"{variant}: {summary['step']} steps, test BLEU {record['test']['bleu']:.2f} "
          f"(en->xx {record['test']['en_xx_bleu']}, xx->en {record['test']['xx_en_bleu']})",
          flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--minutes", type=positive_float, default=12.0,
                    help="training time per variant")
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)),
                    default="dense,token-token,token-target",
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="the OPUS multi-domain data")
    ap.add_argument("--test-dir", type=opus_test_dir, default=None,
                    help="also score on DIR/{domain}/{domain}.{l1}-{l2}.test.{lang}")
    ap.add_argument("--beam", type=int_at_least(1), default=None,
                    help="default: the config's eval.beam")
    ap.add_argument("--extract", default="en-de",
                    help="direction extracted from task-routed variants ('' to skip)")
    ap.add_argument("--work", default=None, help="default work/multilingual[-quick]")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--quick", action="store_true", help="tiny data / model: checks the script")
    args = ap.parse_args(argv)
    variants = args.variants
    common = [*QUICK_PAIRS, *QUICK_DATA, *QUICK_TRAIN] if args.quick else []
    routed = [v for v in variants if v in TASK_ROUTED]
    if args.extract and routed:
        from moe_train.config import load_config

        tasks = list(load_config(config("dense"), common).data.pairs)  # all extend dense
        if all(v in BY_TARGET for v in routed):  # a target language names the task too
            tasks += sorted({p.split("-")[1] for p in tasks})
        if args.extract not in tasks:
            ap.error(f"--extract: expected one of {', '.join(tasks)} (what "
                     f"{', '.join(routed)} route by), got {args.extract!r}")
    suffix = "_quick" if args.quick else ""
    out = results_path(  # where the results go is checked first, data or not
        args.out, ROOT / "benchmarks" / "results" / f"multilingual_opus_cpu{suffix}.json")
    if not Path(args.data).is_dir():
        print(f"skipped: {args.data} not found (the OPUS multi-domain data lives in ../shared)")
        return
    prov = provenance(command_line(__file__, argv))
    work = Path(args.work or ROOT / "work" / f"multilingual{suffix.replace('_', '-')}")
    work = fresh_work(work, args.fresh)
    prepared = work / "prepared"
    t0 = time.time()
    reused = (prepared / "manifest.json").is_file()
    if not reused:
        cli(["prepare", "--config", str(config("dense")), "--data", args.data, "--out",
             str(prepared), *common], work / "prepare.log")
    manifest = json.loads((prepared / "manifest.json").read_text())
    t_prep = time.time() - t0
    results = {v: run_variant(args, v, work, prepared, common) for v in variants}
    record = {
        "benchmark": "multilingual", "data": str(args.data), "minutes_per_variant": args.minutes,
        "directions": sorted({f"{c['src_lang']}-{c['tgt_lang']}" for c in manifest["corpora"]}),
        "domains": manifest["domains"],
        "splits": {k: v["sentences"] for k, v in manifest["splits"].items()},
        "vocab_size": manifest["vocab_size"], "prepare_seconds": round(t_prep, 1),
        "prepared_reused": reused, "quick_overrides": common, "variants": results,
        "summary": {v: {k: r["test"][k] for k in ("bleu", "en_xx_bleu", "xx_en_bleu")}
                    | {"steps": r["steps"], "train_tokens_per_s": r["train_tokens_per_s"]}
                    for v, r in results.items()}}
    write_record(out, record, prov, show=lambda record: record["summary"])


if __name__ == "__main__":
    main()
