"""Recorded claims of seeds 000/001 on the synthetic corpus: the MoA recipe and its baselines
on corpus seeds that no test uses, per seed and mean / spread.

    .venv/bin/python benchmarks/moa_synthetic.py --fresh [--seeds 2101,2102,2103]
    .venv/bin/python benchmarks/moa_synthetic.py --synth shared_words=96 --synth ambiguous=120 \
        --work work/moa-synthetic-shared96 --out benchmarks/results/moa_synthetic_shared96_cpu.json
    .venv/bin/python benchmarks/moa_synthetic.py --quick --fresh --seeds 1   # checks the script
    .venv/bin/python benchmarks/moa_synthetic.py --profile test --seeds 2201,2202,2203

Per seed (work/moa-synthetic-bench/seed<S>/): a corpus (preset domain-matters: shared
vocabulary, 24 domain-ambiguous words, 5% of sentences without a domain word) with its
difficulty report,
prepared once; then every run below as `python -m moe_train pipeline moa --stage S`
subprocesses (configs/moa-synthetic*.yaml), finished stages reused:
- moa: backbone (pre-injected adapter, to its dev-BLEU plateau), features, cluster, distill,
  adapters (Gumbel-Max k=4, tau=1, decoder unfrozen; early stopping on dev BLEU), evaluate
  (also decodes with random routing: each sentence to a fixed arbitrary adapter);
- top1: the same gate, adapters trained with top-1 routing (k=1);
- continued: the control for Unf-D: the backbone's one pre-injected adapter trained on, with the
  decoder, exactly like MoA's adapter stage (what the extra training alone is worth);
- di: label-free (moa) against domain anchors (seed 001 DI: `--anchors` dev sentences per
  domain joined to the clustering sample): features .. evaluate;
- switch_sl / sgmoe_sl: the paper's MoE baselines, trained from scratch to their own plateau:
  K FFN experts in every decoder layer, one learned sentence-level gate (top-1 / noisy
  top-2) on the mean-pooled encoder output for all of them, load-balancing loss;
- adpt: one adapter per domain on both sides, oracle domain labels (RND: shuffled labels);
- mixed_nat: a plain backbone without adapters, to its own plateau.
`--profile test` runs instead the integration test's exact MoA run on other seeds and records
whether its bars hold (moa_synthetic_test_bars_cpu.json). Writes
benchmarks/results/moa_synthetic_cpu.json: per seed the corpus difficulty (bag-of-words
domain accuracy, BLEU of a right translation in the wrong domain, backbone -> ADPT gap), PUR/NMI
of clusterer, distilled gate and learned gates on the test split, BLEU/chrF per domain of every
model, a paired bootstrap of MoA against every other model on the same test sentences (from the
hypotheses the evaluate stages write), the acceptance checks of issue 13, minutes per stage;
then mean / std / min / max over seeds and the bootstrap on all seeds' test sentences pooled.
A benchmark, not a test: about 45 minutes per seed on two cores.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moa_real_data import (  # noqa: E402
    _pur_nmi as _pn,
    paired_bootstrap_runs,
    paired_hypotheses,
    run_stage,
    stage_record,
    total_minutes,
)
from real_data import check_overrides as check_run_overrides  # noqa: E402
from real_data import fresh_work, write_record  # noqa: E402

from moe_train.eval.significance import paired_bootstrap  # noqa: E402
from moe_train.utils.atomic import atomic_dir, write_json  # noqa: E402
from moe_train.utils.provenance import finish, provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    command_line, exit_bad_input, int_at_least, results_path, script_parser)

PRESET = "domain-matters"
"""Corpus difficulty: moe_train.data.synthetic.PRESETS[PRESET]."""
SIZES = {"num_domains": 5, "train_per_domain": 2000, "dev_per_domain": 100,
         "test_per_domain": 200}
QUICK_SIZES = {"num_domains": 5, "train_per_domain": 200, "dev_per_domain": 10,
               "test_per_domain": 10}
CONFIGS = {"moa": "configs/moa-synthetic.yaml", "switch_sl": "configs/moa-synthetic-switch-sl.yaml",
           "sgmoe_sl": "configs/moa-synthetic-sgmoe-sl.yaml",
           "adpt": "configs/moa-synthetic-adpt.yaml",
           "mixed_nat": "configs/moa-synthetic-mixed-nat.yaml"}
QUICK = ["model.d_model=32", "model.ffn_dim=64", "train.max_steps=6", "train.validate_every=3",
         "train.bleu_sentences=5", "moa.sample_size=50", "moa.pca_dim=4", "moa.distill_steps=3",
         "moa.adapter_steps=4", "moa.eval_sentences=3", "moa.eval_beam=1", "adapters.dim=4"]
"""--quick: a tiny model and a few steps of every stage (checks the script, not the claims)."""
RUNS = ("moa", "top1", "continued", "di", "switch_sl", "sgmoe_sl", "adpt", "mixed_nat")
"""Every run `run_seed` knows, in the default order (moa first: the others use its stages)."""
GATED = ("moa", "top1", "di")
"""Runs whose adapters are routed by a clusterer-distilled gate."""


def synth_options(preset: str, pairs: list[str]) -> Any:
    """`PRESETS[preset]` with ``KEY=VALUE`` fields replaced (`SynthOptions` field names); a bad
    name or value is one `error:` line and exit status 2."""
    from moe_train.data.synthetic import PRESETS, SynthOptions
    from moe_train.errors import ConfigError

    if preset not in PRESETS:
        exit_bad_input(f"--preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    types = {f.name: f.type for f in dataclasses.fields(SynthOptions)}  # "int", "float | None"
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in types:
            exit_bad_input(f"--synth {pair!r}: expected KEY=VALUE with KEY one of "
                           f"{', '.join(types)}")
        whole = str(types[key]).startswith("int")
        try:
            changes[key] = int(value) if whole else float(value)
        except ValueError:
            exit_bad_input(f"--synth {key}: expected {'an integer' if whole else 'a number'}, "
                           f"got {value!r}")
    try:
        return dataclasses.replace(PRESETS[preset], **changes)
    except ConfigError as exc:
        exit_bad_input(f"--synth: {exc}")


def parse_seeds(text: str) -> list[int]:
    """--seeds: distinct integers, comma-separated (a repeated seed would pool the same
    sentences twice); anything else is one `error:` line and exit status 2."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        exit_bad_input(f"--seeds: expected distinct comma-separated integers, got {text!r}")
    return seeds


