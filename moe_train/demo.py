"""`moe-train demo`: the embedded default, end to end on a laptop CPU, no download.

A synthetic multilingual, multi-domain corpus (3 domains; en->de, en->fr, de->en, fr->en) is
generated and prepared; a small hybrid MoE (token-routed encoder, target-language-routed decoder:
seed 002's Token/Target) trains in-process on the DeepSpeed engine for a fixed number of steps
(the time limit is only a guard, reported when it stops training early). The demo then prints
BLEU per direction and per domain (beam search over the whole test set), the decoder's expert x
target-language table with the paths of the routing heatmaps and TensorBoard logs, and extracts
one direction's sub-network: its size against the full model, and whether it translates that
direction's test set identically. Each step reuses a finished artifact, so a second run resumes.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.config.loader import load_config, merge, read_yaml
from moe_train.errors import ConfigError
from moe_train.utils.atomic import check_parent_writable
from moe_train.utils.provenance import finish, provenance
from moe_train.utils.safe_load import read_json_object

CORPUS = {"num_domains": 3, "target_langs": ["de", "fr"], "train_per_domain": 2000,
          "dev_per_domain": 20, "test_per_domain": 25}
"""The synthetic corpus of the demo (`moe-train synth` options)."""
EXTRACT_TASK = "en-de"
"""The direction whose sub-network the demo extracts."""


def check_workdir(workdir: Path) -> None:
    """Refuse a --workdir that is not a directory (or lies under a file) before anything runs;
    a missing one is created by the first step."""
    if workdir.exists():
        if not workdir.is_dir():
            raise ConfigError(f"demo --workdir {workdir}: exists and is not a directory")
        return
    check_parent_writable(Path(workdir), "demo --workdir")


def demo_config(workdir: Path, minutes: float | None, overrides: list[str]):
    """The packaged demo recipe with its paths under `workdir`."""
    recipe = resources.files("moe_train") / "recipes" / "demo.yaml"
    with resources.as_file(recipe) as path:
        base = read_yaml(path)
    paths = {"data": {"prepared_dir": str(workdir / "prepared")},
             "checkpoint": {"dir": str(workdir / "checkpoints")},
             "logging": {"tensorboard_dir": str(workdir / "tensorboard")}}
    if minutes is not None:
        paths["train"] = {"max_minutes": minutes}
    return load_config(base=merge(base, paths), overrides=overrides)


def format_groups(metrics: dict[str, Any], group: str, head: str) -> str:
    """A BLEU / chrF table of one grouping of `metrics` ("pairs" or "domains") plus ALL."""
    rows = [f"{head:<16} {'sents':>6} {'BLEU':>6} {'chrF':>6}"]
    for name, m in [*metrics[group].items(), ("ALL", metrics["all"])]:
        rows.append(f"{name:<16} {m['sentences']:>6} {m['bleu']:>6.2f} {m['chrf']:>6.2f}")
    return "\n".join(rows)


def format_expert_table(table_EC: np.ndarray, columns: list[str]) -> str:
    """Share of each column's token slots per expert (percent), one row per expert."""
    share_EC = 100.0 * table_EC / np.maximum(table_EC.sum(0, keepdims=True), 1)
    rows = [f"{'expert':<8}" + "".join(f"{c:>8}" for c in columns)]
    for e, row in enumerate(share_EC):
        rows.append(f"{e:<8}" + "".join(f"{v:>7.1f}%" for v in row))
    return "\n".join(rows)


TASK_SOURCE_WORDS = {"tgt_lang": "target language", "lang_pair": "language pair",
                     "domain": "domain", "other_lang": "non-English language"}


