"""Bad input everywhere: each case is one real `python -m moe_train ...` run that must fail cleanly.

The table `CASES` lists, per case: the command line, the files to create in the case's own
directory, an optional `breaks` function that damages a copy of one tiny trained checkpoint, the
bytes on stdin, and the words the error must contain. Placeholders in arguments and needles:
{tmp} the case directory, {prepared} the prepared data, {model} the pristine export, {ckpt} the
case's copy of the checkpoint directory, {export} / {step} its export and step directories, plus
what `breaks` returns. Every case must:

* exit with status 2;
* print exactly one line on stderr, ``error: ...``, containing every needle (the file, line or
  field, and what was expected); no ``Traceback`` anywhere;
* leave its directory exactly as it was (no output, partial or complete, no temporary files)
  and, for `translate`, print nothing on stdout.

The cases run as independent subprocesses, a few at a time, in one module fixture.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests.cli_runner import run_moe_train
from tests.conftest import ROOT, cli_env
from tests.integration.checkpoint_damage import (
    dangling_latest, garbage_latest, corrupt_meta, empty_rng_states, text_world_size,
    tensor_rng_states, text_step, no_data_state, list_early_stop, listed_files_not_a_mapping,
    pickled_code_in_model_states, torn_model_states,
    corrupt_weights, no_export_config, corrupt_export_manifest, manifest_without_langs,
    huge_vocab_size, pad_id_past_vocab, integer_weights, smaller_vocab_size, tiny_positions,
    step_dir)

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
MOA_CONFIG = str(ROOT / "configs" / "moa-synthetic.yaml")
THOR_CONFIG = str(ROOT / "configs" / "thor-synthetic-cpu.yaml")
MAX_POSITIONS = 128
TINY_MODEL = ("model.d_model=32", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
              "model.decoder_layers=1", f"model.max_positions={MAX_POSITIONS}",
              "moe.num_experts=2", "moe.k=1")
LONG_LINE = " ".join(["the"] * 4 * MAX_POSITIONS)


def train_args(prepared: Path | str, ckpt: Path | str) -> list[str]:
    """debug-cpu.yaml shrunk to a two-step MoE run writing only `ckpt`."""
    return [f"data.prepared_dir={prepared}", f"checkpoint.dir={ckpt}", "logging.tensorboard_dir=",
            "train.max_steps=2", "train.validate_every=0", "checkpoint.save_every=2",
            *TINY_MODEL]


@pytest.fixture(scope="module")
def trained(tiny_prepared, tmp_path_factory) -> Path:
    """One tiny trained checkpoint directory (step_00000002, latest, export) for every case."""
    ckpt = tmp_path_factory.mktemp("bad_inputs") / "ckpt"
    proc = run_moe_train(["train", "--config", CONFIG, *train_args(tiny_prepared, ckpt)],
                         ckpt.parent, cli_env(), timeout=600, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (ckpt / "latest").is_file() and (ckpt / "export").is_dir()
    return ckpt


# ---------------------------------------------------------------------------------- table


@dataclass
class Case:
    args: list[str]
    needles: tuple[str, ...]
    files: dict[str, bytes | str] = field(default_factory=dict)
    breaks: Callable[[Path], dict] | None = None
    stdin: bytes = b""
    copy_ckpt: bool = False


def train(*extra: str, ckpt: str = "{tmp}/new-ckpt") -> list[str]:
    return ["train", "--config", CONFIG, *train_args("{prepared}", ckpt), *extra]


def resume(*extra: str) -> list[str]:
    return train("--resume", *extra, ckpt="{ckpt}")


def prepare(*extra: str) -> list[str]:
    return ["prepare", "--src", "{tmp}/a.src", "--tgt", "{tmp}/a.tgt", "--out", "{tmp}/out",
            *extra]


def translate(*extra: str, ckpt: str = "{model}") -> list[str]:
    return ["translate", "--checkpoint", ckpt, "--beam", "1", *extra]


def evaluate(*extra: str, ckpt: str = "{model}") -> list[str]:
    return ["evaluate", "--checkpoint", ckpt, "--beam", "1", "--json", "{tmp}/m.json",
            "--hyps", "{tmp}/hyps.txt", *extra]


def routing(*extra: str, ckpt: str = "{model}") -> list[str]:
    return ["routing-stats", "--checkpoint", ckpt, "--out", "{tmp}/stats", *extra]


def pipeline(*extra: str) -> list[str]:
    return ["pipeline", "moa", "--config", MOA_CONFIG, "moa.workdir={tmp}/moa",
            "data.prepared_dir={prepared}", *extra]


PAIR = {"a.src": "a b\nc d\ne f\n", "a.tgt": "x y\nz w\nv u\n"}
IN = translate("--input", "{tmp}/in.txt", "--output", "{tmp}/out.txt")
RAW = evaluate("--src", "{tmp}/src.txt", "--ref", "{tmp}/ref.txt")
ONE = b"a b\n"

CASES: dict[str, Case] = {
    # demo: a bad override fails before the corpus is made
    "demo_k_above_the_experts": Case(["demo", "--workdir", "{tmp}/dm", "moe.num_experts=3",
                                      "moe.k=4"], ("moe.k", "at most moe.num_experts (3)")),
    "demo_pair_outside_its_corpus": Case(["demo", "--workdir", "{tmp}/dm",
                                          "data.pairs=[en-de,en-es]"],
                                         ("data.pairs", "en<->de, en<->fr", "'en-es'")),
    "demo_test_size_override": Case(["demo", "--workdir", "{tmp}/dm", "data.test_per_domain=5"],
                                    ("data.test_per_domain", "its own dev and test sets")),
    "demo_without_its_extracted_direction": Case(["demo", "--workdir", "{tmp}/dm",
                                                  "data.pairs=[de-en,en-fr]"],
                                                 ("data.pairs", "en-de sub-network")),
    "demo_without_a_task_routed_side": Case(["demo", "--workdir", "{tmp}/dm",
                                             "moe.decoder_router=topk"],
                                            ("moe.decoder_router", "route by task")),
    "demo_routing_cannot_name_its_direction": Case(["demo", "--workdir", "{tmp}/dm",
                                                    "moe.decoder_task_source=domain"],
                                                   ("moe.decoder_task_source",
                                                    "en-de sub-network", "routes by domain")),
    # synth
    "synth_unknown_language": Case(["synth", "--out", "{tmp}/c", "--langs", "de,xx"],
                                   ("--langs", "de, fr, es, cs, ja", "xx")),
    "synth_too_many_domains": Case(["synth", "--out", "{tmp}/c", "--domains", "9"],
                                   ("--domains", "1..7", "9")),
    "synth_negative_split": Case(["synth", "--out", "{tmp}/c", "--dev", "-1"],
                                 ("--dev", "integer >= 0", "-1")),
    "synth_out_is_not_a_corpus": Case(["synth", "--out", "{tmp}/c", "--overwrite"],
                                      ("{tmp}/c", "domains.json", "refusing"),
                                      {"c/notes.txt": "mine\n"}),
    "synth_corpus_exists": Case(["synth", "--out", "{tmp}/c"], ("{tmp}/c", "--overwrite"),
                                {"c/domains.json": "{}\n"}),
    # prepare
    "prepare_non_utf8_line": Case(prepare(), ("{tmp}/a.src:2", "UTF-8"),
                                  {**PAIR, "a.src": b"a b\nc \xff d\ne f\n"}),
    "prepare_line_counts_differ": Case(prepare(), ("{tmp}/a.src", "3 lines", "{tmp}/a.tgt"),
                                       {**PAIR, "a.tgt": "x y\nz w\n"}),
    "prepare_out_under_a_file": Case(prepare("--out", "{tmp}/file/out"),
                                     ("--out {tmp}/file/out", "{tmp}/file is not a directory"),
                                     {**PAIR, "file": "x"}),
    "prepare_empty_file": Case(prepare(), ("{tmp}/a.src", "empty"), {**PAIR, "a.src": ""}),
    "prepare_line_too_long": Case(prepare("data.max_chars=5"),
                                  ("{tmp}/a.tgt:2", "data.max_chars=5"),
                                  {**PAIR, "a.tgt": "x y\nz w w w w w\nv u\n"}),
    "prepare_missing_config": Case(prepare("--config", "{tmp}/nope.yaml"),
                                   ("nope.yaml", "not found"), PAIR),
    "prepare_bad_override_value": Case(prepare("data.vocab_size=many"),
                                       ("data.vocab_size", "integer", "many"), PAIR),
    "prepare_missing_data_dir": Case(["prepare", "--data", "{tmp}/corpora", "--out", "{tmp}/out"],
                                     ("{tmp}/corpora", "not found")),
    "prepare_data_with_plain_options": Case(
        ["prepare", "--data", "{tmp}/corpora", "--tgt-lang", "de", "--domain", "law", "--out",
         "{tmp}/out"], ("--domain, --tgt-lang", "go with --src FILE, not --data DIR")),
    "prepare_over_other_files": Case(prepare(), ("{tmp}/out", "holds no manifest.json"),
                                     {**PAIR, "out/mine.txt": "not prepared data\n"}),
    # train: config
    "train_missing_config": Case(["train", "--config", "{tmp}/nope.yaml"],
                                 ("{tmp}/nope.yaml", "not found")),
    "train_unknown_yaml_field": Case(["train", "--config", "{tmp}/x.yaml"],
                                     ("{tmp}/x.yaml", "model.colour", "unknown field"),
                                     {"x.yaml": f"extends: {CONFIG}\nmodel:\n  colour: blue\n"}),
    "train_yaml_syntax_error": Case(["train", "--config", "{tmp}/x.yaml"], ("{tmp}/x.yaml:3",),
                                    {"x.yaml": "model:\n  d_model: 64\n   n_heads: [4\n"}),
    "train_override_unknown_key": Case(train("optim.lrr=1e-3"),
                                       ("override optim.lrr=1e-3", "unknown field")),
    "train_override_bad_value": Case(train("optim.lr=fast"),
                                     ("optim.lr", "expected a number", "fast")),
    "train_override_without_equals": Case(train("optim.lr"), ("optim.lr", "key.sub=value")),
    "train_override_empty_key_part": Case(train("optim..lr=1"), ("optim..lr", "key.sub=value")),
    "train_experts_not_divisible": Case(train("moe.num_experts=3", "moe.ep_size=2"),
                                        ("moe.num_experts", "multiple of moe.ep_size (2)")),
    "train_unknown_router": Case(train("moe.encoder_router=bogus"),
                                 ("moe.encoder_router", "bogus", "topk")),
    "train_missing_prepared_dir": Case(train("data.prepared_dir={tmp}/unprepared"),
                                       ("{tmp}/unprepared", "moe-train prepare")),
    "train_max_positions_below_data": Case(train("model.max_positions=8"),
                                           ("model.max_positions", "got 8", "{prepared}")),
    "train_bad_deepspeed_json": Case(train("--deepspeed-config", "{tmp}/ds.json"),
                                     ("{tmp}/ds.json", "JSON"),
                                     {"ds.json": '{"train_batch_size": '}),
    "train_deepspeed_json_sets_the_batch": Case(train("--deepspeed-config", "{tmp}/ds.json"),
                                                ("{tmp}/ds.json", "train_batch_size",
                                                 "optim.grad_accum", "got 7"),
                                                {"ds.json": '{"train_batch_size": 7}'}),
    "train_deepspeed_override_sets_clipping": Case(train("deepspeed.gradient_clipping=x"),
                                                   ("deepspeed.gradient_clipping",
                                                    "optim.clip_norm", "'x'")),
    "train_missing_deepspeed_json": Case(train("--deepspeed-config", "{tmp}/ds.json"),
                                         ("{tmp}/ds.json",)),
    "train_checkpoint_dir_is_a_file": Case(train(ckpt="{tmp}/ck"),
                                           ("checkpoint.dir", "{tmp}/ck", "not a directory"),
                                           {"ck": "x"}),
    "train_deepspeed_config_not_an_object": Case(train("--deepspeed-config", "{tmp}/ds.json"),
                                                 ("{tmp}/ds.json", "JSON object", "list"),
                                                 {"ds.json": "[1, 2]"}),
    # train: checkpoints
    "train_existing_checkpoint_without_resume": Case(train(ckpt="{ckpt}"), ("{ckpt}", "--resume"),
                                                     copy_ckpt=True),
    "train_resume_other_architecture": Case(resume("model.d_model=64"),
                                            ("model.d_model", "32", "64"), copy_ckpt=True),
    "train_resume_dangling_latest": Case(resume(), ("{ckpt}/latest", "step_00000099"),
                                         breaks=dangling_latest),
    "train_resume_garbage_latest": Case(resume(), ("{ckpt}/latest",), breaks=garbage_latest),
    "train_resume_empty_rng_states": Case(resume(), ("{step}/rng_rank0.pt", "RNG states"),
                                          breaks=empty_rng_states),
    "train_resume_text_world_size": Case(resume(), ("{step}", "world_size"),
                                         breaks=text_world_size),
    "train_resume_corrupt_meta": Case(resume(), ("{ckpt}", "meta.json"), breaks=corrupt_meta),
    "train_resume_tensor_rng_states": Case(resume(), ("{step}/rng_rank0.pt", "RNG states"),
                                           breaks=tensor_rng_states),
    "train_resume_text_step": Case(resume(), ("{ckpt}/latest", "meta.json: 'step' is '2'",
                                              "expected a step number"), breaks=text_step),
    "train_resume_no_data_state": Case(resume(), ("{step}/meta.json", "'data_state' is None"),
                                       breaks=no_data_state),
    "train_resume_list_early_stop": Case(resume(), ("{step}/meta.json", "'early_stop' is [1]"),
                                         breaks=list_early_stop),
    "train_resume_listed_files_not_a_mapping": Case(
        resume(), ("{ckpt}/latest", "complete.json is unreadable", "map file names to sizes"),
        breaks=listed_files_not_a_mapping),
    "train_resume_pickled_code": Case(
        resume(), ("{step}/mp_rank_00_model_states.pt", "refused by weights-only loading",
                   "posix.getpid"), breaks=pickled_code_in_model_states),
    "train_init_from_missing": Case(train("train.init_from={tmp}/none"),
                                    ("train.init_from", "{tmp}/none", "not found")),
    "train_init_from_other_shape": Case(train("train.init_from={model}", "model.ffn_dim=48"),
                                        ("train.init_from", "{model}", "of other shape",
                                         "expected weights of the same architecture")),
    # translate
    "translate_non_utf8_stdin": Case(translate(), ("<stdin>:2", "UTF-8"),
                                     stdin=b"a b\nc \xe9 d\ne f\n"),
    "translate_non_utf8_file": Case(IN, ("{tmp}/in.txt:3", "UTF-8"),
                                    {"in.txt": b"a b\nc d\n\xc3\x28 e\n"}),
    "translate_long_line_file": Case(IN, ("{tmp}/in.txt:3", f"max_positions={MAX_POSITIONS}",
                                          "nothing was translated", "--long-lines"),
                                     {"in.txt": f"a b\nc d\n{LONG_LINE}\ne f\n"}),
    "translate_long_line_stdin": Case(translate(), ("<stdin>:2", f"max_positions={MAX_POSITIONS}"),
                                      stdin=f"a b\n{LONG_LINE}\n".encode()),
    "translate_empty_file": Case(IN, ("{tmp}/in.txt", "empty"), {"in.txt": ""}),
    "translate_empty_stdin": Case(translate(), ("<stdin>", "empty")),
    "translate_missing_input": Case(IN, ("{tmp}/in.txt", "not found")),
    "translate_export_without_config": Case(translate(ckpt="{export}"), ("{export}",
                                            "config.json"), breaks=no_export_config, stdin=ONE),
    "translate_corrupt_weights": Case(translate(ckpt="{export}"), ("{weights}",),
                                      breaks=corrupt_weights, stdin=ONE),
    "translate_corrupt_export_manifest": Case(translate(ckpt="{export}"),
                                              ("{export}/manifest.json",),
                                              breaks=corrupt_export_manifest, stdin=ONE),
    "translate_dangling_latest": Case(translate(ckpt="{ckpt}"), ("{ckpt}/latest",
                                      "step_00000099"), breaks=dangling_latest, stdin=ONE),
    "translate_corrupt_meta": Case(translate(ckpt="{step}"), ("{step}/meta.json",),
                                   breaks=corrupt_meta, stdin=ONE),
    "translate_torn_step": Case(translate(ckpt="{step}"),
                                ("{step}: not a complete checkpoint",
                                 "mp_rank_00_model_states.pt has 100 bytes"),
                                breaks=torn_model_states, stdin=ONE),
    "translate_manifest_without_langs": Case(translate(ckpt="{export}"),
                                             ("{export}/manifest.json", "'langs'"),
                                             breaks=manifest_without_langs, stdin=ONE),
    "translate_huge_manifest_vocab": Case(translate(ckpt="{export}"),
                                          ("{export}/model.safetensors", "of other shape"),
                                          breaks=huge_vocab_size, stdin=ONE),
    "translate_pad_id_past_vocab": Case(translate(ckpt="{export}"),
                                        ("{export}", "'pad_id'", "below vocab_size"),
                                        breaks=pad_id_past_vocab, stdin=ONE),
    "translate_integer_weights": Case(translate(ckpt="{export}"),
                                      ("{export}/model.safetensors", "not floating-point",
                                       "{name} torch.int64"),
                                      breaks=integer_weights, stdin=ONE),
    "translate_tokenizer_larger_than_model": Case(translate(ckpt="{export}"),
                                                  ("{export}", "tokenizer", "vocab_size"),
                                                  breaks=smaller_vocab_size, stdin=ONE),
    # Output paths are checked before the model loads, not after the whole decode.
    "translate_output_is_a_directory": Case(
        translate("--input", "{tmp}/in.txt", "--output", "{tmp}/o"),
        ("--output {tmp}/o", "is a directory"), {"in.txt": ONE, "o/mine.txt": "mine\n"}),
    "translate_output_under_a_file": Case(
        translate("--input", "{tmp}/in.txt", "--output", "{tmp}/f/out.txt"),
        ("--output {tmp}/f/out.txt", "{tmp}/f is not a directory"), {"in.txt": ONE, "f": "x"}),
    "translate_zero_max_sentences": Case(translate("--max-sentences", "0"),
                                         ("--max-sentences", "positive"), stdin=ONE),
    "translate_unknown_option": Case(translate("--bem", "4"), ("--bem", "unrecognized"),
                                     stdin=ONE),
    "translate_unknown_target_language": Case(translate("--tgt-lang", "fr"),
                                              ("--tgt-lang", "'fr'", "de"), stdin=ONE),
    "translate_infinite_lenpen": Case(translate("--lenpen", "inf"), ("--lenpen", "inf")),
    "translate_lenpen_above_ten": Case(translate("--lenpen", "11"), ("--lenpen", "from 0 to 10")),
    "translate_huge_beam": Case(translate("--beam", "100000"),
                                ("--beam", "from 1 to 1024", "100000")),
    "translate_unknown_domain": Case(translate("--domain", "cooking"), ("--domain", "cooking"),
                                     stdin=ONE),
    # evaluate
    "evaluate_line_counts_differ": Case(RAW, ("{tmp}/src.txt", "2 lines", "{tmp}/ref.txt"),
                                        {"src.txt": "a b\nc d\n", "ref.txt": "x y\n"}),
    "evaluate_hyps_over_the_ref": Case([*RAW, "--hyps", "{tmp}/ref.txt"],
                                       ("--hyps {tmp}/ref.txt", "--ref input"),
                                       {"src.txt": "a b\n", "ref.txt": "x y\n"}),
    "evaluate_hyps_and_json_one_file": Case([*RAW, "--hyps", "{tmp}/./m.json"],
                                            ("--hyps and --json", "two different files"),
                                            {"src.txt": "a b\n", "ref.txt": "x y\n"}),
    "translate_output_over_the_input": Case(translate("--input", "{tmp}/in.txt", "--output",
                                                      "{tmp}/./in.txt"),
                                            ("--output {tmp}/in.txt", "--input input"),
                                            {"in.txt": ONE}),
    "evaluate_json_over_the_prepared_manifest": Case(
        evaluate("--prepared", "{tmp}/prep", "--json", "{tmp}/prep/manifest.json"),
        ("--json {tmp}/prep/manifest.json", "a file of the --prepared input"),
        {"prep/manifest.json": "{}"}),
    "evaluate_src_and_ref_both_stdin": Case(evaluate("--src", "-", "--ref", "-"),
                                            ("--src and --ref", "standard input"),
                                            stdin=b"a b\n"),
    "evaluate_src_without_ref": Case(evaluate("--src", "{tmp}/src.txt"), ("--src", "--ref"),
                                     {"src.txt": "a b\n"}),
    "evaluate_non_utf8_ref": Case(RAW, ("{tmp}/ref.txt:2", "UTF-8"),
                                  {"src.txt": "a b\nc d\n", "ref.txt": b"x y\n\xffz w\n"}),
    "evaluate_prepared_manifest_is_a_list": Case(evaluate("--prepared", "{tmp}/prep"),
                                                 ("{tmp}/prep/manifest.json", "moe-train prepare"),
                                                 {"prep/manifest.json": "[1, 2]"}),
    "evaluate_missing_prepared": Case(evaluate("--prepared", "{tmp}/prep"),
                                      ("{tmp}/prep", "moe-train prepare")),
    "evaluate_unknown_split": Case(evaluate("--prepared", "{prepared}", "--split", "valid"),
                                   ("valid", "test")),
    "evaluate_split_longer_than_model": Case(evaluate("--prepared", "{prepared}",
                                                      ckpt="{export}"),
                                             ("{prepared}/test", "model.max_positions=8"),
                                             breaks=tiny_positions),
    "evaluate_garbage_latest": Case(evaluate(ckpt="{ckpt}"), ("{ckpt}/latest",),
                                    breaks=garbage_latest),
    "evaluate_corrupt_weights": Case(evaluate(ckpt="{export}"), ("{weights}",),
                                     breaks=corrupt_weights),
    "evaluate_json_is_a_directory": Case(evaluate(), ("--json {tmp}/m.json", "is a directory"),
                                         {"m.json/mine.txt": "mine\n"}),
    # extract / convert never replace what is not their own earlier output, nor their input
    "extract_out_holds_other_files": Case(
        ["extract", "--checkpoint", "{model}", "--task", "en-de", "--out", "{tmp}/out"],
        ("--out {tmp}/out", "extract.json", "refusing"), {"out/notes.txt": "mine\n"}),
    "extract_out_is_prepared_data": Case(
        ["extract", "--checkpoint", "{model}", "--task", "en-de", "--out", "{tmp}/p"],
        ("--out {tmp}/p", "extract.json", "refusing"), {"p/manifest.json": "{}\n"}),
    "extract_out_is_the_checkpoint": Case(
        ["extract", "--checkpoint", "{ckpt}", "--task", "en-de", "--out", "{ckpt}"],
        ("--out {ckpt}", "is or contains the input"), copy_ckpt=True),
    "extract_out_above_the_checkpoint": Case(
        ["extract", "--checkpoint", "{export}", "--task", "en-de", "--out", "{tmp}"],
        ("--out {tmp}", "is or contains the input"), copy_ckpt=True),
    "convert_out_is_the_source": Case(
        ["convert", "--from-hf", "{tmp}/hf", "--out", "{tmp}/hf"],
        ("--out {tmp}/hf", "is or contains the input"), {"hf/config.json": "{}"}),
    "convert_experts_without_trim": Case(
        ["convert", "--from-hf", "{tmp}/hf", "--out", "{tmp}/o", "--experts", "0,1"],
        ("--experts", "--trim N"), {"hf/config.json": "{}"}),
    # routing-stats
    "routing_stats_out_holds_other_files": Case(routing(), ("--out", "{tmp}/stats", "refusing"),
                                                {"stats/notes.txt": "mine\n"}),
    # a summary.json of something else (it was taken for an earlier output, and the whole
    # directory replaced), and a directory holding the model itself
    "routing_stats_out_holds_a_foreign_summary": Case(
        routing(), ("--out {tmp}/stats", "summary.json was not written by routing-stats"),
        {"stats/summary.json": '{"bleu": 31}', "stats/notes.txt": "mine\n"}),
    "routing_stats_out_holds_the_checkpoint": Case(
        ["routing-stats", "--checkpoint", "{ckpt}", "--out", "{tmp}"],
        ("--out {tmp}", "contains the input {ckpt}"),
        {"summary.json": '{"written_by": "moe-train routing-stats"}'}, copy_ckpt=True),
    "routing_stats_missing_checkpoint": Case(routing(ckpt="{tmp}/nowhere"), ("{tmp}/nowhere",)),
    "routing_stats_missing_prepared": Case(routing("--prepared", "{tmp}/prep"), ("{tmp}/prep",)),
    "routing_stats_zero_max_batches": Case(routing("--max-batches", "0"),
                                           ("--max-batches", "a positive integer", "'0'")),
    # params
    "params_missing_config": Case(["params", "--config", "{tmp}/nope.yaml"],
                                  ("nope.yaml", "not found")),
    "params_unknown_router": Case(["params", "--config", CONFIG, "moe.num_experts=4",
                                   "moe.decoder_router=top2"], ("moe.decoder_router", "top2")),
    "params_thor_without_num_tasks": Case(["params", "--config", THOR_CONFIG,
                                           "thor.num_tasks=0"], ("thor.num_tasks",)),
    "params_thor_candidates_over_experts": Case(
        ["params", "--config", THOR_CONFIG, "thor.num_candidates=9"],
        ("thor.num_candidates", "at most the encoder's experts (8)")),
    "params_thor_bad_task_repr": Case(
        ["params", "--config", THOR_CONFIG, "thor.task_repr=soft"],
        ("thor.task_repr", "mixed, argmax, gold, infuse")),
    "params_experts_not_divisible": Case(["params", "--config", CONFIG, "moe.num_experts=6",
                                          "moe.ep_size=4"], ("moe.num_experts", "moe.ep_size")),
    # pipeline
    "pipeline_workdir_is_a_file": Case(pipeline(), ("moa.workdir", "{tmp}/moa",
                                                    "not a directory"), {"moa": "x"}),
    "pipeline_stage_before_inputs": Case(pipeline("--stage", "distill"),
                                         ("stage distill", "--stage features")),
    "pipeline_unknown_stage": Case(pipeline("--stage", "finetune"),
                                   ("--stage", "finetune", "distill")),
    "pipeline_unknown_adapter_router": Case(pipeline("adapters.router=bogus"),
                                            ("adapters.router", "bogus")),
    "pipeline_unknown_yaml_field": Case(pipeline("moa.clusters=3"),
                                        ("moa.clusters", "unknown field")),
}


# ---------------------------------------------------------------------------------- runner


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@dataclass
class Outcome:
    proc: subprocess.CompletedProcess
    needles: list[str]
    changed: bool
    """Whether the case directory differs after the run (output or temporary files left)."""
    seconds: float
    """Wall time of the run (printed, to keep the cases cheap; not asserted)."""


def _run_case(case: Case, tmp: Path, prepared: Path, trained: Path) -> Outcome:
    values = {"tmp": str(tmp), "prepared": str(prepared), "model": str(trained / "export")}
    for name, data in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    if case.copy_ckpt or case.breaks is not None:
        ckpt = tmp / "ckpt"
        shutil.copytree(trained, ckpt)
        values |= {"ckpt": str(ckpt), "export": str(ckpt / "export"), "step": str(step_dir(ckpt))}
        if case.breaks is not None:
            values |= case.breaks(ckpt)
    before = _snapshot(tmp)
    start = time.perf_counter()
    proc = run_moe_train([_fill(a, values) for a in case.args], tmp, cli_env(),
                         input=case.stdin, timeout=300)
    return Outcome(proc, [_fill(n, values) for n in case.needles], _snapshot(tmp) != before,
                   time.perf_counter() - start)


@pytest.fixture(scope="module")
def outcomes(request, trained, tiny_prepared, tmp_path_factory) -> dict[str, Outcome]:
    """Every selected case, each in its own directory, run a few at a time."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_bad_input"
                and item.module is request.module]  # another file may use the name
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 1))) as pool:
        futures = {}
        for name in selected:
            (root / name).mkdir()
            futures[name] = pool.submit(_run_case, CASES[name], root / name, tiny_prepared,
                                        trained)
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, outcomes):
    out = outcomes[name]
    print(f"{name}: {out.seconds:.1f}s")
    stdout = out.proc.stdout.decode("utf-8", "replace")
    stderr = out.proc.stderr.decode("utf-8", "replace")
    shown = f"exit {out.proc.returncode}\nstdout: {stdout[-1500:]}\nstderr: {stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr, shown
    assert out.proc.returncode == 2, shown
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    for needle in out.needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    assert not out.changed, "the failed run left files behind or changed its inputs"
    if CASES[name].args[0] == "translate":
        assert stdout == "", shown


def test_long_lines_truncate_translates_every_line(trained, tmp_path):
    """The documented alternative to refusing: --long-lines truncate warns and translates."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text(f"a b\n{LONG_LINE}\nc d\n")
    args = translate("--input", str(src), "--output", str(out), "--long-lines", "truncate",
                     ckpt=str(trained / "export"))
    proc = run_moe_train(args, tmp_path, cli_env(), timeout=300, text=True)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and f"{src}:2" in warnings[0], proc.stderr
    assert f"model.max_positions={MAX_POSITIONS}" in warnings[0]
    assert len(out.read_text().splitlines()) == 3


def test_router_names_match_registry():
    from moe_train.config.moe import ROUTER_NAMES
    from moe_train.moe.registry import ROUTERS

    assert sorted(ROUTER_NAMES) == sorted(ROUTERS)


def test_every_command_has_cases():
    commands = {case.args[0] for case in CASES.values()}
    assert len(CASES) >= 20
    assert commands == {"demo", "synth", "prepare", "train", "translate", "evaluate",
                        "routing-stats", "params", "pipeline", "extract", "convert"}
