"""Recorded real-data run: OPUS multi-domain de->en (7 domains), CPU-sized Transformer.

    .venv/bin/python benchmarks/real_data.py [--minutes 30] [--data ../shared/data/opus-multidomain]
    .venv/bin/python benchmarks/real_data.py --quick   # checks the script (tiny model, minutes)
    .venv/bin/python benchmarks/real_data.py --test-dir DIR   # + an external test set

Prepares the de-en part (dev/test carved per domain), trains for a fixed wall-clock budget,
then scores the dev and test sets with beam search per domain, and writes
benchmarks/results/real_data_de_en_cpu.json (per-domain BLEU/chrF, training tokens/s, budget,
provenance). A recorded run starts from an empty work directory (`--fresh`); a reused prepared
directory or a resumed training is recorded as such (`reused`). A benchmark, not a test: it
needs ../shared and takes as long as its budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from moe_train.utils.atomic import write_json, write_text  # noqa: E402
from moe_train.utils.provenance import finish, provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    command_line, existing_dir, exit_bad_input, int_at_least, non_negative_float, results_path,
    script_parser)

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "opus-multidomain"
CONFIG = ROOT / "configs" / "opus-de-en-cpu.yaml"
QUICK_DATA = ["data.dev_per_domain=10", "data.test_per_domain=10", "data.vocab_size=1000",
              "data.spm_max_sentences=20000"]
"""--quick: small dev/test splits and vocabulary (prepare)."""
QUICK_MODEL = ["model.d_model=64", "model.n_heads=2", "model.ffn_dim=128",
               "model.encoder_layers=1", "model.decoder_layers=1"]
"""--quick: a tiny model."""
QUICK_TRAIN = QUICK_MODEL + ["train.max_steps=4", "train.validate_every=0", "train.bleu_every=0",
                             "checkpoint.save_every=1000"]
"""--quick: the tiny model trained for a few steps (train)."""


def opus_test_dir(text: str) -> str:
    """The argparse type of --test-dir: a directory with OPUS-layout test files
    (DOMAIN/DOMAIN.l1-l2.test.LANG, as `discover` finds them), so that a wrong one stops the
    script before anything trains or is deleted."""
    from moe_train.data.corpus import discover
    from moe_train.errors import DataError

    existing_dir(text)
    try:
        discover(text, splits=["test"])  # raises when it finds none
    except DataError as exc:
        raise argparse.ArgumentTypeError(f"expected DOMAIN/DOMAIN.l1-l2.test.LANG files under "
                                         f"{text!r} ({exc})") from None
    return text


def check_overrides(runs: Iterable[tuple[str, list[str]]]) -> None:
    """`--set` overrides, checked up front by loading each (config, overrides) a run will use:
    a bad key or value is the config loader's one `error:` line and exit status 2, not a failed
    stage after earlier ones ran."""
    from moe_train.config import load_config
    from moe_train.errors import ConfigError

    for config, overrides in runs:
        try:
            load_config(ROOT / config, overrides)
        except ConfigError as exc:
            exit_bad_input(f"--set: {exc}")


def add_record_arguments(ap: argparse.ArgumentParser, name: str, unit: str) -> None:
    """The options `start_record` reads, shared by the per-recipe scripts (thor.py, gad.py):
    --opus-dir, --test-dir, --work, --out, --set (extra overrides for every `unit`), --fresh,
    --quick."""
    ap.add_argument("--opus-dir", default=str(DEFAULT_DATA), help="the OPUS multi-domain data")
    ap.add_argument("--test-dir", type=opus_test_dir, default=None,
                    help="also score on DIR/{domain}/{domain}.{l1}-{l2}.test.{lang}")
    ap.add_argument("--work", default=None, help=f"default work/{name}-<data>[-quick]")
    ap.add_argument("--out", default=None,
                    help=f"default benchmarks/results/{name}_<data>_cpu[_quick].json")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help=f"an extra config override for every {unit} (repeatable)")
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny corpus / model, a few steps per {unit}: checks the script")


WORK_MARK = ".moe-train-benchmark"
"""The file a benchmark leaves in its work directory: `--fresh` deletes only a directory that
holds it (or an empty one), never one of the user's own named by mistake in `--work`."""


