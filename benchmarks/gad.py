"""Recorded Gated Adapters runs (seed 004): `moe-train pipeline gad` with its baselines.

    .venv/bin/python benchmarks/gad.py --data synthetic --fresh [--steps N]
    .venv/bin/python benchmarks/gad.py --data opus --fresh [--minutes 6] [--test-dir DIR]
    .venv/bin/python benchmarks/gad.py --data synthetic --quick --fresh   # checks the script

Data:
- synthetic: the embedded multi-domain corpus (4 domains, en->de, 3000 / 100 / 100 pairs per
  domain), configs/gad-synthetic.yaml; every training stage runs to its dev-BLEU plateau and
  exports its best validation (patience 4 validations of 250 steps, as 004's code stops and
  keeps checkpoint_best), counted in steps, so the comparison does not move with the
  machine's load (`--steps N` caps MIX at N steps and TAG / AD / GAD at a third of it);
- opus: ../shared/data/opus-multidomain de-en (7 domains), configs/gad-opus-de-en-cpu.yaml,
  dev / test carved from the training files (200 pairs per domain each); `--minutes` of
  training for MIX and half of it for each of TAG, AD and GAD; skipped with one line when the
  data is absent.
Both are prepared twice, without and with data.domain_tags (TAG), sharing one sentencepiece
model. The pipeline runs stage by stage (`python -m moe_train pipeline gad --stage S`), then
the CE-on-labels ablation (004 Table 9) trains GAD again with gated.gate_loss=ce from the same
start (MIX; AD under gated.gad_init=ad) and scores both GADs on the dev split, as 004 does
(`--no-ablation` skips it). Every other table comes from the evaluate stage of this run
(quality per domain, AVG / wAVG, misclassified subset, gate agreement, efficiency with all
systems timed in one process); `--test-dir DIR` (OPUS layout with test files) scores the same
models on DIR too. Writes benchmarks/results/gad_<data>_cpu[_quick].json with provenance and the issue's
acceptance checks computed from those measurements. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
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
from moe_train.utils.cli_args import (  # noqa: E402
    int_at_least, positive_float, script_parser)


DATASETS = {
    "synthetic": {"config": "configs/gad-synthetic.yaml", "steps": None, "minutes": 15.0},
    "opus": {"config": "configs/gad-opus-de-en-cpu.yaml", "steps": None, "minutes": 6.0},
}
"""Synthetic: every stage trains to its dev-BLEU plateau (the config's early stopping, its step
counts as caps; `--steps N` caps MIX at N and TAG / AD / GAD at a third of it), `minutes` a
guard per stage; OPUS: MIX trains `minutes`, TAG / AD / GAD half of it each."""
SYNTHETIC = {"num_domains": 4, "target_langs": ["de"], "train_per_domain": 3000,
             "dev_per_domain": 100, "test_per_domain": 100, "seed": 2}
QUICK_SYNTHETIC = SYNTHETIC | {"train_per_domain": 200, "dev_per_domain": 10,
                               "test_per_domain": 10}
QUICK_PREPARE = {"synthetic": ["data.vocab_size=300"], "opus": QUICK_DATA}
QUICK = ["moa.eval_sentences=4", "gated.efficiency_repeats=1", "gated.classifier_steps=20"]
TRAINING_STAGES = ("backbone", "tag", "ad", "gad")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--data", choices=sorted(DATASETS), default="synthetic")
    ap.add_argument("--steps", type=int_at_least(1), default=None,
                    help="synthetic: cap MIX's steps at N and TAG/AD/GAD's at a third of it "
                         "(default: the config's caps; every stage stops at its dev-BLEU "
                         "plateau)")
    ap.add_argument("--minutes", type=positive_float, default=None,
                    help="opus: MIX training minutes (default 6; TAG/AD/GAD half each); "
                         "synthetic: a guard per stage (default 15)")
    ap.add_argument("--no-ablation", action="store_true", help="skip the gate_loss=ce run")
    add_record_arguments(ap, "gad", "stage")
    args = ap.parse_args(argv)
    spec = DATASETS[args.data]
    args.minutes = spec["minutes"] if args.minutes is None else args.minutes
    args.steps = spec["steps"] if args.steps is None else args.steps
    if args.quick:
        args.steps = 12
    check_overrides((spec["config"], [*base_overrides(args, Path("work")), *stage])
                    for stage in [[], *budgets(args).values()])
    return args


def base_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """The overrides of every stage run in `work` (budgets() adds each training stage's);
    parse_args loads them up front, so a bad `--set` stops the run before anything trains."""
    return [f"data.prepared_dir={work / 'prepared'}",
            f"gated.tag_prepared_dir={work / 'prepared-tag'}", f"moa.workdir={work / 'run'}",
            *(QUICK_MODEL + QUICK if args.quick else []), *args.extra]


def budgets(args: argparse.Namespace) -> dict[str, list[str]]:
    """Per training stage: its overrides (step caps, or minutes with an unreachable step
    count; synthetic without --steps: the config's caps and early stopping, a time guard)."""
    if args.data == "synthetic" and not args.steps:
        guard = [f"train.max_minutes={args.minutes}"]
        return {s: guard for s in TRAINING_STAGES}
    if args.steps:
        part = max(1, args.steps // 3)
        steps = {"backbone": args.steps, "tag": part, "ad": part, "gad": part}
        guard = [f"train.max_minutes={args.minutes}"]
        return {"backbone": [f"train.max_steps={steps['backbone']}", *guard],
                **{s: [f"gated.{s}_steps={steps[s]}", *guard] for s in ("tag", "ad", "gad")}}
    half = args.minutes / 2
    return {"backbone": ["train.max_steps=1000000", f"train.max_minutes={args.minutes}"],
            **{s: [f"gated.{s}_steps=1000000", f"train.max_minutes={half}"]
               for s in ("tag", "ad", "gad")}}


def prepare(args: argparse.Namespace, config: str, work: Path) -> dict[str, Any]:
    """The corpus prepared without and with domain tags (reused when present)."""
    info: dict[str, Any] = {"reused": (work / "prepared-tag" / "manifest.json").is_file()}
    if args.data == "synthetic":
        from moe_train.data.synthetic import generate_synthetic

        info["synthetic"] = QUICK_SYNTHETIC if args.quick else SYNTHETIC
        info["source"] = str(work / "corpus")
        if not (work / "corpus" / "domains.json").is_file():
            generate_synthetic(work / "corpus", **info["synthetic"])
    else:
        info["source"] = args.opus_dir
    quick = QUICK_PREPARE[args.data] if args.quick else []
    for name, tags in (("prepared", []), ("prepared-tag", ["data.domain_tags=true"])):
        if not (work / name / "manifest.json").is_file():
            cli(["prepare", "--data", info["source"], "--out", str(work / name), "--config",
                 config, "--overwrite", *quick, *tags])
    return info


def acceptance(ev: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    """The issue's criteria, from this run's measurements."""
    q = {n: s["avg"]["bleu"] for n, s in ev["systems"].items()}
    mis = {n: s.get("misclassified", {}).get("bleu") for n, s in ev["systems"].items()}
    ratios = ev["efficiency"]["sentences_per_s_ratios"]
    return {
        "avg_bleu": q, "misclassified_bleu": mis,
        "misclassified_sentences": ev["classifier"]["misclassified"],
        "gad_bleu_ge_mix": q["GAD"] >= q["MIX"],
        "gad_bleu_ge_ad_clf_minus_0.3": q["GAD"] >= q["AD_CLF"] - 0.3,
        "gad_above_ad_clf_on_misclassified": None if mis["GAD"] is None
        else mis["GAD"] > mis["AD_CLF"],
        "gad_speed_ge_1.1x_ad_clf": ratios["GAD/AD_CLF"] >= 1.1,
        "gad_speed_ge_0.6x_ad_oracle": ratios["GAD/AD_ORACLE"] >= 0.6,
        "frozen_parameters_bitwise_unchanged": all(stages[s]["frozen_unchanged"]
                                                   for s in ("ad", "gad")),
    }


def in_process(config: str, overrides: list[str], fn: Any) -> Any:
    """`fn(ctx)` with the recipe's StageContext in this process (one rank)."""
    from moe_train.config import load_config
    from moe_train.parallel.runtime import init_runtime, shutdown
    from moe_train.stages.common import StageContext

    rt = init_runtime()
    try:
        return fn(StageContext(load_config(ROOT / config, overrides), rt))
    finally:
        shutdown(rt)


def test_dir_tables(test_dir: str) -> Any:
    """The evaluate stage's tables on `--test-dir` (raw files, encoded per model)."""
    from thor_eval import RawSplit

    from moe_train.stages.classifier import load_classifier
    from moe_train.stages.gad_eval import evaluate_split, load_systems

    def tables(ctx: Any) -> dict[str, Any]:
        models = load_systems(ctx)
        test = RawSplit(test_dir, models["backbone"])
        tagged = RawSplit(test_dir, models["tag"]) if "tag" in models else None
        clf = load_classifier(ctx, "evaluate", backbone_model=models["backbone"].model)
        probs = clf.predict_proba(test, list(range(len(test))))
        return evaluate_split(ctx, models, test, tagged, probs, clf) | {"skipped": test.skipped}

    return tables


def ablation_tables(kd_run: Path) -> Any:
    """GAD trained with gate_loss=ce against the KD GAD of `kd_run`, both on the dev split
    (004 Table 9 is on validation) as the evaluate stage scores GAD."""
    def tables(ctx: Any) -> dict[str, Any]:
        from moe_train.stages.gad import export_dir
        from moe_train.stages.gad_eval import gad_tables
        from moe_train.train.export import load_for_inference

        kd = load_for_inference(kd_run / "gad" / "checkpoints" / "export", ctx.rt.device)
        ce = load_for_inference(export_dir(ctx, "gad"), ctx.rt.device)
        out = {"kd": gad_tables(ctx, kd, "dev"), "ce": gad_tables(ctx, ce, "dev")}
        out["kd_minus_ce_avg_bleu"] = round(out["kd"]["quality"]["avg"]["bleu"]
                                            - out["ce"]["quality"]["avg"]["bleu"], 2)
        return out

    return tables


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_record(args, argv, "gad")
    if started is None:
        return
    prov, work, out, suffix = started
    config = DATASETS[args.data]["config"]
    t0 = time.time()
    data = prepare(args, config, work)
    base = base_overrides(args, work)
    per_stage = budgets(args)
    stages: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for stage in ("backbone", "tag", "classifier", "ad", "gad", "evaluate"):
        print(f"== {stage}", flush=True)
        t = time.time()
        log = cli(["pipeline", "gad", "--config", config, "--stage", stage, *base,
                   *per_stage.get(stage, [])], work / "logs" / f"{stage}.log")
        stages[stage] = last_json(log)[stage]
        seconds[stage] = round(time.time() - t, 1)
    ev = stages["evaluate"]
    ablation = None
    if not args.no_ablation:
        print("== gad with gate_loss=ce (004 Table 9)", flush=True)
        ce_work = work / "run-ce"
        ce_work.mkdir(parents=True, exist_ok=True)
        for stage in ("backbone", "classifier", "ad"):  # the same inputs, not trained again
            link = ce_work / stage
            if not link.exists():
                link.symlink_to(work / "run" / stage, target_is_directory=True)
        ce = [*base, f"moa.workdir={ce_work}", "gated.gate_loss=ce"]
        t = time.time()
        cli(["pipeline", "gad", "--config", config, "--stage", "gad", *ce, *per_stage["gad"]],
            work / "logs" / "ce-gad.log")
        ablation = in_process(config, ce, ablation_tables(work / "run"))
        seconds["ablation_ce"] = round(time.time() - t, 1)
    record: dict[str, Any] = {
        "benchmark": f"gad_{args.data}_cpu{suffix}",
        "config": {"file": config, "data": args.data, "source": data["source"],
                   "synthetic": data.get("synthetic"), "steps": args.steps,
                   "minutes": args.minutes, "stage_budgets": per_stage,
                   "overrides": base, "quick": args.quick, "test_dir": args.test_dir},
        "reused": {"prepared": data["reused"]},
        "stages": {k: {x: y for x, y in v.items() if x != "provenance"}
                   for k, v in stages.items() if k != "evaluate"},
        "stage_wall_seconds": seconds,
        "evaluate": ev,
        "ablation_gate_ce": ablation,
        "acceptance": acceptance(ev, stages),
    }
    if args.test_dir:
        print("== --test-dir", flush=True)
        record["test_dir"] = in_process(config, base, test_dir_tables(args.test_dir))
    record["wall_seconds"] = round(time.time() - t0, 1)
    write_record(out, record, prov)


if __name__ == "__main__":
    main()