def routing_words(cfg, side: str) -> str:
    """How a side routes, in words: 'task routing by target language', 'topk routing'."""
    router = getattr(cfg.moe, f"{side}_router")
    if router != "task":
        return f"{router} routing"
    source = getattr(cfg.moe, f"{side}_task_source")
    return f"task routing by {TASK_SOURCE_WORDS.get(source, source)}"


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def _check_extractable(cfg, manifest: dict[str, Any]) -> None:
    """Refuse, before any work, a recipe whose EXTRACT_TASK sub-network cannot be extracted
    (`manifest`: the corpus the demo will make)."""
    from moe_train.eval.extract import side_tasks, task_sides, task_sources

    if EXTRACT_TASK not in cfg.data.pairs:
        raise ConfigError(f"data.pairs: the demo extracts the {EXTRACT_TASK} sub-network; keep "
                          f"{EXTRACT_TASK} among the pairs")
    if not task_sides(cfg):
        raise ConfigError("moe.encoder_router / moe.decoder_router: the demo extracts a task "
                          "sub-network, so one side must route by task")
    sources = task_sources(cfg)
    try:
        side_tasks(EXTRACT_TASK, sources, manifest)
    except ConfigError as exc:
        fields = " / ".join(f"moe.{s}_task_source" for s in sources)
        raise ConfigError(f"{fields}: the demo extracts the {EXTRACT_TASK} sub-network, which "
                          f"this routing cannot name ({exc})") from None


def _check_corpus_overrides(cfg, recipe) -> None:
    """Refuse data.* overrides the demo's corpus cannot honour (they were accepted, then
    ignored, or failed deep inside): a direction it has no text for; dev / test sizes (it has
    its own dev and test files)."""
    langs = CORPUS["target_langs"]
    for pair in cfg.data.pairs:
        src, _, tgt = pair.partition("-")
        if not ((src == "en" and tgt in langs) or (tgt == "en" and src in langs)):
            raise ConfigError(f"data.pairs: the demo's corpus has en<->{', en<->'.join(langs)}; "
                              f"got {pair!r}")
    for field in ("dev_per_domain", "test_per_domain"):
        if getattr(cfg.data, field) != getattr(recipe.data, field):
            raise ConfigError(f"data.{field}: the demo's corpus comes with its own dev and test "
                              f"sets ({CORPUS['dev_per_domain']} / {CORPUS['test_per_domain']} "
                              "sentences per domain and direction); leave it unset")


PREPARE_FIELDS = ("pairs", "domains", "vocab_size", "max_len", "eval_max_len", "max_chars",
                  "domain_tags", "lang_tags", "tokenizer", "spm_model_type", "spm_max_sentences",
                  "prompt_template")
"""The data.* fields `prepare` reads: a workdir's corpus is reused only where they match."""


def _data_settings(cfg) -> dict[str, Any]:
    data = cfg.to_dict()["data"]
    return {"corpus": CORPUS, "train.seed": cfg.train.seed,
            **{f"data.{k}": data[k] for k in PREPARE_FIELDS}}


DATA_SETTINGS = "data-settings.json"
"""Written once the corpus is made and prepared: what it was made with."""


def _reusable_data(workdir: Path, cfg) -> bool:
    """Whether the workdir's corpus and prepared data can be reused: made and prepared to the
    end (its settings file is written last) with these settings. Other settings are refused
    (the model would be built from the old manifest, not from the overrides)."""
    path, now = workdir / DATA_SETTINGS, json.loads(json.dumps(_data_settings(cfg)))
    if not path.is_file():
        return False  # none made, or a run stopped before it was prepared: made again
    then = read_json_object(path, "the demo's data settings (JSON object)", ConfigError)
    for key, value in now.items():  # a key an older demo did not record: its default then
        if key in then and then[key] != value:
            raise ConfigError(f"demo --workdir {workdir}: its corpus was made with {key} "
                              f"{then.get(key)!r}, not {value!r}; use another --workdir "
                              "(or remove this one)")
    return True


