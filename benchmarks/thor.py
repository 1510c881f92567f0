"""Recorded THOR-MoE runs (seed 003): baselines and THOR variants, each trained for a fixed budget.

    .venv/bin/python benchmarks/thor.py --data synthetic --fresh [--steps 1000 --minutes 10]
    .venv/bin/python benchmarks/thor.py --data opus --fresh [--minutes 8]
    .venv/bin/python benchmarks/thor.py --data synthetic --quick --fresh   # checks the script
    .venv/bin/python benchmarks/thor.py --data opus --test-dir DIR        # + an external test set

Variants (`VARIANTS`, overrides of the data's THOR config, whose own setting is THOR top-p):
dense, top2, topp (p = 0.5), thor_top2, thor_topp, thor_topp_no_context,
thor_topp_no_hierarchy (003 Tables 2 and 4). Data:
- synthetic: the embedded multi-domain corpus (moe_train/data/synthetic.py: 5 domains, en->de,
  3000 / 100 / 100 pairs per domain), configs/thor-synthetic-cpu.yaml; scored on its held-out
  test split;
- opus: ../shared/data/opus-multidomain de-en (7 domains), configs/thor-opus-de-en-cpu.yaml,
  dev / test carved from the training files (200 pairs per domain each) as
  benchmarks/real_data.py does; skipped with one line when the data is absent.
Each variant trains in its own `python -m moe_train train` subprocess for `--steps` steps with
`--minutes` as a guard (synthetic), or for `--minutes` of wall-clock time (OPUS; `--steps 0`),
then this process scores its export on the test split
(benchmarks/thor_eval.py): BLEU / chrF per domain (beam search), experts per token per MoE
layer and their mean (teacher-forced, forward hooks on the routers), task-prediction accuracy;
`--test-dir DIR` (OPUS layout with `test` files) scores the same models on DIR too. A TF-IDF +
logistic-regression domain classifier trained on the same training sources is scored beside the
task predictor. Writes benchmarks/results/thor_<data>_cpu[_quick].json with provenance. A
variant whose training finished in an earlier invocation is reused (and marked so) unless
`--fresh`; a recorded run starts fresh. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
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

from real_data import QUICK_DATA, QUICK_MODEL, add_record_arguments, check_overrides, cli, \
    last_json, start_record, write_record  # noqa: E402

from moe_train.utils.atomic import write_json  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    comma_list, exit_bad_input, int_at_least, positive_float, script_parser)

VARIANTS: dict[str, tuple[str, ...]] = {
    "dense": ("moe.num_experts=0",),
    "top2": ("moe.encoder_router=topk", "moe.decoder_router=topk", "moe.k=2"),
    "topp": ("moe.encoder_router=topp", "moe.decoder_router=topp"),
    "thor_top2": ("thor.token_routing=topk", "moe.k=2"),
    "thor_topp": (),
    "thor_topp_no_context": ("thor.context=false",),
    "thor_topp_no_hierarchy": ("thor.hierarchy=false",),
}
"""Variant -> overrides of the data's config (THOR top-p, p = moe.top_p = 0.5, |S^t| of
thor.num_candidates). topp and the THOR top-p variants share moe.top_p; the baselines keep the
config's Switch balance, z and entropy (= delta) losses."""
ABLATION_FILES = {"thor_top2": "top2", "thor_topp_no_context": "no-context",
                  "thor_topp_no_hierarchy": "no-hierarchy"}
"""THOR variants also shipped as configs: <config stem>-<suffix>.yaml."""
DATASETS = {
    "synthetic": {"config": "configs/thor-synthetic-cpu.yaml", "minutes": 10.0, "steps": 1000},
    "opus": {"config": "configs/thor-opus-de-en-cpu.yaml", "minutes": 8.0, "steps": None},
}
"""Default budgets. Synthetic: 1000 steps (the models are near their plateau there), 10 minutes
as a guard, so the comparison does not move with the machine's load; OPUS: 8 minutes of
training per variant (a few hundred steps on two cores)."""
SYNTHETIC = {"num_domains": 5, "target_langs": ["de"], "train_per_domain": 3000,
             "dev_per_domain": 100, "test_per_domain": 100, "seed": 1}