def parse_runs(text: str) -> list[str]:
    """--runs: moa first (the others use its backbone and gate), then any of `RUNS`; anything
    else is one `error:` line and exit status 2."""
    runs = [r.strip() for r in text.split(",") if r.strip()]
    if runs[:1] != ["moa"] or set(runs) - set(RUNS) or len(set(runs)) != len(runs):
        exit_bad_input(f"--runs: expected moa first, then any of {', '.join(RUNS[1:])} once; "
                       f"got {text!r}")
    return runs


def check_overrides(overrides: list[str]) -> None:
    """`--set` overrides, checked against every run's config before anything runs."""
    check_run_overrides((config, overrides) for config in dict.fromkeys(CONFIGS.values()))


def make_corpus(work: Path, seed: int, sizes: dict[str, int], options: Any = None
                ) -> dict[str, Any]:
    """Generate (unless done) and prepare the seed's corpus (`options`: SynthOptions, default
    the PRESET's); its domains.json. A corpus already there that was made with other options
    stops the run instead of being reused."""
    from moe_train.data.synthetic import PRESETS
    from moe_train.data.synthetic_dir import write_synthetic

    options = options or PRESETS[PRESET]
    corpus, prepared = work / "corpus", work / "prepared"
    if (corpus / "domains.json").is_file():
        made = json.loads((corpus / "domains.json").read_text()).get("options")
        if made != dataclasses.asdict(options):
            exit_bad_input(f"{corpus}: made with other synthetic options ({made}); use --fresh "
                           "or another --work")
    else:
        write_synthetic(corpus, overwrite=True, seed=seed, options=options,
                        report=True, **sizes)
    if not (prepared / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "moe_train", "prepare", "--data", str(corpus), "--out",
               str(prepared), "--config", CONFIGS["moa"]]
        proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            sys.stdout.write(proc.stdout[-6000:])
            raise SystemExit(f"prepare failed with status {proc.returncode}")
    return json.loads((corpus / "domains.json").read_text())


