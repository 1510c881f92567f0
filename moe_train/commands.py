"""Implementations of the `moe-train` sub-commands (argument parsing lives in cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from moe_train.config.loader import load_config, merge
from moe_train.config.deepspeed_entries import check_deepspeed_entries
from moe_train.config.schema import EvalConfig
from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.eval.raw_text import serving, translate_raw


def _json_line(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


@contextlib.contextmanager
def _runtime():
    """A distributed runtime under a launcher, else a plain single-process one (no process
    group); the process group is shut down at the end, without waiting for the peers when this
    rank failed (they may be inside a collective)."""
    from moe_train.parallel.runtime import ParallelRuntime, detect_launch, init_runtime

    if not detect_launch(os.environ).multi_process:
        yield ParallelRuntime()
        return
    rt = init_runtime()
    with _shut_down(rt):
        yield rt


@contextlib.contextmanager
def _shut_down(rt):
    """Shut `rt` down when the block ends: after a barrier when it succeeded, at once when this
    rank failed (its peers may be inside a collective: a barrier would hang both until the
    process group's timeout, and the error would never be printed)."""
    from moe_train.parallel.runtime import shutdown

    try:
        yield
    except BaseException:
        shutdown(rt, barrier=False)
        raise
    shutdown(rt)


SYNTH_FLAGS = {"num_domains": "--domains", "target_langs": "--langs",
               "train_per_domain": "--train", "dev_per_domain": "--dev",
               "test_per_domain": "--test", "shared_rate": "--shared-rate",
               "ambiguous": "--ambiguous", "ambiguous_rate": "--ambiguous-rate",
               "cue_rate": "--cue-rate", "shared_words": "--shared-words"}
"""The generator's settings as `synth` spells them: its errors name the flag."""


def cmd_synth(args: argparse.Namespace) -> int:
    import dataclasses
    import re

    from moe_train.data.synthetic import PRESETS
    from moe_train.data.synthetic_dir import write_synthetic

    langs = [lang.strip() for lang in args.langs.split(",") if lang.strip()]
    given = {name: getattr(args, name) for name in ("shared_rate", "ambiguous", "ambiguous_rate",
                                                    "cue_rate", "shared_words")
             if getattr(args, name) is not None}
    try:
        options = dataclasses.replace(PRESETS[args.preset], **given)
        info = write_synthetic(args.out, overwrite=args.overwrite, num_domains=args.domains,
                               target_langs=langs, train_per_domain=args.train,
                               dev_per_domain=args.dev, test_per_domain=args.test,
                               seed=args.seed, options=options, report=True)
    except ConfigError as exc:
        raise ConfigError(re.sub(r"^synthetic (\w+)", lambda m: SYNTH_FLAGS.get(
            m.group(1), m.group(0)), str(exc))) from None
    for dom in info["domains"]:
        sizes = dom["sizes"]
        print(f"| {dom['name']:<10} train {sizes['train']:>6} | dev {sizes['dev']:>5} | "
              f"test {sizes['test']:>5} | {dom['src_word_types']:>5} source word types")
    diff = info.get("difficulty") or {}
    if diff:
        print(f"| difficulty: bag-of-words domain accuracy {diff['bow_domain_accuracy']:.3f} | "
              f"BLEU of the right translation in the wrong domain {diff['wrong_domain_bleu']:.1f}"
              f" ({diff['held_out_split']}, {diff['sentences']} sentences)")
    en_xx = ",".join(f"en-{lang}" for lang in info["target_langs"])
    print(f"| pairs {', '.join(info['pairs'])} | seed {info['seed']} | wrote {args.out} "
          f"(next: moe-train prepare --data {args.out} --out PREPARED --config CONFIG "
          f"data.pairs=[{en_xx}])")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from moe_train.data.corpus import discover, plain_corpus
    from moe_train.data.prepare import prepare

    cfg = load_config(args.config, args.overrides)
    if bool(args.data) == bool(args.src):
        raise ConfigError("prepare: give either --data DIR or --src FILE --tgt FILE")
    plain = {"--tgt": args.tgt, "--domain": args.domain, "--src-lang": args.src_lang,
             "--tgt-lang": args.tgt_lang}
    if args.data and any(v is not None for v in plain.values()):
        given = ", ".join(flag for flag, v in plain.items() if v is not None)
        raise ConfigError(f"prepare: {given} go with --src FILE, not --data DIR (whose file "
                          f"names give the languages and domains)")
    if args.src:
        if not args.tgt:
            raise ConfigError("prepare: --src needs --tgt")
        names = {"domain": args.domain, "src_lang": args.src_lang, "tgt_lang": args.tgt_lang}
        corpora = [plain_corpus(args.src, args.tgt,  # the defaults where not given
                                **{k: v for k, v in names.items() if v is not None})]
    else:
        corpora = discover(args.data, pairs=cfg.data.pairs, domains=cfg.data.domains)
    manifest = prepare(corpora, args.out, cfg.data, seed=cfg.train.seed,
                       overwrite=args.overwrite)
    for split, info in manifest["splits"].items():
        print(f"| {split:<5} {info['sentences']:>8} pairs | {info['src_tokens']:>9} src tokens | "
              f"{info['tgt_tokens']:>9} tgt tokens | skipped (too long) "
              f"{sum(info['skipped_too_long'])} | skipped (no tokens) "
              f"{sum(info['skipped_empty'])}")
    size, asked = manifest["vocab_size"], cfg.data.vocab_size
    short = (f" (data.vocab_size asked {asked}; the training text filled no more)"
             if not cfg.data.tokenizer and size < asked else "")
    print(f"| vocabulary {size}{short} | domains {', '.join(manifest['domains'])} | "
          f"wrote {args.out}")
    return 0


def check_dir_settings(cfg, recipe: bool = False) -> None:
    """The directories a run (`recipe`: a stage-wise recipe) creates or fills can be made
    (before any training step)."""
    from moe_train.utils.atomic import check_dir_setting

    fields = [("checkpoint.dir", cfg.checkpoint.dir),
              ("logging.tensorboard_dir", cfg.logging.tensorboard_dir)]
    for field, path in fields + ([("moa.workdir", cfg.moa.workdir)] if recipe else []):
        check_dir_setting(path, field)
    if cfg.logging.tensorboard_dir:  # the export is replaced whole, old steps are rotated away
        ckpt = Path(cfg.checkpoint.dir).resolve()
        tb = Path(cfg.logging.tensorboard_dir).resolve()
        inside = tb.relative_to(ckpt).parts if tb.is_relative_to(ckpt) else ()
        if inside and (inside[0] == "export" or re.fullmatch(r"(\.tmp-)?step_\d+", inside[0])):
            raise ConfigError(f"logging.tensorboard_dir: {cfg.logging.tensorboard_dir} is inside "
                              f"{ckpt / inside[0]}, which the run replaces or removes; expected "
                              "a directory outside checkpoint.dir's export and steps")


def run_training(cfg, resume: bool) -> dict[str, Any]:
    """Train under whatever launcher started this process; returns the run summary."""
    from moe_train.data.prepare import check_fits_model, check_prompt_template

    # Before DeepSpeed starts: missing, too long or otherwise prompted data fails fast.
    check_prompt_template(cfg.data.prepared_dir,
                          cfg.data.prompt_template if cfg.decoder_only else "")
    if cfg.decoder_only:  # prompt and target are one sequence
        check_fits_model(cfg.data.prepared_dir, cfg.qwen.max_position_embeddings,
                         field="qwen.max_position_embeddings")
    else:
        cls_positions = int(cfg.uses_thor)  # THOR prepends a [CLS] to every source
        check_fits_model(cfg.data.prepared_dir, cfg.model.max_positions - cls_positions)
    from moe_train.parallel.runtime import init_runtime
    from moe_train.train.checkpoint import latest_tag
    from moe_train.train.trainer import Trainer

    check_dir_settings(cfg)
    if not resume and latest_tag(cfg.checkpoint.dir) is not None:
        raise CheckpointError(f"checkpoint.dir {cfg.checkpoint.dir}: already holds a checkpoint; "
                              "pass --resume to continue it or choose another checkpoint.dir")
    rt = init_runtime()
    with _shut_down(rt):
        summary = Trainer(cfg, rt, resume=resume).fit()
    summary["rank"] = rt.rank
    return summary


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.deepspeed_config:
        path = Path(args.deepspeed_config)
        try:
            extra = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable DeepSpeed JSON config ({exc})") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to read; expected a DeepSpeed JSON "
                              "config") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{path}: expected a JSON object (DeepSpeed config keys), got "
                              f"{type(extra).__name__}")
        check_deepspeed_entries(extra, f"{path}: ")
        cfg.deepspeed = merge(cfg.deepspeed, extra)  # nested: the config's other entries stay
    summary = run_training(cfg, args.resume)
    if summary.pop("rank") == 0:
        _json_line(summary)
    return 0


