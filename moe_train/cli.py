"""`moe-train`: prepare, train, translate, evaluate, demo.

User errors (bad config field, bad data line, missing artifact) print one line, ``error: ...``,
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import re
import sys

from moe_train.errors import MoeTrainError

_LOCAL_RANK_RE = re.compile(r"^--local[_-]rank(=\d+)?$")


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` the deepspeed launcher inserts (LOCAL_RANK is in the env too)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if _LOCAL_RANK_RE.match(arg):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="validate corpora, train sentencepiece, binarize shards",
                       description="Validate corpora, train a joint sentencepiece model and write "
                       "memory-mapped shards (train/dev/test; dev and test are carved from train "
                       "when the data has none).")
    p.add_argument("--data", help="OPUS-like directory {domain}/{domain}.{l1}-{l2}.{split}.{lang}")
    p.add_argument("--src", help="plain source file (instead of --data)")
    p.add_argument("--tgt", help="plain target file (with --src)")
    p.add_argument("--domain", default="default", help="domain tag of --src/--tgt")
    p.add_argument("--src-lang", default="src", help="source language of --src")
    p.add_argument("--tgt-lang", default="tgt", help="target language of --tgt")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", help="YAML config whose data section is used")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("overrides", nargs="*", help="data.key=value overrides")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on a DeepSpeed engine",
                       description="Train. Runs alone (one process), under `deepspeed`, torchrun "
                       "or mpirun.")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--deepspeed-config", help="DeepSpeed JSON merged over the generated one")
    p.add_argument("--resume", action="store_true", help="continue from checkpoint.dir/latest")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides, e.g. optim.lr=5e-4")


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="export dir, training checkpoint dir (uses latest) or step dir")
    p.add_argument("--beam", type=int, help="beam size (default: the checkpoint's eval.beam)")
    p.add_argument("--lenpen", type=float, help="length penalty")
    p.add_argument("--max-sentences", type=int, help="sentences per batch")


def _add_raw_labels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src-lang", help="source language of raw text (task routing by pair)")
    p.add_argument("--domain", help="domain of raw text (models routed by domain, e.g. ADPT)")


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate text (files or stdin/stdout)")
    _add_decode_args(p)
    p.add_argument("--input", default="-", help="source file, - for stdin")
    p.add_argument("--output", default="-", help="output file, - for stdout")
    p.add_argument("--tgt-lang", help="target language (multilingual models with <2xx> tags)")
    _add_raw_labels(p)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="BLEU/chrF per domain; ends with one JSON line")
    _add_decode_args(p)
    p.add_argument("--prepared", help="prepared data dir (default: the one the model trained on)")
    p.add_argument("--split", default="test", help="prepared split to score (default test)")
    p.add_argument("--src", help="raw source file (instead of a prepared split)")
    p.add_argument("--ref", help="raw reference file (with --src)")
    p.add_argument("--tgt-lang", help="target language for --src (multilingual models)")
    _add_raw_labels(p)
    p.add_argument("--hyps", help="write hypotheses here")
    p.add_argument("--json", help="also write the metrics JSON here")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="synthetic corpus -> prepare -> train -> evaluate",
                       description="The embedded default: generates a 5-domain synthetic corpus, "
                       "prepares it, trains a small Transformer on CPU and prints per-domain BLEU.")
    p.add_argument("--workdir", default="demo-work", help="where everything is written")
    p.add_argument("--minutes", type=float, default=None, help="training time budget")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides of the demo recipe")


def _add_params(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="total, per-side and serving parameter counts",
                       description="Count parameters of the model a config describes (built on "
                       "the meta device, no memory needed); ends with one JSON line.")
    p.add_argument("--config", required=True, help="YAML config")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides")


def _add_routing_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing-stats", help="expert x domain / task tables (CSV) and heatmaps",
                       description="Teacher-forced forwards over a prepared split; per MoE layer "
                       "writes expert x domain, expert x language-pair and expert x target-"
                       "language count tables (CSV), heatmaps (PNG) and summary.json.")
    p.add_argument("--checkpoint", required=True, help="export, checkpoint or step dir")
    p.add_argument("--prepared", help="prepared data dir (default: the one the model trained on)")
    p.add_argument("--split", default="dev", help="prepared split (default dev)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-batches", type=int, help="at most this many batches per rank")


def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="run a stage-wise recipe (moa) or one of its stages",
                       description="Stage-wise recipes. Each finished stage is reused; runs "
                       "alone or under a launcher with N ranks.")
    recipes = p.add_subparsers(dest="recipe", required=True)
    r = recipes.add_parser("moa", help="MoA: backbone, features, cluster, distill, adapters, "
                           "evaluate (the stages depend on the adapter router)")
    r.add_argument("--config", required=True, help="YAML config (see configs/moa-*.yaml)")
    r.add_argument("--stage", help="run only this stage (its inputs must exist)")
    r.add_argument("overrides", nargs="*", help="a.b=value overrides, e.g. moa.num_clusters=8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_prepare, _add_train, _add_translate, _add_evaluate, _add_demo, _add_params,
                _add_routing_stats, _add_pipeline):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    from moe_train import commands

    try:
        return getattr(commands, f"cmd_{args.command.replace('-', '_')}")(args)
    except MoeTrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