def copy_gate(src: Path, dst: Path) -> None:
    """Reuse a finished run's features, clusters and distilled gate in another workdir."""
    for stage in ("features", "cluster", "distill"):
        if not (dst / stage / "done.json").is_file():
            # whole or not at all: a copy cut short must not leave a done.json that marks it
            # finished (copytree's order is the file system's)
            with atomic_dir(dst / stage, overwrite=True) as tmp:
                shutil.copytree(src / stage, tmp, dirs_exist_ok=True)


def run_seed(work: Path, common: list[str], anchors: int, runs: list[str]
             ) -> dict[str, dict[str, Any]]:
    """Every run of one seed; {run: {stage: run_stage result}}."""
    backbone = [f"moa.backbone_dir={work / 'moa' / 'backbone'}"]
    plan: dict[str, tuple[str, list[str], list[str]]] = {
        "moa": (CONFIGS["moa"], [], ["backbone", "features", "cluster", "distill", "adapters",
                                     "evaluate"]),
        "top1": (CONFIGS["moa"], [*backbone, "adapters.k=1"], ["adapters", "evaluate"]),
        "continued": (CONFIGS["moa"], [*backbone, "adapters.router=single",
                                       "adapters.num_experts=1", "adapters.k=1"],
                      ["adapters", "evaluate"]),
        "di": (CONFIGS["moa"], [*backbone, f"moa.anchors_per_domain={anchors}"],
               ["features", "cluster", "distill", "adapters", "evaluate"]),
        "switch_sl": (CONFIGS["switch_sl"], ["moa.backbone_dir="], ["backbone", "evaluate"]),
        "sgmoe_sl": (CONFIGS["sgmoe_sl"], ["moa.backbone_dir="], ["backbone", "evaluate"]),
        "adpt": (CONFIGS["adpt"], backbone, ["adapters", "evaluate"]),
        "mixed_nat": (CONFIGS["mixed_nat"], ["moa.backbone_dir="], ["backbone", "evaluate"]),
    }
    out: dict[str, dict[str, Any]] = {}
    for name in runs:
        config, overrides, stages = plan[name]
        workdir = work / name
        if name == "top1":
            copy_gate(work / "moa", workdir)
        out[name] = {s: run_stage(config, workdir, s, [*common, *overrides]) for s in stages}
    return out


def _model(entry: dict[str, Any]) -> dict[str, Any]:
    """BLEU/chrF overall and per domain of one evaluated model (+ random routing / RND)."""
    rec = {"bleu": entry["all"]["bleu"], "chrf": entry["all"]["chrf"],
           "bleu_per_domain": {d: m["bleu"] for d, m in entry["domains"].items()},
           "chrf_per_domain": {d: m["chrf"] for d, m in entry["domains"].items()},
           "parameters": entry["parameters"]}
    if "random_routing" in entry:
        rec["random_routing"] = entry["random_routing"]
    if entry["rnd"] != entry["all"]:  # label-routed: decoded again with shuffled labels
        rec["rnd_shuffled_labels"] = {k: entry["rnd"][k] for k in ("bleu", "chrf")}
    return rec


def _evaluated_model(ev: dict[str, Any]) -> str:
    """Which model of an evaluate stage is the run's own: its adapter model, else its backbone
    (the baselines trained from scratch)."""
    return "adapters" if "adapters" in ev else "backbone"