def _eval_config(args: argparse.Namespace, base: EvalConfig) -> EvalConfig:
    from dataclasses import replace

    changes = {k: v for k, v in (("beam", args.beam), ("lenpen", args.lenpen),
                                 ("max_sentences", args.max_sentences)) if v is not None}
    return replace(base, **changes)


def cmd_translate(args: argparse.Namespace) -> int:
    """Read and check the whole input, translate it all, then write (nothing on any error)."""
    from moe_train.data.corpus import read_text_input
    from moe_train.utils.atomic import check_out_file, lines_text, write_text

    source, lines = read_text_input(args.input)  # before the model: bad input fails fast
    if args.output == "-" and sys.stdout is None:  # `moe-train translate ... >&-`
        raise DataError("--output -: standard output is closed (give --output FILE)")
    if args.output != "-":
        check_out_file(args.output, "--output", {"--input": args.input,
                                                 "--checkpoint": args.checkpoint})
    import torch

    from moe_train.train.export import load_for_inference

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inf = load_for_inference(args.checkpoint, device)
    hyps = translate_raw(inf, args, source, lines, _eval_config(args, inf.cfg.eval), device)
    text = lines_text(hyps)
    if args.output == "-":  # UTF-8 like --output FILE, whatever the locale
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        write_text(args.output, text)
    return 0