def _data(workdir: Path, cfg) -> Path:
    """Generate and prepare the corpus unless done; returns the prepared directory."""
    from moe_train.data.corpus import discover
    from moe_train.data.prepare import prepare
    from moe_train.data.synthetic_dir import write_synthetic
    from moe_train.utils.atomic import write_json

    data_dir, prepared = workdir / "data", Path(cfg.data.prepared_dir)
    reuse = _reusable_data(workdir, cfg)
    if not (reuse and (data_dir / "domains.json").is_file()):
        _say(f"generating the synthetic corpus in {data_dir}")
        write_synthetic(data_dir, overwrite=True, seed=cfg.train.seed, **CORPUS)
        reuse = False
    if not (reuse and (prepared / "manifest.json").is_file()):
        _say(f"preparing (sentencepiece + shards) into {prepared}")
        manifest = prepare(discover(data_dir, pairs=cfg.data.pairs, domains=cfg.data.domains),
                           prepared, cfg.data, seed=cfg.train.seed, overwrite=True)
        sizes = {k: v["sentences"] for k, v in manifest["splits"].items()}
        _say(f"{sizes} pairs in {', '.join(cfg.data.pairs)}, vocabulary "
             f"{manifest['vocab_size']}")
        for split in ("dev", "test"):
            if not manifest["splits"].get(split, {}).get("sentences"):
                raise ConfigError(f"data: the demo's {split} split holds no sentences after "
                                  "preparing (data.eval_max_len or data.max_len too small?)")
    write_json(workdir / DATA_SETTINGS, json.loads(json.dumps(_data_settings(cfg))))
    return prepared


def _routing(workdir: Path, inf, test, cfg, rt) -> Path:
    """Routing tables of the test set: print the decoder's expert x target language table."""
    from moe_train.eval.routing_stats import collect_routing_stats
    from moe_train.eval.routing_tables import write_routing_stats

    stats = collect_routing_stats(inf.model, test, inf.manifest, rt, cfg.data.max_tokens)
    out = workdir / "routing"
    write_routing_stats(stats, out, {"checkpoint": str(inf.source),
                                     "prepared": str(cfg.data.prepared_dir), "split": "test"})
    for layer in stats.layers:
        if layer.startswith("decoder"):
            table_EC, columns = stats.table(layer, "expert_tgt_lang")
            seen = [c for c, n in enumerate(table_EC.sum(0)) if n > 0]
            slots = "token slots" if cfg.moe.k > 1 else "tokens"
            _say(f"{layer} ({routing_words(cfg, 'decoder')}, k={cfg.moe.k}): share of each "
                 f"target language's {slots} per expert")
            print(format_expert_table(table_EC[:, seen], [columns[c] for c in seen]))
            _say(f"routing heatmap: {out / (layer + '.expert_tgt_lang.png')}")
    return out


def _extraction(workdir: Path, inf, test, cfg, rt) -> dict[str, Any]:
    """Extract EXTRACT_TASK's sub-network and check it translates that direction identically."""
    from moe_train.eval.decode import translate_dataset
    from moe_train.eval.extract import extract, extraction_report, format_report, \
        write_extraction
    from moe_train.train.export import load_for_inference

    src, tgt = EXTRACT_TASK.split("-")
    langs = inf.manifest["langs"]
    indices = [i for i in range(len(test)) if int(test.src_lang_ids[i]) == langs.index(src)
               and int(test.tgt_lang_ids[i]) == langs.index(tgt)]
    ext = extract(inf.model, inf.cfg, inf.manifest, EXTRACT_TASK)
    report = extraction_report(inf.cfg, ext, inf.manifest)
    out = write_extraction(workdir / f"extracted-{EXTRACT_TASK}", ext, inf.manifest,
                           inf.source, report)
    sub = load_for_inference(out)
    args = (test, inf.vocab, rt, cfg.eval, cfg.data.max_tokens)
    full_hyps = translate_dataset(inf.model, *args, indices=indices)
    sub_hyps = translate_dataset(sub.model, *args, indices=indices)
    same = sum(full_hyps[i] == sub_hyps[i] for i in indices)
    empty = sum(not full_hyps[i].strip() for i in indices)
    _say(f"extracted the {EXTRACT_TASK} sub-network into {out}")
    print(format_report(report))
    # empty translations are equal whatever the weights: they alone would prove nothing
    identical = same == len(indices) and 0 < len(indices) != empty
    why = f" ({empty} of the full model's translations are empty)" if empty else ""
    _say(f"extraction check: {same}/{len(indices)} {EXTRACT_TASK} test sentences translated "
         f"identically by the sub-network (beam {cfg.eval.beam}){why}: "
         f"{'PASS' if identical else 'FAIL'}")
    return {"task": EXTRACT_TASK, "sentences": len(indices), "identical": same,
            "empty": empty, "passed": identical, "out": str(out), **report}