def _compared(work: Path, runs: dict[str, dict[str, Any]]) -> dict[str, tuple[Path, str]]:
    """What MoA is compared with on one seed: the backbone and every other evaluated run's own
    model, as (workdir, model)."""
    others = {"backbone": (work / "moa", "backbone")}
    return others | {name: (work / name, _evaluated_model(stages["evaluate"]["done"]))
                     for name, stages in runs.items() if name != "moa" and "evaluate" in stages}


def significance(work: Path, runs: dict[str, dict[str, Any]], samples: int = 1000
                 ) -> dict[str, Any]:
    """Paired bootstrap (1000 resamples of the test sentences) of MoA against the backbone and
    every other run's own model, from the hypotheses the evaluate stages wrote: {model: {bleu,
    chrf}} with A = MoA, B = that model."""
    return paired_bootstrap_runs((work / "moa", "adapters"), _compared(work, runs),
                                 samples=samples)


def pooled_significance(seeds: list[tuple[Path, dict[str, dict[str, Any]]]],
                        samples: int = 1000) -> dict[str, Any]:
    """The paired bootstrap on the union of every seed's test sentences (each paired with its
    own seed's models; each resample draws every seed's sentences apart, so the seeds keep
    their share), for each model every seed has: whether MoA's lead over seeds is larger than
    the test sentences' noise. It resamples sentences only, so it does not measure how training
    and corpus seeds move the delta; the per-seed deltas show that."""
    a: list[str] = []
    refs: list[str] = []
    strata: list[int] = []
    b: dict[str, list[str]] = {}
    has: dict[str, int] = {}
    for work, runs in seeds:
        a_s, b_s, refs_s = paired_hypotheses((work / "moa", "adapters"), _compared(work, runs))
        a += a_s
        refs += refs_s
        strata.append(len(refs_s))
        for name, hyps in b_s.items():
            b.setdefault(name, []).extend(hyps)
            has[name] = has.get(name, 0) + 1
    return {name: paired_bootstrap(a, hyps, refs, samples=samples, strata=strata)
            for name, hyps in b.items() if has[name] == len(seeds)}


def pooled_checks(per_seed: dict[str, dict[str, Any]], pooled: dict[str, Any]
                  ) -> dict[str, Any]:
    """The Gumbel-Max item over the seeds together: the mean of the per-seed BLEU deltas, and
    the pooled paired bootstrap (top-1 not significantly better, p >= 0.05)."""
    if "top1" not in pooled:
        return {}
    deltas = [rec["checks"]["gumbel_k4_ge_top1"]["value"] for rec in per_seed.values()]
    mean = round(statistics.fmean(deltas), 2)
    bs = pooled["top1"]["bleu"]
    return {"gumbel_k4_mean_delta_over_seeds_ge_0": {
                "value": mean, "per_seed": deltas, "holds": mean >= 0},
            "gumbel_k4_not_significantly_below_top1_pooled": {
                "value": {"delta": bs["delta"], "ci95": bs["ci95"],
                          "p_top1_not_better": bs["p_b_not_better"]},
                "bar": "p_top1_not_better >= 0.05", "holds": bs["p_b_not_better"] >= 0.05}}