def _prepared_split(inf, prepared_arg: str | None, split: str, raw_text: bool = True):
    """The prepared split to score, checked against the model (`check_model_data`: its
    tokenizer, its domain and language lists). `raw_text`: the command also takes sentences
    as --src / --ref (evaluate), which an extracted sub-network's refusal then suggests."""
    from moe_train.data.prepare import check_model_data, check_prompt_template
    from moe_train.data.shards import nonempty_split

    prepared = Path(prepared_arg or inf.cfg.data.prepared_dir)
    dataset = nonempty_split(prepared, split)
    inf.manifest = check_model_data(inf.source, inf.manifest, prepared, dataset.manifest)
    # the prompts the model trained on (as training checks it): another template's are not
    check_prompt_template(prepared, inf.cfg.data.prompt_template if inf.cfg.decoder_only
                          else "")
    if inf.cfg.moe.extracted_task:
        from moe_train.eval.extract import serves

        check = serves(inf.cfg, inf.manifest)
        sizes = dataset.manifest["splits"][split]["corpus_sizes"]
        other = [c["name"] for c, n in zip(dataset.manifest["corpora"], sizes)
                 if n and not check(c)]
        if other:
            raise DataError(f"{prepared}: its {split} split holds {', '.join(other)}, which "
                            f"{inf.source} does not serve: it is a sub-network extracted with "
                            f"--task {inf.cfg.moe.extracted_task}; use the full model"
                            + (", or give this task's sentences with --src / --ref"
                               if raw_text else ", or data prepared from this task's corpora"))
    return dataset


