"""Recorded real-data run of the stage-wise MoA recipe: OPUS multi-domain de->en, 7 domains, CPU.

    .venv/bin/python benchmarks/moa_real_data.py --fresh [--minutes 30] [--anchors 50]
                                                 [--test-dir DIR]   # an external test set
    .venv/bin/python benchmarks/moa_real_data.py --fresh --seed 2   # another training seed
    .venv/bin/python benchmarks/moa_real_data.py --quick --fresh   # checks the script

Every stage runs here, from the data preparation and the backbone stage on, each stage a
`python -m moe_train pipeline moa --stage S` subprocess (work/moa-opus-de-en/):
- rs: MoA without anchors (configs/moa-opus-de-en.yaml): backbone (trained with the settings of
  configs/opus-de-en-cpu.yaml for `--minutes`, no pre-injected adapter), features, cluster,
  distill, adapters, evaluate;
- di: the same with domain anchors (``moa.anchors_per_domain`` dev sentences per domain, its own
  workdir, rs's backbone): features, cluster, distill, and evaluate (no adapter stage, so
  evaluate decodes the backbone and reports the test-set routing of clusterer and distilled
  gate);
- switch_sl: a learned sentence gate over adapters (configs/moa-opus-de-en-switch-sl.yaml, rs's
  backbone, MoA's adapter budget): adapters, evaluate;
- switch_sl_moe (not in the default --runs: it doubles the time): Switch-SL as seed 000 trains
  it (configs/moa-opus-de-en-switch-sl-moe.yaml: 12 FFN experts in every decoder layer, one
  learned top-1 decision per sentence, from scratch with the backbone's settings and
  `--minutes`): backbone, evaluate.
Finished stages (their done.json) of an interrupted invocation are reused and marked so
(`stages.<run>.<stage>.reused`, with the commit that stage ran on); `--fresh` starts empty.
Writes benchmarks/results/moa_real_data_de_en_cpu.json: PUR/NMI of clusterer, distilled gate and
Switch-SL gate against the true domains (training sample and test set), per-domain BLEU/chrF of
backbone, MoA and Switch-SL, RND, a paired bootstrap of MoA against the backbone and Switch-SL
(1000 resamples of the test sentences: delta, 95% interval, p-values), issue 13's checks that
apply to real data, extra parameters, minutes per stage, provenance. `--seed S` sets the
training seed (``train.seed``) and the sampling / clustering seed (``moa.seed``) of every stage,
the backbone's included, in work/moa-opus-de-en-sS/, and writes
moa_real_data_de_en_sS_cpu.json: the same test sentences, so runs on several seeds compare
directly. `--adapter-steps N` trains the adapters of rs and switch_sl for N steps instead of
the configs' 600, in the same workdir (backbone, features, clusters and gate are reused; the
adapter and evaluate stages run again) and writes ..._aN_cpu.json: whether the gates and
adapters change with training. A benchmark,
not a test: about an hour on two cores (30 minutes of it the backbone).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from real_data import (  # noqa: E402
    DEFAULT_DATA, QUICK_DATA, QUICK_MODEL, fresh_work, opus_test_dir, write_record)

from moe_train.eval.significance import paired_bootstrap  # noqa: E402
from moe_train.stages.evaluate import hypotheses_file, read_lines  # noqa: E402
from moe_train.utils.atomic import write_json, write_text  # noqa: E402
from moe_train.utils.provenance import provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    comma_list, command_line, exit_bad_input, int_at_least, non_negative_float, results_path,
    script_parser)

DATA_CONFIG = "configs/opus-de-en-cpu.yaml"
MOA_CONFIG = "configs/moa-opus-de-en.yaml"
SWITCH_CONFIG = "configs/moa-opus-de-en-switch-sl.yaml"
SWITCH_MOE_CONFIG = "configs/moa-opus-de-en-switch-sl-moe.yaml"
TIMINGS = "timings.json"
RUNS = ("rs", "di", "switch_sl", "switch_sl_moe")
BACKBONE_TRAIN = ["optim.lr=1e-3", "optim.warmup_steps=800", "train.validate_every=500",
                  "train.log_every=50", "train.bleu_sentences=350", "checkpoint.save_every=500",
                  "checkpoint.keep_last=2", "eval.beam=5"]
"""The backbone stage trains as configs/opus-de-en-cpu.yaml does (benchmarks/real_data.py)."""
QUICK_STAGES = QUICK_MODEL + [
    "moa.num_clusters=4", "moa.pca_dim=4", "moa.sample_size=2000", "moa.distill_steps=5",
    "moa.adapter_steps=2", "moa.eval_sentences=3", "moa.eval_beam=1", "adapters.dim=8",
    "train.bleu_sentences=7", "train.max_minutes=3"]
"""--quick: a tiny model and a few steps of every stage."""
QUICK_BACKBONE = ["train.max_steps=4", "train.validate_every=0", "train.bleu_every=0"]
QUICK_SWITCH = ["adapters.num_experts=4"]


def run_stage(config: str, workdir: Path, stage: str, overrides: list[str]) -> dict[str, Any]:
    """Run one stage through `moe-train pipeline --stage ... --rerun-stale`: a finished stage
    made from the same config, data and inputs is reused, one made from anything else is run
    again (stages/record.py). Returns its done.json, the minutes it took (those of the run that
    made it, when reused) and whether it was reused."""
    timings_path = workdir / TIMINGS
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    done = workdir / stage / "done.json"
    before = done.read_text() if done.is_file() else None
    cmd = [sys.executable, "-m", "moe_train", "pipeline", "moa", "--config", config,
           "--stage", stage, "--rerun-stale", f"moa.workdir={workdir}", *overrides]
    print(f"== {workdir.name}/{stage}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    minutes = (time.time() - t0) / 60
    if proc.returncode != 0 or not done.is_file():
        log = workdir / f"{stage}.failed.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        write_text(log, proc.stdout)
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"{workdir.name}/{stage} failed with status {proc.returncode} "
                         f"(log: {log})")
    reused = before is not None and done.read_text() == before
    if reused:
        print("   reused (finished earlier from the same config and inputs)", flush=True)
    else:
        write_text(workdir / f"{stage}.log", proc.stdout)
        timings[stage] = round(minutes, 2)
        write_json(timings_path, timings)
        print(f"   done in {minutes:.2f} min", flush=True)
    return {"done": json.loads(done.read_text()), "minutes": timings.get(stage),
            "reused": reused}


def with_test_dir(data: str, test_dir: str, out: Path) -> str:
    """A corpus directory (symlinks under `out`) with `data`'s train and dev files and
    `test_dir`'s test files (OPUS layout), so that preparing it makes DIR's sentences the test
    split: clusterer, gate and models are all labelled and scored on them, and training pairs
    whose source is one of them are dropped."""
    from moe_train.data.corpus import discover

    tests = discover(test_dir, splits=["test"])  # --test-dir was checked (opus_test_dir)
    if out.exists():
        shutil.rmtree(out)
    for files in [*discover(data, splits=["train", "dev"]), *tests]:
        for path in (files.src, files.tgt):
            link = out / files.domain / path.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(path.resolve())
    return str(out)


def prepare(data: str, prepared: Path, quick: bool) -> bool:
    """Prepare the de-en data into `prepared` unless done; whether it was reused."""
    if (prepared / "manifest.json").is_file():
        return True
    cmd = [sys.executable, "-m", "moe_train", "prepare", "--data", data, "--out", str(prepared),
           "--config", DATA_CONFIG, *(QUICK_DATA if quick else [])]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"prepare failed with status {proc.returncode}")
    return False


def stage_record(stage: dict[str, Any]) -> dict[str, Any]:
    """How one stage ran: minutes, reused or not, and the commit and threads it ran with."""
    prov = stage["done"].get("provenance") or {}
    git, machine = prov.get("git") or {}, prov.get("machine") or {}
    return {"minutes": stage["minutes"], "reused": stage["reused"],
            "commit": git.get("commit"), "dirty": git.get("dirty"),
            "torch_threads": machine.get("torch_threads"), "finished_at": prov.get("finished_at")}


def total_minutes(minutes: Iterable[float | None]) -> float | None:
    """The sum of stage minutes, or None when a stage's time is unknown (run by an earlier
    invocation that kept no timing): a partial sum would read as the whole."""
    minutes = list(minutes)
    return None if any(m is None for m in minutes) else round(sum(minutes), 2)


def _pur_nmi(report: dict[str, Any]) -> dict[str, float]:
    return {"pur": round(report["pur"], 4), "nmi": round(report["nmi"], 4)}


def _scores(entry: dict[str, Any]) -> dict[str, Any]:
    """BLEU/chrF per domain, overall and RND of one evaluated model."""
    return {"bleu": {d: m["bleu"] for d, m in entry["domains"].items()} | {
                "all": entry["all"]["bleu"]},
            "chrf": {d: m["chrf"] for d, m in entry["domains"].items()} | {
                "all": entry["all"]["chrf"]},
            "rnd": {"bleu": entry["rnd"]["bleu"], "chrf": entry["rnd"]["chrf"]},
            "parameters": entry["parameters"]} | (
                {"cached": entry["cached"]} if "cached" in entry else {})


def hypotheses(workdir: Path, model: str) -> list[str]:
    """The lines a run's evaluate stage wrote for `model` ("references" for the test targets);
    exit 2 where the stage predates those files."""
    path = hypotheses_file(workdir / "evaluate", model)
    if not path.is_file():
        exit_bad_input(f"{path}: missing (an evaluate stage from before hypotheses were "
                       f"written: delete {workdir / 'evaluate'} to run it again)")
    return read_lines(path)


def paired_hypotheses(base: tuple[Path, str], others: dict[str, tuple[Path, str]]
                      ) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """A's hypotheses (A = (workdir, model)), each of `others`' and the references, from the
    files their evaluate stages wrote; every run must have scored the same test sentences (exit
    2 otherwise)."""
    refs = hypotheses(base[0], "references")
    b: dict[str, list[str]] = {}
    for name, (workdir, model) in others.items():
        if hypotheses(workdir, "references") != refs:
            exit_bad_input(f"{workdir}: evaluated on other test sentences than {base[0]}")
        b[name] = hypotheses(workdir, model)
    a = hypotheses(*base)
    for (workdir, model), hyps in [(base, a), *((others[n], h) for n, h in b.items())]:
        if len(hyps) != len(refs):
            exit_bad_input(f"{hypotheses_file(workdir / 'evaluate', model)}: "
                           f"{len(hyps)} lines, expected one per reference ({len(refs)})")
    return a, b, refs


def paired_bootstrap_runs(base: tuple[Path, str], others: dict[str, tuple[Path, str]],
                          samples: int = 1000) -> dict[str, Any]:
    """Paired bootstrap (Koehn 2004) of one evaluated model, A = (workdir, model), against each
    of `others` (B), on the hypotheses their evaluate stages wrote: {name: {bleu, chrf}}."""
    a, b, refs = paired_hypotheses(base, others)
    return {name: paired_bootstrap(a, hyps, refs, samples=samples) for name, hyps in b.items()}


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


BASELINES = {"switch_sl": "adapters", "switch_sl_moe": "backbone"}
"""Learned sentence-gate baselines -> the model of their evaluate stage that is theirs (the
adapter gate over rs's backbone; "backbone": the run's own FFN-expert MoE, trained from
scratch)."""


def checks(record: dict[str, Any]) -> dict[str, Any]:
    """Issue 13's acceptance items that apply to a real-data run: value, bar, holds. The
    synthetic PUR / NMI bars (0.9 / 0.8) are not among them: OPUS domains overlap."""
    routing, tr = record["routing_vs_domains"], record["translation"]
    out: dict[str, Any] = {}
    rs = routing.get("rs", {})
    if "distilled_gate_test" in rs and "clusterer_test" in rs:
        gate, clus = rs["distilled_gate_test"], rs["clusterer_test"]
        out["gate_within_0.02_of_clusterer"] = {
            "value": {"pur": round(gate["pur"] - clus["pur"], 4),
                      "nmi": round(gate["nmi"] - clus["nmi"], 4)},
            "holds": gate["pur"] >= clus["pur"] - 0.02 and gate["nmi"] >= clus["nmi"] - 0.02}
        for name in BASELINES:
            learned = routing.get(name, {}).get("router_sentence_test")
            if learned is not None:
                out[f"{name}_gate_nmi_le_half_moa"] = {
                    "value": learned["nmi"], "bar": round(gate["nmi"] / 2, 4),
                    "ratio": round(learned["nmi"] / gate["nmi"], 3) if gate["nmi"] else None,
                    "holds": learned["nmi"] <= gate["nmi"] / 2}
    if "moa_rs" in tr:
        moa, bb = tr["moa_rs"]["bleu"]["all"], tr["backbone"]["bleu"]["all"]
        out["moa_bleu_ge_backbone_plus_1"] = {"value": round(moa - bb, 2),
                                              "holds": moa >= bb + 1.0}
        for name in BASELINES:
            if name in tr:
                sl = tr[name]["bleu"]["all"]
                out[f"moa_above_{name}"] = {"value": round(moa - sl, 2), "holds": moa > sl}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--minutes", type=non_negative_float, default=30.0,
                    help="backbone training budget (0: none, the configs' step cap)")
    ap.add_argument("--anchors", type=int_at_least(1), default=50,
                    help="dev anchors per domain for di")
    ap.add_argument("--runs", type=comma_list(RUNS), default="rs,di,switch_sl",
                    help="comma-separated, of rs, di, "
                    "switch_sl, switch_sl_moe (di and switch_sl use rs's backbone stage, which "
                    "runs first)")
    ap.add_argument("--test-dir", type=opus_test_dir, default=None,
                    help="score on DIR's test files (OPUS layout: DOMAIN/DOMAIN.l1-l2.test.LANG) "
                    "instead of test sentences carved from the training data")
    ap.add_argument("--seed", type=int, default=None,
                    help="training and sampling seed of every stage (default: the configs')")
    ap.add_argument("--adapter-steps", type=int_at_least(1), default=None,
                    help="adapter-stage steps of rs and switch_sl (default: the configs' 600)")
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, a few steps per stage, small splits: checks the script")
    ap.add_argument("--out", default=None, help="default benchmarks/results/"
                    "moa_real_data_de_en[_sS][_aN]_cpu[_quick].json")
    args = ap.parse_args(argv)
    seed_tag = "" if args.seed is None else f"_s{args.seed}"
    steps_tag = "" if args.adapter_steps is None else f"_a{args.adapter_steps}"
    suffix = "_quick" if args.quick else ""
    bench = f"moa_real_data_de_en{seed_tag}{steps_tag}_cpu{suffix}"
    out = results_path(args.out, ROOT / "benchmarks" / "results" / f"{bench}.json")  # data or not
    if not Path(args.data).is_dir():
        print(f"skipped: {args.data} not found (the OPUS multi-domain data lives in ../shared)")
        return
    prov = provenance(command_line(__file__, argv))
    work = ROOT / "work" / f"moa-opus-de-en{seed_tag}{suffix}".replace("_", "-")
    work = fresh_work(work, args.fresh)
    anchors = 2 if args.quick else args.anchors
    data = args.data
    if args.test_dir:
        data = with_test_dir(args.data, args.test_dir, work / "corpus-with-test")
    reused_prepared = prepare(data, work / "prepared", args.quick)
    seeded = [] if args.seed is None else [f"train.seed={args.seed}", f"moa.seed={args.seed}"]
    common = [f"data.prepared_dir={work / 'prepared'}", *seeded,
              *(QUICK_STAGES if args.quick else [])]
    shared_backbone = [f"moa.backbone_dir={work / 'rs' / 'backbone'}"]
    steps = [] if args.adapter_steps is None else [f"moa.adapter_steps={args.adapter_steps}"]
    backbone = run_stage(MOA_CONFIG, work / "rs", "backbone", [
        *common, "moa.backbone_dir=", "moa.pre_inject=false", *BACKBONE_TRAIN,
        f"train.max_minutes={args.minutes}", *(QUICK_BACKBONE if args.quick else [])])
    plan = {
        "rs": (MOA_CONFIG, work / "rs", [*shared_backbone, *steps],
               ["features", "cluster", "distill", "adapters", "evaluate"]),
        "di": (MOA_CONFIG, work / "di", [*shared_backbone, f"moa.anchors_per_domain={anchors}"],
               ["features", "cluster", "distill", "evaluate"]),
        "switch_sl": (SWITCH_CONFIG, work / "switch-sl",
                      [*shared_backbone, *steps, *(QUICK_SWITCH if args.quick else [])],
                      ["adapters", "evaluate"]),
        "switch_sl_moe": (SWITCH_MOE_CONFIG, work / "switch-sl-moe",
                          ["moa.backbone_dir=", *BACKBONE_TRAIN,
                           f"train.max_minutes={args.minutes}",
                           *(QUICK_BACKBONE if args.quick else [])],
                          ["backbone", "evaluate"]),
    }
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for name in args.runs:
        config, workdir, overrides, stages = plan[name]
        runs[name] = {s: run_stage(config, workdir, s, [*common, *overrides]) for s in stages}

    bdone = backbone["done"]
    record: dict[str, Any] = {
        "benchmark": bench,
        "config": {"moa": MOA_CONFIG, "switch_sl": SWITCH_CONFIG,
                   "switch_sl_moe": SWITCH_MOE_CONFIG, "data": args.data,
                   "backbone_overrides": BACKBONE_TRAIN, "backbone_minutes": args.minutes,
                   "anchors_per_domain_di": anchors, "quick": args.quick, "seed": args.seed,
                   "adapter_steps": args.adapter_steps,
                   "test_dir": args.test_dir,
                   "quick_overrides": QUICK_STAGES if args.quick else []},
        "reused": {"prepared": reused_prepared},
        "backbone": {k: bdone[k] for k in ("step", "train_seconds", "train_tokens_per_s",
                                           "dev_loss", "dev_bleu", "dev_chrf", "pre_inject")
                     if k in bdone},
        "routing_vs_domains": {name: routing_record(st) for name, st in runs.items()},
        "stages": {name: {s: stage_record(v) for s, v in st.items()}
                   for name, st in runs.items()},
    }
    record["stages"]["rs"] = {"backbone": stage_record(backbone)} | record["stages"].get("rs", {})
    translation: dict[str, Any] = {}
    for name, st in runs.items():
        if "evaluate" not in st:
            continue
        ev = st["evaluate"]["done"]
        translation.setdefault("test_sentences", ev["test_sentences"])
        translation.setdefault("beam", ev["beam"])
        if BASELINES.get(name) == "backbone":  # the run's own model
            translation[name] = _scores(ev["backbone"])
            continue
        translation.setdefault("backbone", _scores(ev["backbone"]))
        if "adapters" in ev:
            model = "moa_rs" if name == "rs" else name
            translation[model] = _scores(ev["adapters"]) | {
                "extra_parameters": ev["extra_parameters"]}
    record["translation"] = translation
    if "evaluate" in runs.get("rs", {}):
        others = {"backbone": (work / "rs", "backbone")}
        for name, model in BASELINES.items():
            if "evaluate" in runs.get(name, {}):
                others[name] = (plan[name][1], model)
        record["paired_bootstrap_moa_rs_vs"] = paired_bootstrap_runs((work / "rs", "adapters"),
                                                                     others)
    keep = ("step", "train_seconds", "train_tokens_per_s", "dev_loss", "dev_bleu", "dev_chrf",
            "router", "num_adapters", "trainable_parameters_local")
    record["adapter_training"] = {
        name: {k: st["adapters"]["done"][k] for k in keep if k in st["adapters"]["done"]}
        for name, st in runs.items() if "adapters" in st}
    record["trained_from_scratch"] = {
        name: {k: st["backbone"]["done"][k] for k in keep if k in st["backbone"]["done"]}
        for name, st in runs.items() if "backbone" in st}
    record["checks"] = checks(record)
    every = [backbone, *(v for st in runs.values() for v in st.values())]
    record["total_stage_minutes"] = total_minutes(v["minutes"] for v in every)
    write_record(out, record, prov, show=lambda record: record)


if __name__ == "__main__":
    main()