def seed_record(corpus: dict[str, Any], runs: dict[str, dict[str, Any]],
                sig: dict[str, Any]) -> dict[str, Any]:
    """One seed's figures and acceptance checks; `sig` is `significance` of its runs."""
    evals = {name: st["evaluate"]["done"] for name, st in runs.items() if "evaluate" in st}
    moa = evals["moa"]
    models: dict[str, Any] = {"backbone": _model(moa["backbone"])}
    for name, ev in evals.items():
        models[name] = _model(ev[_evaluated_model(ev)])
    routing: dict[str, Any] = {}
    for name, ev in evals.items():
        for key, rep in ev["routing"].items():
            if name in GATED and key.startswith("router_"):
                continue  # the gumbel router's top-1 is its distilled gate
            if name not in GATED and key in ("clusterer", "distilled_gate"):
                continue
            routing[f"{name}/{key}" if name != "moa" else key] = _pn(rep)
    st = runs["moa"]
    routing["clusterer_train_sample"] = _pn(st["cluster"]["done"]["sampled_only"])
    routing["distilled_gate_train_sample"] = _pn(st["distill"]["done"]["gate_vs_domains"])
    keys = ("step", "stopped_early", "early_stop", "dev_bleu", "train_seconds", "exported_step")
    training = {name: {s: {k: v["done"][k] for k in keys if k in v["done"]}
                       for s, v in stages.items() if s in ("backbone", "adapters")}
                for name, stages in runs.items()}
    diff = dict(corpus.get("difficulty") or {})
    if "adpt" in models:
        diff["oracle_adapter_minus_backbone_bleu"] = round(
            models["adpt"]["bleu"] - models["backbone"]["bleu"], 2)
    minutes = {name: {s: v["minutes"] for s, v in stages.items()} for name, stages in runs.items()}
    return {"difficulty": diff, "routing_test": routing, "translation": models,
            "training": training, "checks": checks(models, routing, sig),
            "paired_bootstrap_moa_vs": sig,
            "minutes": minutes,
            "moa_recipe_minutes": total_minutes(minutes["moa"].values()),
            "stages": {name: {s: stage_record(v) for s, v in stages.items()}
                       for name, stages in runs.items()}}


def checks(models: dict[str, Any], routing: dict[str, Any], sig: dict[str, Any]
           ) -> dict[str, Any]:
    """Issue 13's acceptance items on one seed (and the Unf-D control): value, bar, holds.
    Beside the literal Gumbel-Max item, whether top-1 is significantly better (paired
    bootstrap, p < 0.05): a difference inside the test set's own noise is not "worse"."""
    gate, clus = routing["distilled_gate"], routing["clusterer"]
    moa, bb = models["moa"], models["backbone"]
    out: dict[str, Any] = {
        "gate_pur_ge_0.9": {"value": gate["pur"], "holds": gate["pur"] >= 0.9},
        "gate_nmi_ge_0.8": {"value": gate["nmi"], "holds": gate["nmi"] >= 0.8},
        "gate_within_0.02_of_clusterer": {
            "value": {"pur": round(gate["pur"] - clus["pur"], 4),
                      "nmi": round(gate["nmi"] - clus["nmi"], 4)},
            "holds": gate["pur"] >= clus["pur"] - 0.02 and gate["nmi"] >= clus["nmi"] - 0.02},
        "moa_bleu_ge_backbone_plus_1": {"value": round(moa["bleu"] - bb["bleu"], 2),
                                        "holds": moa["bleu"] >= bb["bleu"] + 1.0},
        **({"moa_above_continued_training": {
            "value": round(moa["bleu"] - models["continued"]["bleu"], 2),
            "holds": moa["bleu"] > models["continued"]["bleu"]}} if "continued" in models else {}),
        "moa_above_random_routing": {
            "value": round(moa["bleu"] - moa["random_routing"]["bleu"], 2),
            "holds": moa["bleu"] > moa["random_routing"]["bleu"]},
    }
    for name in ("switch_sl", "sgmoe_sl"):
        key = f"{name}/router_sentence"
        if key in routing:
            out[f"{name}_gate_nmi_le_half_moa"] = {
                "value": routing[key]["nmi"], "bar": round(gate["nmi"] / 2, 4),
                "holds": routing[key]["nmi"] <= gate["nmi"] / 2}
    if "top1" in models:
        out["gumbel_k4_ge_top1"] = {"value": round(moa["bleu"] - models["top1"]["bleu"], 2),
                                    "holds": moa["bleu"] >= models["top1"]["bleu"]}
        bs = sig["top1"]["bleu"]
        out["gumbel_k4_not_significantly_below_top1"] = {
            "value": {"delta": bs["delta"], "ci95": bs["ci95"],
                      "p_top1_not_better": bs["p_b_not_better"]},
            "bar": "p_top1_not_better >= 0.05", "holds": bs["p_b_not_better"] >= 0.05}
    return out