def cmd_params(args: argparse.Namespace) -> int:
    if args.checkpoint:
        if args.overrides:
            raise ConfigError("params: overrides go with --config, not --checkpoint")
        from moe_train.train.export import read_config

        cfg, manifest = read_config(args.checkpoint)
        vocab_size = int(manifest["vocab_size"])
    else:
        cfg = load_config(args.config, args.overrides)  # before torch: errors fail fast
        vocab_size, manifest = cfg.data.vocab_size, None
        if cfg.decoder_only:
            vocab_size = cfg.qwen.vocab_size
    from moe_train.eval.params import count_parameters, format_params

    report = count_parameters(cfg, vocab_size, manifest)
    print(format_params(report))
    _json_line(report)
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from moe_train.eval.extract import EXTRACT_REPORT, extract, extraction_report, \
        format_report, write_extraction
    from moe_train.train.export import checkpoint_dir, load_for_inference
    from moe_train.utils.atomic import check_out_dir

    check_out_dir(args.out, "--out", EXTRACT_REPORT, "extract",
                  sources=[args.checkpoint, checkpoint_dir(args.checkpoint)])
    inf = load_for_inference(args.checkpoint, "cpu")
    ext = extract(inf.model, inf.cfg, inf.manifest, args.task)
    report = extraction_report(inf.cfg, ext, inf.manifest)
    out = write_extraction(args.out, ext, inf.manifest, inf.source, report)
    print(format_report(report))
    print(f"| wrote {out}")
    _json_line({"checkpoint": str(inf.source), "out": str(out), **report})
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from moe_train.train.average import AVERAGE_REPORT, last_steps, resolve_inputs, write_average
    from moe_train.utils.atomic import check_out_dir
    from moe_train.utils.provenance import provenance

    prov = provenance()  # average.json's start time and duration cover the whole command
    if args.last is not None and len(args.checkpoints) != 1:
        raise ConfigError(f"--last {args.last}: expected one checkpoint directory with it, got "
                          f"{len(args.checkpoints)} paths")
    paths = last_steps(args.checkpoints[0], args.last) if args.last else args.checkpoints
    check_out_dir(args.out, "--out", AVERAGE_REPORT, "average", sources=paths)
    inputs = resolve_inputs(paths)
    report = write_average(inputs, args.out, prov)
    for again, first in report.get("identical_inputs", []):
        print(f"warning: {again} holds the same weights as {first} (an export and the step it "
              "was written from?); the average counts them twice", file=sys.stderr)
    names = ", ".join(f"step {i.step}" if i.step is not None else str(i.path) for i in inputs)
    print(f"| averaged {len(inputs)} checkpoints ({names}) -> {args.out}")
    _json_line({"out": str(args.out), **report})
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from moe_train.eval.plan import format_plan, plan_from_args

    report = plan_from_args(args)
    print(format_plan(report))
    _json_line(report)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from moe_train.models.hf_io import CONVERT_REPORT, convert_from_hf, convert_to_hf
    from moe_train.utils.atomic import check_out_dir

    if args.from_hf:
        check_out_dir(args.out, "--out", CONVERT_REPORT, "convert", sources=[args.from_hf])
        if args.dtype or args.max_shard_size:
            raise ConfigError("--dtype and --max-shard-size go with --to-hf (a --from-hf "
                              "export holds float32 weights in one file)")
        if args.trim is None and (args.experts or args.calibration or args.k):
            raise ConfigError("--experts, --calibration and --k: expected --trim N with them "
                              "(they choose what the trimmed model keeps)")
        summary = convert_from_hf(args.from_hf, args.out, args.trim, args.experts,
                                  args.calibration, args.k, args.calibration_lines)
    else:
        if args.trim or args.experts or args.calibration or args.k:
            raise ConfigError("--trim, --experts, --calibration and --k go with --from-hf")
        check_out_dir(args.out, "--out", CONVERT_REPORT, "convert", sources=[args.to_hf])
        summary = convert_to_hf(args.to_hf, args.out, args.dtype or "float32",
                                args.max_shard_size)
    print(f"| wrote {args.out}: {summary['tensors']} tensors, {summary['parameters']:,} "
          f"parameters, tokenizer files: {', '.join(summary['tokenizer']) or 'none'}")
    _json_line({"from": args.from_hf or args.to_hf, "out": args.out, **summary})
    return 0