def run_demo(workdir: Path, minutes: float | None = None, overrides: list[str] | None = None
             ) -> dict:
    """Run the whole demo; returns the test metrics (with the extraction check)."""
    from moe_train.commands import run_training
    from moe_train.data.shards import nonempty_split
    from moe_train.errors import MoeTrainError
    from moe_train.eval.evaluate import evaluate_dataset
    from moe_train.parallel.runtime import ParallelRuntime
    from moe_train.train.export import load_for_inference
    from moe_train.utils.atomic import write_json

    t0 = time.time()
    prov = provenance()
    check_workdir(workdir)
    workdir = workdir.resolve()
    cfg = demo_config(workdir, minutes, overrides or [])
    _check_corpus_overrides(cfg, demo_config(workdir, minutes, []))
    from moe_train.eval.params import count_parameters

    # the model on the meta device, with the corpus's languages and domains: a bad override
    # fails here, before the corpus is made
    from moe_train.data.synthetic import DOMAINS

    domains = list(DOMAINS[:CORPUS["num_domains"]])
    manifest = {"langs": sorted({"en", *CORPUS["target_langs"]}), "domains": domains,
                "corpora": [{"src_lang": pair.split("-")[0], "tgt_lang": pair.split("-")[1],
                             "domain": d} for pair in cfg.data.pairs for d in domains]}
    count_parameters(cfg, cfg.data.vocab_size, manifest)
    _check_extractable(cfg, manifest)
    prepared = _data(workdir, cfg)
    _say(f"training a hybrid MoE: encoder {routing_words(cfg, 'encoder')} over "
         f"{cfg.moe.side_experts('encoder')} experts, decoder {routing_words(cfg, 'decoder')} "
         f"over {cfg.moe.side_experts('decoder')} experts, "
         f"{cfg.train.max_steps} steps ("
         + (f"{cfg.train.max_minutes:g} min guard)" if cfg.train.max_minutes else
            "no time guard)"))
    summary = run_training(cfg, resume=True)
    if summary.get("stopped_early"):
        _say(f"NOTE: early stopping ended training at step {summary['step']} of "
             f"{cfg.train.max_steps} (the export is step "
             f"{summary.get('exported_step', summary['step'])})")
    elif summary["step"] < cfg.train.max_steps:
        _say(f"NOTE: the {cfg.train.max_minutes:g} min guard stopped training at step "
             f"{summary['step']} of {cfg.train.max_steps}; scores are of a shorter run")

    _say("evaluating the test set with beam search")
    rt = ParallelRuntime()
    inf = load_for_inference(Path(cfg.checkpoint.dir) / "export")
    test = nonempty_split(prepared, "test")
    metrics, _ = evaluate_dataset(inf.model, test, inf.vocab, inf.manifest, rt, cfg.eval,
                                  cfg.data.max_tokens)
    print(format_groups(metrics, "pairs", "direction"))
    print(format_groups(metrics, "domains", "domain"))
    _say(f"sacreBLEU {metrics['all']['bleu_signature']}")
    routing = _routing(workdir, inf, test, cfg, rt)
    metrics["extraction"] = _extraction(workdir, inf, test, cfg, rt)
    metrics["provenance"] = finish(prov)
    write_json(workdir / "test_metrics.json", metrics)
    tokens_per_s = summary["train_tokens_per_s"]  # None: no step trained by any run here
    _say(f"done in {(time.time() - t0) / 60:.1f} min | {summary['step']} steps | "
         + (f"{tokens_per_s:.0f} target tokens/s" if tokens_per_s else "no training measured")
         + (" (trained by an earlier run; this one only evaluated)"
            if summary.get("already_ended") else ""))
    _say(f"work directory: {workdir}")
    _say(f"  checkpoint:  {cfg.checkpoint.dir} (export: {summary['export']})")
    _say(f"  routing:     {routing} (CSV tables and PNG heatmaps per MoE layer)")
    _say(f"  TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}")
    _say(f"  metrics:     {workdir / 'test_metrics.json'}")
    if not metrics["extraction"]["passed"]:
        raise MoeTrainError("demo: the extracted sub-network did not translate its direction "
                            "identically to the full model")
    return metrics