def fresh_work(work: Path, fresh: bool) -> Path:
    """Make `work` this benchmark's work directory; with `fresh`, delete it first.

    Only a directory this function made (or found empty) gets the mark: one with content and
    without it is used as it is, and `fresh` refuses it in one line (exit 2) rather than
    deleting it. A symlink is kept and the directory it leads to emptied. Returns `work`."""
    if work.is_symlink():
        work = Path(os.path.realpath(work))
    if work.exists() and not work.is_dir():
        exit_bad_input(f"--work {work}: is not a directory")
    ours = not work.exists() or (work / WORK_MARK).is_file() or not any(work.iterdir())
    if fresh and work.exists():
        if not ours:
            exit_bad_input(f"--work {work}: --fresh deletes only a benchmark's work directory "
                           f"(one holding {WORK_MARK}) and this one has none: delete it "
                           "yourself or name another")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if ours:
        (work / WORK_MARK).touch()
    return work


def start_record(args: argparse.Namespace, argv: list[str] | None, name: str
                 ) -> tuple[dict, Path, Path, str] | None:
    """The common start of the recorded per-recipe runs (thor.py, gad.py): None (after one
    line) when `--data opus` has no data; a `--test-dir` without test files fails before any
    training; then (provenance, work dir (emptied with --fresh), results path, quick suffix)."""
    suffix = "_quick" if args.quick else ""
    out = results_path(  # where the results go is checked first, data or not
        args.out, ROOT / "benchmarks" / "results" / f"{name}_{args.data}_cpu{suffix}.json")
    if args.data == "opus" and not Path(args.opus_dir).is_dir():
        print(f"skipped: {args.opus_dir} not found (the OPUS multi-domain data lives in "
              "../shared)")
        return None
    prov = provenance(command_line(str(Path(__file__).with_name(f"{name}.py")), argv))
    work = Path(args.work or ROOT / "work" / f"{name}-{args.data}{suffix.replace('_', '-')}")
    work = fresh_work(work, args.fresh)
    return prov, work, out, suffix


def write_record(out: Path, record: dict, prov: dict,
                 show: Callable[[dict], Any] = lambda record: record["acceptance"]) -> None:
    """Complete `record`'s provenance, write it atomically, print `show(record)` (by default
    its acceptance checks) and where it went."""
    record["provenance"] = finish(prov)
    write_json(out, record)
    print(json.dumps(show(record), indent=2))
    print(f"wrote {out}")