def cmd_routing_stats(args: argparse.Namespace) -> int:
    from moe_train.eval.routing_stats import check_out_dir, collect_routing_stats, \
        write_routing_stats
    from moe_train.train.export import load_for_inference
    from moe_train.utils.provenance import finish, provenance

    prov = provenance()
    check_out_dir(args.out, [args.checkpoint, *([args.prepared] if args.prepared else [])])
    with _runtime() as rt:
        inf = load_for_inference(args.checkpoint, rt.device)
        check_out_dir(args.out, [p for p in (inf.source, args.prepared or inf.cfg.data.prepared_dir)
                                 if p])
        dataset = _prepared_split(inf, args.prepared, args.split, raw_text=False)
        stats = collect_routing_stats(inf.model, dataset, inf.manifest, rt, inf.cfg.data.max_tokens,
                                      max_batches=args.max_batches)
        if inf.cfg.moe.extracted_task:  # rows named by the full model's expert ids
            from moe_train.eval.extract import read_experts_kept

            stats.expert_ids = read_experts_kept(inf.source)
    if rt.is_main:
        paths = write_routing_stats(stats, args.out, {
            "checkpoint": str(inf.source), "prepared": str(args.prepared or
                                                            inf.cfg.data.prepared_dir),
            "split": args.split, "max_batches": args.max_batches,
            "provenance": finish(prov)})
        print(f"| wrote {len(paths)} files to {args.out}")
        _json_line({"checkpoint": str(inf.source), "out": str(args.out), "files": len(paths),
                    **stats.summary()})
    return 0


def _check_evaluate_inputs(args: argparse.Namespace) -> None:
    """Raw text (--src with --ref) or a prepared split, and no option of the other: it would be
    ignored (a prepared split has its sentences' own labels). Fills the default --split."""
    raw = {"--src-lang": args.src_lang, "--tgt-lang": args.tgt_lang, "--domain": args.domain}
    prepared = {"--prepared": args.prepared, "--split": args.split}
    if args.src or args.ref:
        if not (args.src and args.ref):
            raise ConfigError("evaluate: --src and --ref go together")
        given = [flag for flag, value in prepared.items() if value is not None]
        if given:
            raise ConfigError(f"evaluate: {' / '.join(given)} name a prepared split; not with "
                              "--src / --ref")
    else:
        given = [flag for flag, value in raw.items() if value is not None]
        if given:
            raise ConfigError(f"evaluate: {' / '.join(given)} label raw text (--src / --ref); "
                              "a prepared split has its sentences' own")
    args.split = args.split or "test"