def summary(per_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean / std / min / max over seeds of every numeric leaf shared by all seeds."""
    def leaves(d: Any, prefix: str = "") -> dict[str, float]:
        if isinstance(d, dict):
            out: dict[str, float] = {}
            for k, v in d.items():
                out.update(leaves(v, f"{prefix}{k}/"))
            return out
        return {prefix[:-1]: float(d)} if isinstance(d, (int, float)) and \
            not isinstance(d, bool) else {}

    keep = ("difficulty", "routing_test", "translation", "moa_recipe_minutes")
    flat = [leaves({k: rec[k] for k in keep if k in rec}) for rec in per_seed.values()]
    names = sorted(set.intersection(*(set(f) for f in flat)))
    stats = {}
    for n in names:
        vals = [f[n] for f in flat]
        stats[n] = {"mean": round(statistics.fmean(vals), 4),
                    "std": round(statistics.pstdev(vals), 4),
                    "min": round(min(vals), 4), "max": round(max(vals), 4)}
    holds = {c: all(rec["checks"][c]["holds"] for rec in per_seed.values())
             for c in set.intersection(*(set(r["checks"]) for r in per_seed.values()))}
    return {"stats": stats, "checks_hold_on_every_seed": dict(sorted(holds.items()))}


def test_bars(work: Path, seeds: list[int]) -> dict[str, Any]:
    """``--profile test``: tests/integration/test_moa_pipeline.py's exact run (its corpus sizes,
    preset and overrides) on other corpus seeds, and whether its bars hold on each."""
    from tests.conftest import cli_env
    from tests.integration import test_moa_pipeline as t

    per_seed: dict[str, Any] = {}
    for seed in seeds:
        sw = work / f"seed{seed}"
        if sw.exists():
            shutil.rmtree(sw)
        prepared = t.make_corpus(sw, seed)
        cmd = [sys.executable, "-m", "moe_train", "pipeline", "moa", "--config", t.CONFIG,
               f"data.prepared_dir={prepared}", f"moa.workdir={sw / 'run'}", *t.OVERRIDES]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                              env=cli_env())  # the test's environment: one OpenMP thread
        if proc.returncode != 0:
            sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"seed {seed}: the pipeline failed with status {proc.returncode}")
        done = json.loads(proc.stdout.strip().splitlines()[-1])
        gate, clus = done["distill"]["gate_vs_domains"], done["cluster"]["all"]
        per_seed[str(seed)] = {
            "gate_train_features": _pn(gate), "clusterer_train_sample": _pn(clus),
            "routing_test": {k: _pn(v) for k, v in done["evaluate"]["routing"].items()},
            "backbone_dev_bleu": done["backbone"].get("dev_bleu"),
            "minutes": round((time.time() - start) / 60, 2),
            "bars_hold": gate["pur"] >= t.GATE_BARS["pur"] and gate["nmi"] >= t.GATE_BARS["nmi"]
            and clus["pur"] >= t.CLUSTER_PUR_BAR}
        print(json.dumps({seed: per_seed[str(seed)]}), flush=True)
    return {"test_seed": t.SEED,
            "bars": {"gate": t.GATE_BARS, "clusterer_pur": t.CLUSTER_PUR_BAR},
            "corpus": t.CORPUS, "preset": t.PRESET, "overrides": t.OVERRIDES, "per_seed": per_seed,
            "bars_hold_on_every_seed": all(r["bars_hold"] for r in per_seed.values())}


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--seeds", default="2101,2102,2103",
                    help="corpus seeds (tests use 0-99; keep these out of that range)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--anchors", type=int_at_least(1), default=20,
                    help="dev anchors per domain for di")
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--quick", action="store_true", help="tiny corpus, model and stages")
    ap.add_argument("--profile", choices=("claims", "test"), default="claims",
                    help="claims: every run below; test: the integration test's run on --seeds "
                    "(are its bars safe on seeds it does not use?)")
    ap.add_argument("--preset", default=PRESET, help=f"synthetic corpus preset (default {PRESET})")
    ap.add_argument("--synth", action="append", default=[], metavar="KEY=VALUE",
                    help="a SynthOptions field over the preset, e.g. shared_words=96 (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="a config override for every run and stage, e.g. "
                    "optim.warmup_steps=1000 (repeatable; recorded in config.overrides)")
    ap.add_argument("--work", default=None, help="default work/moa-synthetic-bench[-quick]")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/moa_synthetic[_test_bars]_cpu[_quick].json")
    args = ap.parse_args(argv)
    seeds, runs = parse_seeds(args.seeds), parse_runs(args.runs)
    options = synth_options(args.preset, args.synth)
    check_overrides(args.overrides)
    if args.profile == "test" and (args.synth or args.preset != PRESET):
        ap.error("--preset/--synth: --profile test runs the integration test's own corpus")
    if args.profile == "test" and args.quick:  # it would run in full and replace the record
        ap.error("--quick: --profile test has no quick form (it runs the integration test)")
    prov = provenance(command_line(__file__, argv))
    suffix = "_quick" if args.quick else ""
    if args.profile == "test":
        suffix = "_test_bars"
    work = Path(args.work or ROOT / "work" / f"moa-synthetic-bench{suffix.replace('_', '-')}")
    name = "moa_synthetic_cpu_quick" if args.quick else f"moa_synthetic{suffix}_cpu"
    out = results_path(
        args.out, ROOT / "benchmarks" / "results" / f"{name}.json")  # *_quick: ignored
    work = fresh_work(work, args.fresh)
    if args.profile == "test":
        t0 = time.time()
        record = {"benchmark": "moa_synthetic_test_bars_cpu",
                  **test_bars(work, seeds),
                  "wall_minutes": round((time.time() - t0) / 60, 2)}
        record["provenance"] = finish(prov)
        write_json(out, record)
        print(f"bars hold on every seed: {record['bars_hold_on_every_seed']}; wrote {out}")
        return
    per_seed: dict[str, Any] = {}
    done: list[tuple[Path, dict[str, Any]]] = []
    t0 = time.time()
    for seed in seeds:
        sw = work / f"seed{seed}"
        corpus = make_corpus(sw, seed, QUICK_SIZES if args.quick else SIZES, options)
        common = [f"data.prepared_dir={sw / 'prepared'}", *(QUICK if args.quick else []),
                  *args.overrides]
        results = run_seed(sw, common, 2 if args.quick else args.anchors, runs)
        per_seed[str(seed)] = seed_record(corpus, results, significance(sw, results))
        done.append((sw, results))
        print(json.dumps({seed: per_seed[str(seed)]["checks"]}, indent=1), flush=True)
    record = {"benchmark": f"moa_synthetic{suffix}_cpu",
              "config": {"configs": CONFIGS, "synth_preset": args.preset,
                         "synth_overrides": args.synth,
                         "synth_options": dataclasses.asdict(options),
                         "sizes": QUICK_SIZES if args.quick else SIZES, "seeds": seeds,
                         "runs": runs, "anchors_per_domain_di": 2 if args.quick else args.anchors,
                         "overrides": args.overrides,
                         "quick_overrides": QUICK if args.quick else []},
              "per_seed": per_seed, "across_seeds": summary(per_seed),
              "wall_minutes": round((time.time() - t0) / 60, 2)}
    pooled = pooled_significance(done)
    record["across_seeds"]["paired_bootstrap_moa_vs_pooled"] = pooled
    record["across_seeds"]["checks_pooled"] = pooled_checks(per_seed, pooled)
    write_record(out, record, prov,
                 show=lambda record: record["across_seeds"]["checks_hold_on_every_seed"])


if __name__ == "__main__":
    main()