def cli(args: list[str], log: Path | None = None) -> str:
    """Run `python -m moe_train ARGS` (the benchmarks' one way to); its output (kept in `log`),
    or exit naming the failure after showing its last lines."""
    proc = subprocess.run([sys.executable, "-m", "moe_train", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        write_text(log, proc.stdout)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"moe-train {args[0]} failed with status {proc.returncode}"
                         + (f" (log: {log})" if log else ""))
    return proc.stdout


def run(args: list[str]) -> str:
    """`cli`, showing the last of the output of a run that succeeded too."""
    text = cli(args)
    sys.stdout.write(text[-6000:])
    return text


def last_json(text: str) -> dict[str, Any]:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--minutes", type=non_negative_float, default=30.0,
                    help="training budget (0: none, the config's step cap)")
    ap.add_argument("--work", default=None, help="default work/opus-de-en[-quick]")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/real_data_de_en_cpu[_quick].json")
    ap.add_argument("--beam", type=int_at_least(1), default=5)
    ap.add_argument("--fresh", action="store_true",
                    help="delete the work directory first (a recorded run starts empty)")
    ap.add_argument("--test-dir", type=opus_test_dir, default=None,
                    help="also score on DIR/{domain}/{domain}.de-en.test.{de,en} (OPUS layout)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, a few steps, small dev/test: checks the script")
    args = ap.parse_args(argv)
    suffix = "_quick" if args.quick else ""
    out = results_path(  # where the results go is checked first, data or not
        args.out, ROOT / "benchmarks" / "results" / f"real_data_de_en_cpu{suffix}.json")
    if not Path(args.data).is_dir():
        print(f"skipped: {args.data} not found (the OPUS multi-domain data lives in ../shared)")
        return
    prov = provenance(command_line(__file__, argv))
    work = Path(args.work or ROOT / "work" / f"opus-de-en{suffix.replace('_', '-')}")
    work = fresh_work(work, args.fresh)
    beam = 1 if args.quick else args.beam
    paths = [f"data.prepared_dir={work / 'prepared'}", f"checkpoint.dir={work / 'checkpoints'}",
             f"logging.tensorboard_dir={work / 'tensorboard'}"]
    t0 = time.time()
    reused_prepared = (work / "prepared" / "manifest.json").is_file()
    if not reused_prepared:
        run(["prepare", "--data", args.data, "--out", str(work / "prepared"), "--config",
             str(CONFIG), *paths[:1], *(QUICK_DATA if args.quick else [])])
    t_prep = time.time() - t0
    resumed = (work / "checkpoints" / "latest").is_file()
    summary = last_json(run(["train", "--config", str(CONFIG), *(["--resume"] if resumed else []),
                             *paths, f"train.max_minutes={args.minutes}",
                             "train.progress_bar=false", *(QUICK_TRAIN if args.quick else [])]))
    t_train = time.time() - t0 - t_prep
    results = {}
    for split in ("dev", "test"):
        text = run(["evaluate", "--checkpoint", str(work / "checkpoints" / "export"), "--split",
                    split, "--beam", str(beam), "--prepared", str(work / "prepared")])
        results[split] = last_json(text)
    manifest = json.loads((work / "prepared" / "manifest.json").read_text())
    record = {
        "benchmark": f"real_data_de_en_cpu{suffix}",
        "config": {"file": str(CONFIG.relative_to(ROOT)), "data": args.data,
                   "train_minutes": args.minutes, "beam": beam, "quick": args.quick,
                   "overrides": (QUICK_DATA + QUICK_TRAIN) if args.quick else []},
        "reused": {"prepared": reused_prepared, "training_resumed": resumed},
        "splits": {k: v["sentences"] for k, v in manifest["splits"].items()},
        "train": {k: summary[k] for k in ("step", "train_seconds", "train_tokens_per_s",
                                          "dev/loss", "dev/ppl") if k in summary},
        "dev_bleu_per_domain": {d: m["bleu"] for d, m in results["dev"]["domains"].items()},
        "dev_chrf_per_domain": {d: m["chrf"] for d, m in results["dev"]["domains"].items()},
        "dev_all": {k: results["dev"]["all"][k] for k in ("bleu", "chrf", "sentences")},
        "test_bleu_per_domain": {d: m["bleu"] for d, m in results["test"]["domains"].items()},
        "test_all": {k: results["test"]["all"][k] for k in ("bleu", "chrf", "sentences")},
        "bleu_signature": results["dev"]["all"]["bleu_signature"],
        "wall_seconds": {"prepare": round(t_prep, 1), "train": round(t_train, 1),
                         "total": round(time.time() - t0, 1)},
    }
    if args.test_dir:
        from thor_eval import score_test_dir

        record["test_dir"] = score_test_dir(work / "checkpoints" / "export", args.test_dir, beam)
        record["config"]["test_dir"] = args.test_dir
    write_record(out, record, prov, show=lambda record: record)


if __name__ == "__main__":
    main()