def _is_stdout(path: str | Path) -> bool:
    """Whether `path` is the file standard output writes to (/dev/stdout, /proc/self/fd/1,
    or the file stdout was redirected to): written there, it would overwrite the output."""
    if os.path.abspath(path) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        return True
    try:
        return os.path.realpath(path) != os.devnull and os.path.samestat(
            os.fstat(sys.stdout.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):  # no such file yet, or no real stdout
        return False


def cmd_evaluate(args: argparse.Namespace) -> int:
    from moe_train.data.corpus import STDIN, read_text_input
    from moe_train.utils.provenance import provenance

    prov = provenance()  # --json's start time and duration cover the whole command
    _check_evaluate_inputs(args)
    if args.src or args.ref:  # raw text is checked before the model loads
        if str(args.src) == str(args.ref) == STDIN:
            raise ConfigError("evaluate: --src and --ref cannot both be standard input (-)")
        (source, src), (_, refs) = read_text_input(args.src), read_text_input(args.ref)
        if len(src) != len(refs):
            raise DataError(f"{args.src}: {len(src)} lines but {args.ref} has {len(refs)}")
    from moe_train.eval.evaluate import evaluate_dataset, format_table
    from moe_train.eval.metrics import corpus_metrics, group_target
    from moe_train.train.export import load_for_inference
    from moe_train.utils.provenance import finish
    from moe_train.utils.atomic import atomic_path, check_out_file, lines_text, write_target

    inputs = {"--src": args.src, "--ref": args.ref, "--checkpoint": args.checkpoint,
              "--prepared": args.prepared}
    for flag, path in (("--hyps", args.hyps), ("--json", args.json)):
        if path == "-" or (path and _is_stdout(path)):  # mixed into the scores printed there
            raise ConfigError(f"{flag}: expected a file path, got {path!r}: standard output "
                              "holds evaluate's scores")
    outputs = {flag: check_out_file(path, flag, inputs)
               for flag, path in (("--hyps", args.hyps), ("--json", args.json)) if path}
    files = [p.resolve() for p in outputs.values() if not write_target(p)[1]]  # not /dev/null
    if len(set(files)) < len(files):
        raise ConfigError("--hyps and --json: expected two different files")
    with _runtime() as rt:
        inf = load_for_inference(args.checkpoint, rt.device)
        if not (args.src or args.prepared):  # the model's own prepared data
            for flag, path in outputs.items():
                check_out_file(path, flag, {"--prepared": inf.cfg.data.prepared_dir})
        ecfg = _eval_config(args, inf.cfg.eval)
        if args.src:
            hyps = translate_raw(inf, args, source, src, ecfg, rt.device)
            tgt = args.tgt_lang or group_target(c["tgt_lang"]
                                                for c in serving(inf)[0].get("corpora", []))
            metrics = {"all": corpus_metrics(hyps, refs, tgt), "domains": {}, "pairs": {}}
            ordered = hyps
            scored = {"src": str(args.src), "ref": str(args.ref)}
        else:
            dataset = _prepared_split(inf, args.prepared, args.split)
            scored = {"prepared": str(args.prepared or inf.cfg.data.prepared_dir),
                      "split": args.split}
            metrics, hyp_map = evaluate_dataset(inf.model, dataset, inf.vocab, inf.manifest, rt,
                                                ecfg, inf.cfg.data.max_tokens, routing=True)
            ordered = [hyp_map[i] for i in sorted(hyp_map)]
    if rt.is_main:
        if metrics["domains"]:
            print(format_table(metrics))
        result = {"checkpoint": str(inf.source), "data": scored, "beam": ecfg.beam,
                  "decoding": {k: getattr(ecfg, k) for k in ("beam", "lenpen", "max_len_a",
                                                              "max_len_b")},
                  **metrics}
        record = {**result, "provenance": finish(prov)}  # the file: where it came from
        texts = {"--hyps": lines_text(ordered),
                 "--json": json.dumps(record, indent=2, sort_keys=True) + "\n"}
        with contextlib.ExitStack() as stack:  # both files are renamed once both are written
            for flag, path in outputs.items():
                stack.enter_context(atomic_path(path)).write_text(texts[flag], encoding="utf-8")
        _json_line(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moe_train.demo import run_demo

    run_demo(Path(args.workdir), minutes=args.minutes, overrides=args.overrides)
    return 0


def cmd_pipeline(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # before the stages' imports: fails fast
    check_dir_settings(cfg, recipe=True)
    from moe_train.parallel.runtime import init_runtime
    from moe_train.stages.common import StageContext
    from moe_train.stages.pipeline import check_request, run_pipeline

    check_request(args.recipe, args.stage)
    rt = init_runtime()
    with _shut_down(rt):
        summary = run_pipeline(StageContext(cfg, rt, rerun_stale=args.rerun_stale),
                               args.recipe, args.stage)
    if rt.is_main:
        _json_line(summary)
    return 0