"""The synthetic corpus (moe_train.data.synthetic.generate_synthetic arguments)."""
QUICK_SYNTHETIC = SYNTHETIC | {"train_per_domain": 200, "dev_per_domain": 10,
                               "test_per_domain": 10}
QUICK_PREPARE = {"synthetic": ["data.vocab_size=300"], "opus": QUICK_DATA}
BENCH_TRAIN = ["train.validate_every=0", "train.bleu_every=0", "train.bleu_sentences=50",
               "train.progress_bar=false", "checkpoint.save_every=100000",
               "checkpoint.keep_last=1"]
"""Every variant: no periodic validation (the budget is for training; one dev pass at the
end gives dev loss and task accuracy), one final checkpoint."""
QUICK_STEPS = 4
"""--quick: steps per variant unless --steps says otherwise."""
QUICK_TRAIN = [*QUICK_MODEL, f"train.max_steps={QUICK_STEPS}"]
"""--quick: a tiny model trained for a few steps."""
SUMMARY = "train_summary.json"
"""Written into a variant's directory when its training finished (its reuse marker)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--data", choices=sorted(DATASETS), default="synthetic")
    ap.add_argument("--minutes", type=positive_float, default=None,
                    help="training time per variant (default: synthetic 10 as a guard, opus 8)")
    ap.add_argument("--steps", type=int_at_least(0), default=None,
                    help="a step budget per variant (train.max_steps; default: synthetic 1000, "
                         "opus 0 = none); --minutes is then a guard that the record flags when "
                         "it cut a variant short")
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)),
                    default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--beam", type=int_at_least(1), default=None,
                    help="default: the config's eval.beam")
    add_record_arguments(ap, "thor", "variant")
    args = ap.parse_args(argv)
    if args.minutes is None:
        args.minutes = DATASETS[args.data]["minutes"]
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DATASETS[args.data]["steps"]
    args.steps = args.steps or None  # 0: the time budget alone
    check_overrides((DATASETS[args.data]["config"],
                     variant_overrides(args, v, Path("prepared"), Path(v)))
                    for v in args.variants)
    return args


def prepare_data(args: argparse.Namespace, config: str, prepared: Path) -> dict[str, Any]:
    """Generate (synthetic) and prepare the data unless done; what was used and reused."""
    info: dict[str, Any] = {"reused": (prepared / "manifest.json").is_file()}
    if args.data == "synthetic":
        from moe_train.data.synthetic import generate_synthetic

        corpus = prepared.parent / "corpus"
        info["synthetic"] = QUICK_SYNTHETIC if args.quick else SYNTHETIC
        info["source"] = str(corpus)
        if not info["reused"] and not (corpus / "domains.json").is_file():
            generate_synthetic(corpus, **info["synthetic"])
    else:
        info["source"] = args.opus_dir
    if not info["reused"]:
        cli(["prepare", "--data", info["source"], "--out", str(prepared), "--config", config,
             *(QUICK_PREPARE[args.data] if args.quick else [])])
    return info


def variant_overrides(args: argparse.Namespace, name: str, prepared: Path, vdir: Path
                      ) -> list[str]:
    """The overrides variant `name` trains with (in `vdir`, on the data in `prepared`);
    parse_args loads them up front, so a bad `--set` stops the run before anything trains."""
    return [*VARIANTS[name], f"data.prepared_dir={prepared}",
            f"checkpoint.dir={vdir / 'checkpoints'}",
            f"logging.tensorboard_dir={vdir / 'tensorboard'}",
            f"train.max_minutes={args.minutes}", *BENCH_TRAIN, *args.extra,
            *(QUICK_TRAIN if args.quick else []),
            *([f"train.max_steps={args.steps}"] if args.steps else [])]


def train_variant(args: argparse.Namespace, config: str, prepared: Path, vdir: Path,
                  name: str) -> dict[str, Any]:
    """Train one variant for the budget, or reuse its training when an earlier invocation
    finished it with the same overrides (budget included)."""
    overrides = variant_overrides(args, name, prepared, vdir)
    done = vdir / SUMMARY
    if done.is_file():
        record = json.loads(done.read_text())
        if record.get("overrides") == overrides:
            print(f"== {name}: training reused (finished earlier)", flush=True)
            return record | {"reused": True}
    if vdir.exists():  # unfinished, or trained with other settings: start again
        shutil.rmtree(vdir)
    budget = f"{args.steps} steps (guard {args.minutes} min)" if args.steps \
        else f"{args.minutes} min"
    print(f"== {name}: training for {budget}", flush=True)
    t0 = time.time()
    summary = last_json(cli(["train", "--config", config, *overrides], vdir / "train.log"))
    keep = ("step", "train_seconds", "train_tokens_per_s", "dev/loss", "dev/ppl",
            "dev/task_accuracy", "dev/bleu", "dev/chrf")
    record = {"overrides": overrides, "minutes": args.minutes, "steps": args.steps,
              "cut_by_time_guard": bool(args.steps) and summary["step"] < args.steps,
              "summary": {k: summary[k] for k in keep if k in summary},
              "wall_seconds": round(time.time() - t0, 1), "export": summary["export"]}
    write_json(done, record)
    return record | {"reused": False}


def parameters(inf: Any) -> dict[str, Any]:
    """Total and per-token parameters of the trained model (`moe-train params` counts)."""
    from moe_train.eval.params import count_model

    report = count_model(inf.model)
    keys = ("total", "active_all", "encoder_experts_per_token", "decoder_experts_per_token",
            "encoder_experts_per_token_exact", "decoder_experts_per_token_exact",
            "encoder_routing", "decoder_routing")
    return {k: report[k] for k in keys if k in report}


def evaluate_variant(args: argparse.Namespace, export: Path, prepared: Path, beam: int,
                     tests: dict[str, Any]) -> dict[str, Any]:
    """Score one trained variant on the test split (and `--test-dir`)."""
    from thor_eval import RawSplit, score_split

    from moe_train.data.shards import ShardedDataset
    from moe_train.train.export import load_for_inference

    t0 = time.time()
    inf = load_for_inference(export)
    max_tokens = inf.cfg.data.max_tokens
    out = {"parameters": parameters(inf),
           "test": score_split(inf, ShardedDataset(prepared, "test"), beam, max_tokens)}
    if args.test_dir:
        raw = RawSplit(args.test_dir, inf)
        tests.setdefault("test_dir", raw)
        out["test_dir"] = score_split(inf, raw, beam, max_tokens) if len(raw) else None
        out["test_dir_skipped"] = raw.skipped
    tests.setdefault("vocab", inf.vocab)
    out["eval_seconds"] = round(time.time() - t0, 1)
    return out


def acceptance(variants: dict[str, Any]) -> dict[str, Any]:
    """The issue's synthetic-corpus criteria, from this run's measurements (None when a
    variant they compare was not run)."""
    thor, topp = variants.get("thor_topp"), variants.get("topp")
    out: dict[str, Any] = {"task_accuracy": {
        name: v["test"]["task_accuracy"]["all"] for name, v in variants.items()
        if v["test"].get("task_accuracy")}}
    out["variants_cut_by_time_guard"] = sorted(
        n for n, v in variants.items() if v["training"].get("cut_by_time_guard"))
    acc = out["task_accuracy"].get("thor_topp")
    out["thor_topp_task_accuracy_ge_0.95"] = None if acc is None else acc >= 0.95
    if thor is None or topp is None:
        return out | {"thor_topp_fewer_experts_than_topp": None,
                      "thor_topp_bleu_at_least_topp_minus_0.5": None}
    ept = {n: v["test"]["experts_per_token"]["mean"] for n, v in (("thor_topp", thor),
                                                                  ("topp", topp))}
    bleu = {n: v["test"]["bleu"]["all"] for n, v in (("thor_topp", thor), ("topp", topp))}
    return out | {"experts_per_token_mean": ept, "bleu_all": bleu,
                  "thor_topp_fewer_experts_than_topp": ept["thor_topp"] < ept["topp"],
                  "thor_topp_bleu_at_least_topp_minus_0.5":
                      bleu["thor_topp"] >= bleu["topp"] - 0.5}


def main(argv: list[str] | None = None) -> None:
    from moe_train.errors import MoeTrainError

    try:
        run(parse_args(argv), argv)
    except MoeTrainError as exc:  # bad data or test directory: one line, as the CLI does
        exit_bad_input(str(exc))


def run(args: argparse.Namespace, argv: list[str] | None) -> None:
    """The whole benchmark (see the module docstring)."""
    started = start_record(args, argv, "thor")
    if started is None:
        return
    prov, work, out, suffix = started
    config = DATASETS[args.data]["config"]
    t0 = time.time()
    prepared = work / "prepared"
    data_info = prepare_data(args, config, prepared)
    manifest = json.loads((prepared / "manifest.json").read_text())
    from moe_train.config import load_config

    beam = args.beam or load_config(ROOT / config).eval.beam
    variants: dict[str, Any] = {}
    tests: dict[str, Any] = {}
    for name in args.variants:
        trained = train_variant(args, config, prepared, work / name, name)
        print(f"== {name}: scoring the test split (beam {beam})", flush=True)
        variants[name] = {"training": {k: trained[k] for k in (
                              "minutes", "steps", "cut_by_time_guard", "summary",
                              "wall_seconds", "reused", "overrides")},
                          **evaluate_variant(args, Path(trained["export"]), prepared, beam,
                                             tests)}
        test = variants[name]["test"]
        print(f"   BLEU {test['bleu']['all']} | experts/token "
              f"{(test['experts_per_token'] or {}).get('mean')} | task accuracy "
              f"{(test['task_accuracy'] or {}).get('all')}", flush=True)
    from moe_train.data.shards import ShardedDataset
    from thor_eval import tfidf_domain_classifier

    print("== TF-IDF + logistic regression domain classifier", flush=True)
    splits = {"test": ShardedDataset(prepared, "test")}
    if "test_dir" in tests:
        splits["test_dir"] = tests["test_dir"]
    classifier = tfidf_domain_classifier(prepared, tests["vocab"], splits)
    record: dict[str, Any] = {
        "benchmark": f"thor_{args.data}_cpu{suffix}",
        "config": {"file": config, "data": args.data, "source": data_info["source"],
                   "synthetic": data_info.get("synthetic"), "minutes_per_variant": args.minutes,
                   "steps_per_variant": args.steps,
                   "beam": beam, "quick": args.quick, "test_dir": args.test_dir,
                   "variants": {n: list(VARIANTS[n]) for n in args.variants},
                   "bench_train_overrides": BENCH_TRAIN,
                   "extra_overrides": args.extra,
                   "quick_overrides": (QUICK_PREPARE[args.data] + QUICK_TRAIN) if args.quick
                   else []},
        "measured": {"experts_per_token": "teacher-forced pass over the split, forward hooks "
                     "on every MoE layer's router: routed slots (ids >= 0) / real tokens per "
                     "layer; mean = average over the MoE layers (003 Table 7)",
                     "task_accuracy": "argmax of the task predictor (task predicted from the "
                     "source alone, eval mode) vs the gold task, same pass",
                     "bleu_chrf": "beam search, sacreBLEU (moe_train.eval.evaluate)"},
        "reused": {"prepared": data_info["reused"]},
        "domains": manifest["domains"],
        "splits": {k: v["sentences"] for k, v in manifest["splits"].items()},
        "variants": variants,
        "task_classifier_tfidf_logreg": classifier,
        "acceptance": acceptance(variants),
        "wall_seconds": round(time.time() - t0, 1),
    }
    write_record(out, record, prov)


if __name__ == "__main__":
    main()
