"""`moe-train`: Mixture-of-Experts machine translation, from corpus to served sub-network.

User errors (bad config field, bad data line, missing artifact) print one line, ``error: ...``,
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from moe_train.errors import MACHINE_ERRNOS, MoeTrainError, OutOfMemory, PeerFailed
from moe_train.train.preempt import Preempted
from moe_train.eval.limits import MAX_BEAM, MAX_LENPEN
from moe_train.utils.cli_args import (OneLineParser, byte_size, float_in, int_at_least,
                                      non_negative_float, path_text)
from moe_train.utils.std_streams import named_stdout

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
    p.add_argument("--domain", help="domain tag of --src/--tgt (default: default)")
    p.add_argument("--src-lang", help="source language of --src (default: src)")
    p.add_argument("--tgt-lang", help="target language of --tgt (default: tgt)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", help="YAML config whose data section and train.seed (dev/test "
                   "carving, sentencepiece sampling) are used")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("overrides", nargs="*", help="data.key=value (and train.seed=N) overrides")


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
    p.add_argument("--beam", type=int_at_least(1, MAX_BEAM),
                   help="beam size, 1 for greedy (default: the checkpoint's eval.beam)")
    p.add_argument("--lenpen", type=float_in(0.0, MAX_LENPEN),
                   help=f"length penalty (a number from 0 to {MAX_LENPEN:g}; default: the "
                   "checkpoint's eval.lenpen)")
    p.add_argument("--max-sentences", type=int_at_least(1), help="sentences per batch")
    p.add_argument("--long-lines", choices=("error", "truncate"), default="error",
                   help="a raw-text line longer than the model's model.max_positions (in "
                   "subword tokens): error (default) refuses the whole input before anything is "
                   "translated or written, naming the line and the limit (exit status 2); "
                   "truncate translates its first tokens only and warns on stderr")


def _add_raw_labels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src-lang", help="source language of raw text (task routing by pair)")
    p.add_argument("--domain", help="domain of raw text (models routed by domain, e.g. ADPT)")


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate text (files or stdin/stdout)",
                       description="Translate one sentence per line. The whole input is read "
                       "and checked first (UTF-8, not empty, every line within the model's "
                       "model.max_positions unless --long-lines truncate); a bad input is "
                       "refused with one line naming the line, and nothing is written. The "
                       "output, one line per input line, is written when all are translated "
                       "(--output atomically).")
    _add_decode_args(p)
    p.add_argument("--input", default="-", help="source file, - for stdin (UTF-8)")
    p.add_argument("--output", default="-", help="output file, - for stdout")
    p.add_argument("--tgt-lang", help="target language (multilingual models with <2xx> tags)")
    _add_raw_labels(p)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="BLEU/chrF per domain; ends with one JSON line")
    _add_decode_args(p)
    p.add_argument("--prepared", type=path_text,
                   help="prepared data dir (default: the one the model trained on)")
    p.add_argument("--split", help="prepared split to score (default test)")
    p.add_argument("--src", type=path_text, help="raw source file (instead of a prepared split)")
    p.add_argument("--ref", type=path_text, help="raw reference file (with --src)")
    p.add_argument("--tgt-lang", help="target language for --src (multilingual models)")
    _add_raw_labels(p)
    p.add_argument("--hyps", type=path_text, help="write hypotheses here")
    p.add_argument("--json", type=path_text, help="also write the metrics JSON here")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="synthetic corpus -> prepare -> train -> evaluate",
                       description="The embedded default, no download: generates a synthetic "
                       "corpus (3 domains; en->de, en->fr, de->en, fr->en), prepares it, trains a "
                       "small hybrid MoE (token-routed encoder, target-language-routed decoder) "
                       "on CPU, prints BLEU per direction and per domain and the decoder's "
                       "expert x language table, then extracts one direction's sub-network and "
                       "checks that it translates that direction identically.")
    p.add_argument("--workdir", default="demo-work", help="where everything is written")
    p.add_argument("--minutes", type=non_negative_float, default=None,
                   help="training time guard (0: none; the step budget ends training)")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides of the demo recipe")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    from moe_train.data.synthetic import DOMAINS, TARGET_LANGS

    p = sub.add_parser("synth", help="write the synthetic multi-domain corpus (OPUS layout)",
                       description="Write the embedded synthetic corpus (English source; domains "
                       f"{', '.join(DOMAINS)}; targets {', '.join(TARGET_LANGS)}) as "
                       "{domain}/{domain}.{l1}-{l2}.{split}.{lang} files (l1, l2: English and the "
                       "target in alphabetical order, as OPUS names them) plus domains.json, "
                       "ready for `moe-train prepare --data DIR data.pairs=[en-xx]` (without "
                       "pairs each file is read l1 -> l2). The same seed gives the same corpus.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--domains", type=int_at_least(1), default=5,
                   help=f"how many domains, the first N of the list (1..{len(DOMAINS)}; default 5)")
    p.add_argument("--langs", default="de",
                   help="comma-separated target languages (default de)")
    p.add_argument("--train", type=int_at_least(1), default=3000,
                   help="training pairs per domain (default 3000)")
    p.add_argument("--dev", type=int_at_least(0), default=100, help="dev pairs per domain")
    p.add_argument("--test", type=int_at_least(0), default=100, help="test pairs per domain")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing synthetic corpus at --out")
    g = p.add_argument_group("difficulty (defaults: the original corpus)")
    g.add_argument("--preset", choices=("default", "domain-matters"), default="default",
                   help="a named set of the options below (they override it); domain-matters: "
                   "--shared-rate 0.5 --ambiguous 24 --cue-rate 0.95")
    g.add_argument("--shared-rate", type=float, default=None,
                   help="probability that a noun, verb or adjective comes from the shared "
                   "vocabulary (default 0.15 / 0.2 / 0.25)")
    g.add_argument("--ambiguous", type=int, default=None,
                   help="how many shared words translate by domain (0..24 + --shared-words; "
                   "default 4: the four ambiguous nouns, then shared nouns, verbs, adjectives, "
                   "then the extra shared words)")
    g.add_argument("--ambiguous-rate", type=float, default=None,
                   help="probability that a noun is one of the four ambiguous nouns")
    g.add_argument("--cue-rate", type=float, default=None,
                   help="fraction of sentences with a word of their domain's own vocabulary; "
                   "the rest use shared words only (default 1.0)")
    g.add_argument("--shared-words", type=int, default=None,
                   help="extra shared nouns, verbs and adjectives beside the 24 built-in ones "
                   "(0..96; default 0); with --ambiguous up to 24 + N they translate by domain")


def _add_params(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="total, per-side and serving parameter counts",
                       description="Count parameters of the model a config describes (built on "
                       "the meta device, no memory needed); ends with one JSON line.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="YAML config")
    where.add_argument("--checkpoint", help="an export or checkpoint directory (its config and "
                       "vocabulary size; e.g. an extracted sub-network)")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides (with --config)")


def _add_extract(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="a task's sub-network as a standalone export",
                       description="Keep only one task's experts on each task-routed side "
                       "(seed 002): a standalone export that translates that task's inputs "
                       "exactly as the full model does; prints Table 1's parameter columns and "
                       "ends with one JSON line.")
    p.add_argument("--checkpoint", required=True, help="export or checkpoint directory")
    p.add_argument("--task", required=True,
                   help="what the task-routed sides route by, a task the model was trained "
                   "on: a language pair xx-yy, a target (or source) language, a domain name, "
                   "or a task id; sides routing by different sources take one each, "
                   "comma-separated (law,de)")
    p.add_argument("--out", required=True, help="directory of the extracted export")


def _add_average(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="the mean of several checkpoints as one export",
                       description="Average the weights of several checkpoints of one model "
                       "(exports, checkpoint directories, step directories; or the last N "
                       "complete steps of one checkpoint directory) into a standalone export, "
                       "as fairseq's average_checkpoints.py; ends with one JSON line.")
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="export, checkpoint or step directories (with --last: one checkpoint "
                   "directory)")
    p.add_argument("--last", type=int_at_least(2), metavar="N",
                   help="the N newest complete step directories of the one checkpoint "
                   "directory given")
    p.add_argument("--out", required=True, help="directory of the averaged export")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="Hugging Face Qwen2-MoE directory <-> moe_train export",
                       description="--from-hf: a local transformers Qwen2-MoE directory "
                       "(config.json, safetensors, tokenizer files) to a moe_train export whose "
                       "sparse blocks are our MoE layers; --to-hf: a hf_qwen2_moe export or "
                       "checkpoint to a directory transformers loads. Ends with one JSON line.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--from-hf", metavar="DIR", help="transformers model directory")
    where.add_argument("--to-hf", metavar="CHECKPOINT", help="export or checkpoint directory")
    p.add_argument("--out", required=True, help="directory to write")
    to_hf = p.add_argument_group("with --to-hf")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="weights' dtype (default float32: the trained values exactly; "
                       "bfloat16 halves the size, as Qwen's own releases are stored)")
    to_hf.add_argument("--max-shard-size", type=byte_size, default=None, metavar="SIZE",
                       help="largest weights file, e.g. 5GB or 2GiB; more weights go to "
                       "numbered shards with model.safetensors.index.json (default 50GB, as "
                       "transformers' save_pretrained)")
    trim = p.add_argument_group("Trim-MoE (with --from-hf)")
    trim.add_argument("--trim", type=int_at_least(1), metavar="N",
                      help="keep N routed experts per MoE layer (router rows sliced to match)")
    trim.add_argument("--experts", help="the experts to keep, e.g. 0,3,5 (every layer)")
    trim.add_argument("--calibration", metavar="FILE",
                      help="text whose routing picks each layer's N most used experts")
    trim.add_argument("--calibration-lines", type=int_at_least(1), default=2000,
                      help="at most this many calibration lines (default 2000)")
    trim.add_argument("--k", type=int_at_least(1), help="experts per token after trimming "
                      "(default: the model's k, at most N)")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of a training run, and whether it fits",
                       description="Per-GPU bytes for parameters, gradients, optimizer state, "
                       "activations and all-to-all buffers of the model a config describes "
                       "(counted on the meta device), under a ZeRO stage and expert-parallel "
                       "degree; ends with one JSON line.")
    p.add_argument("--config", required=True, help="YAML config")
    p.add_argument("--nodes", type=int_at_least(1), default=1)
    p.add_argument("--gpus-per-node", type=int_at_least(1), default=8)
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80)")
    p.add_argument("--zero", type=int, help="ZeRO stage 0-3 (default: optim.zero_stage)")
    p.add_argument("--ep", type=int_at_least(1), help="expert-parallel degree (default: "
                   "moe.ep_size)")
    p.add_argument("--micro-batch", type=int_at_least(1),
                   help="sequences per GPU (default: data.max_tokens // seq-len)")
    p.add_argument("--seq-len", type=int_at_least(1), help="tokens per sequence (default: "
                   "data.max_len, at most the model's positions)")
    p.add_argument("--target-len", type=int_at_least(1), help="decoder-only: target tokens of "
                   "each sequence, the only ones the LM head and the loss see (default: half of "
                   "seq-len)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="plan with activation checkpointing (default: "
                   "model.activation_checkpointing)")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides")


def _add_routing_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing-stats", help="expert x domain / task tables (CSV) and heatmaps",
                       description="Teacher-forced forwards over a prepared split; per MoE layer "
                       "writes expert x domain, expert x language-pair and expert x target-"
                       "language count tables (CSV), heatmaps (PNG), layers.csv (experts per "
                       "token, candidate usage) and summary.json; for THOR models also expert x "
                       "gold / predicted task and candidate-set tables and task_confusion.csv/.png.")
    p.add_argument("--checkpoint", required=True, help="export, checkpoint or step dir")
    p.add_argument("--prepared", help="prepared data dir (default: the one the model trained on)")
    p.add_argument("--split", default="dev", help="prepared split (default dev)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-batches", type=int_at_least(1),
                   help="at most this many batches per rank (default: the whole split)")


def _rerun_stale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rerun-stale", action="store_true",
                   help="delete and rerun a finished stage made from another config, data or "
                        "inputs (the stages reading it follow); default: stop and name what "
                        "changed")


def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="run a stage-wise recipe (moa, gad) or one of its stages",
                       description="Stage-wise recipes. Each finished stage is reused while it "
                       "was made from the same config, data and inputs; runs alone or under a "
                       "launcher with N ranks.")
    recipes = p.add_subparsers(dest="recipe", required=True)
    r = recipes.add_parser("moa", help="MoA: backbone, features, cluster, distill, adapters, "
                           "evaluate (the stages depend on the adapter router)")
    r.add_argument("--config", required=True, help="YAML config (see configs/moa-*.yaml)")
    r.add_argument("--stage", help="run only this stage (its inputs must exist)")
    _rerun_stale(r)
    r.add_argument("overrides", nargs="*", help="a.b=value overrides, e.g. moa.num_clusters=8")
    r = recipes.add_parser("gad", help="Gated Adapters: backbone (MIX), [tag], classifier, ad, "
                           "gad, evaluate (MIX, TAG, TAG_CLF, AD_ORACLE, AD_CLF, GAD)")
    r.add_argument("--config", required=True, help="YAML config (see configs/gad-*.yaml)")
    r.add_argument("--stage", help="run only this stage (its inputs must exist)")
    _rerun_stale(r)
    r.add_argument("overrides", nargs="*", help="a.b=value overrides, e.g. gated.alpha=1.0")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="moe-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_synth, _add_prepare, _add_train, _add_translate, _add_evaluate, _add_demo,
                _add_params, _add_plan, _add_extract, _add_average, _add_convert,
                _add_routing_stats, _add_pipeline):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `train --config c.yaml --resume a.b=1`: overrides may come after options as well.
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from moe_train import commands

    try:
        with named_stdout():  # a full device is the machine's one-line error, like a file's
            return getattr(commands, f"cmd_{args.command.replace('-', '_')}")(args)
    except MoeTrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (PeerFailed, OutOfMemory) as exc:  # another rank's error line says what went wrong;
        # the machine's memory, not the file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:  # a scheduler's SIGTERM / SIGUSR1: saved, not an error
        print(f"stopped: {exc}", file=sys.stderr)
        return exc.exit_status
    except BrokenPipeError:  # the reader of our output left (`... | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the machine, not the input: a full disk, a read-only mount
        if exc.filename is None or exc.errno not in MACHINE_ERRNOS:
            raise
        print(f"error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
