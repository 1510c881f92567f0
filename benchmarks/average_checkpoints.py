"""Checkpoint averaging on OPUS de-en: the last checkpoint against the mean of the last N.

    .venv/bin/python benchmarks/average_checkpoints.py [--steps 1500] [--save-every 100] \
        [--average 2 5]
    .venv/bin/python benchmarks/average_checkpoints.py --quick   # checks the script (tiny model)

Prepares the de-en part of the OPUS multi-domain data as benchmarks/real_data.py does, trains
configs/opus-de-en-cpu.yaml for a fixed number of steps (not minutes: the models, and so the
BLEU figures, do not depend on the machine's speed or load) with a checkpoint every
`--save-every` steps, then `moe-train average --last N` for each N. The last checkpoint's
export and every average are scored on dev and test with beam search per domain, and each
average against the last checkpoint by a paired bootstrap (Koehn 2004) on the test set. Writes
benchmarks/results/average_checkpoints_de_en_cpu[_quick].json. A benchmark, not a test: it
needs ../shared.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from real_data import (CONFIG, DEFAULT_DATA, QUICK_DATA, QUICK_MODEL, fresh_work,  # noqa: E402
                       last_json, run, write_record)

from moe_train.utils.cli_args import (command_line, exit_bad_input, int_at_least,  # noqa: E402
                                      results_path, script_parser)
from moe_train.utils.provenance import provenance  # noqa: E402


def score(model: Path, work: Path, name: str, beam: int) -> dict[str, Any]:
    """Dev and test metrics of `model` (per domain), test hypotheses kept in work/hyps."""
    out: dict[str, Any] = {}
    for split in ("dev", "test"):
        hyps = work / "hyps" / f"{name}.{split}.txt"
        metrics = last_json(run(["evaluate", "--checkpoint", str(model), "--split", split,
                                 "--beam", str(beam), "--prepared", str(work / "prepared"),
                                 "--hyps", str(hyps)]))
        out[split] = {"all": {k: metrics["all"][k] for k in ("bleu", "chrf", "sentences")},
                      "bleu_per_domain": {d: m["bleu"] for d, m in metrics["domains"].items()}}
        out[f"{split}_signature"] = metrics["all"]["bleu_signature"]
    return out


def references(prepared: Path, split: str) -> list[str]:
    """The split's raw references in the order `evaluate --hyps` writes hypotheses."""
    from moe_train.data.shards import nonempty_split

    dataset = nonempty_split(prepared, split)
    return [dataset.raw_tgt(i) for i in range(len(dataset))]


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--steps", type=int_at_least(1), default=1500,
                    help="training steps (default 1500: what real_data.py's 30 minutes reached)")
    ap.add_argument("--save-every", type=int_at_least(1), default=100)
    ap.add_argument("--average", type=int_at_least(2), nargs="+", default=[2, 5],
                    help="average the last N checkpoints, for each N given")
    ap.add_argument("--beam", type=int_at_least(1), default=5)
    ap.add_argument("--work", default=None, help="default work/average-de-en[-quick]")
    ap.add_argument("--out", default=None, help="default benchmarks/results/"
                    "average_checkpoints_de_en_cpu[_quick].json")
    ap.add_argument("--fresh", action="store_true",
                    help="delete the work directory first (a recorded run starts empty)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, a few steps, small dev/test: checks the script")
    args = ap.parse_args(argv)
    steps, save_every, beam = (6, 2, 1) if args.quick else (args.steps, args.save_every, args.beam)
    averages = [2] if args.quick else sorted(set(args.average))
    if steps // save_every < max(averages):
        exit_bad_input(f"--average {max(averages)}: --steps {steps} with --save-every "
                       f"{save_every} leaves only {steps // save_every} checkpoints")
    suffix = "_quick" if args.quick else ""
    out = results_path(args.out, ROOT / "benchmarks" / "results" /
                       f"average_checkpoints_de_en_cpu{suffix}.json")
    if not Path(args.data).is_dir():
        print(f"skipped: {args.data} not found (the OPUS multi-domain data lives in ../shared)")
        return
    prov = provenance(command_line(__file__, argv))
    work = fresh_work(Path(args.work or ROOT / "work" / f"average-de-en{suffix.replace('_', '-')}"),
                      args.fresh)
    paths = [f"data.prepared_dir={work / 'prepared'}", f"checkpoint.dir={work / 'checkpoints'}",
             f"logging.tensorboard_dir={work / 'tensorboard'}"]
    train_overrides = [f"train.max_steps={steps}", "train.max_minutes=0",
                       f"checkpoint.save_every={save_every}",
                       f"checkpoint.keep_last={max(averages)}", f"train.validate_every={steps}",
                       "train.progress_bar=false", *(QUICK_MODEL if args.quick else [])]
    t0 = time.time()
    if (work / "prepared" / "manifest.json").is_file() or (work / "checkpoints").exists():
        exit_bad_input(f"--work {work}: holds an earlier run; use --fresh")
    run(["prepare", "--data", args.data, "--out", str(work / "prepared"), "--config",
         str(CONFIG), *paths[:1], *(QUICK_DATA if args.quick else [])])
    t_prep = time.time() - t0
    summary = last_json(run(["train", "--config", str(CONFIG), *paths, *train_overrides]))
    t_train = time.time() - t0 - t_prep
    models = {"last": (work / "checkpoints" / "export", None)}
    for n in averages:
        avg = work / f"avg{n}"
        report = last_json(run(["average", str(work / "checkpoints"), "--last", str(n),
                                "--out", str(avg)]))
        models[f"avg{n}"] = (avg, [i["step"] for i in report["inputs"]])
    results = {name: {"steps_averaged": steps_in, **score(path, work, name, beam)}
               for name, (path, steps_in) in models.items()}
    from moe_train.eval.significance import paired_bootstrap

    refs = references(work / "prepared", "test")
    last_hyps = (work / "hyps" / "last.test.txt").read_text(encoding="utf-8").splitlines()
    bootstrap = {}
    for name in models:
        if name != "last":
            hyps = (work / "hyps" / f"{name}.test.txt").read_text(encoding="utf-8").splitlines()
            bootstrap[f"{name}_vs_last"] = paired_bootstrap(hyps, last_hyps, refs)
    record = {
        "benchmark": f"average_checkpoints_de_en_cpu{suffix}",
        "config": {"file": str(CONFIG.relative_to(ROOT)), "data": args.data, "steps": steps,
                   "save_every": save_every, "average": averages, "beam": beam,
                   "quick": args.quick, "train_overrides": train_overrides},
        "train": {k: summary[k] for k in ("step", "train_seconds", "train_tokens_per_s",
                                          "dev/loss", "dev/ppl") if k in summary},
        "models": results,
        "paired_bootstrap_test": bootstrap,
        "wall_seconds": {"prepare": round(t_prep, 1), "train": round(t_train, 1),
                         "total": round(time.time() - t0, 1)},
    }
    write_record(out, record, prov, show=lambda r: {
        "test_bleu": {k: v["test"]["all"]["bleu"] for k, v in r["models"].items()},
        "dev_bleu": {k: v["dev"]["all"]["bleu"] for k, v in r["models"].items()},
        "bootstrap_bleu": {k: v["bleu"] for k, v in r["paired_bootstrap_test"].items()}})


if __name__ == "__main__":
    main()
