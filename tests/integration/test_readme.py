"""The README's command blocks stay true to the code.

Every command of every ```bash block is checked: `moe-train` and `python -m moe_train` lines
(also under deepspeed, torchrun, mpirun and srun) parse with the real CLI, and the config each
names loads with its overrides; make targets and the files launch lines name exist. The
synthetic recipe blocks (Gated Adapters, MoA) then run as written, in a scratch directory,
shortened only by options appended to their lines (corpus size, steps), so the documented
sequences work end to end.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import ROOT, run_cli

README = ROOT / "README.md"
MODULE_LAUNCHERS = ("deepspeed", "torchrun", "mpirun", "srun")


def bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, commands) of every ```bash block: continuation lines joined,
    comments and blank lines dropped."""
    blocks, current, start, pending = [], None, 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            if line.strip() == "```bash":
                current, start = [], number + 1
            continue
        if line.strip() == "```":
            blocks.append((start, current))
            current = None
            continue
        code = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        code = (pending + code).strip()
        pending = ""
        if code:
            current.append(code)
    return blocks


def cli_argv(command: str) -> list[str] | None:
    """The moe_train arguments of a command line (the part after a pipe), or None."""
    tokens = shlex.split(command.split("|")[-1])
    if tokens and tokens[0] == "moe-train":
        return tokens[1:]
    if tokens and (tokens[0] in MODULE_LAUNCHERS or tokens[0].endswith("python")):
        if "moe_train" in tokens:
            return tokens[tokens.index("moe_train") + 1:]
    return None


COMMANDS = [(start, c) for start, block in bash_blocks(README.read_text()) for c in block]


def test_the_readme_has_command_blocks():
    assert len(COMMANDS) >= 20
    assert any(c.startswith("moe-train pipeline gad") for _, c in COMMANDS)


@pytest.mark.parametrize("start,command", COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_every_command_parses_and_names_what_exists(start, command):
    from moe_train.cli import build_parser
    from moe_train.config import load_config

    argv = cli_argv(command)
    tokens = shlex.split(command.split("|")[-1])
    if argv is None:
        if tokens[0] == "make":
            targets = re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.M)
            assert tokens[1] in targets, f"README block at line {start}: {command}"
        for token in tokens[1:]:  # launch scripts, hostfiles, sbatch scripts, configs
            if token.startswith(("launch/", "configs/")):
                assert (ROOT / token).exists(), f"README line near {start}: {token} is missing"
        if tokens[0].startswith("launch/"):
            assert (ROOT / tokens[0]).exists()
        return
    args, extra = build_parser().parse_known_args(argv)
    assert not [a for a in extra if a.startswith("-")], f"unknown options in: {command}"
    config = getattr(args, "config", None)
    if config:
        overrides = [*getattr(args, "overrides", []), *extra]
        if args.command == "prepare":
            overrides = [o for o in overrides if o.startswith("data.")]
        load_config(ROOT / config, overrides)


SHORT = {"synth": ["--train", "150", "--dev", "8", "--test", "8"],
         "prepare": ["data.vocab_size=300"]}
"""Options appended to a block's lines: a small corpus, a small vocabulary..."""
PIPELINE_SHORT = {
    "gad": ["train.max_steps=20", "gated.tag_steps=5", "gated.ad_steps=5", "gated.gad_steps=5",
            "gated.classifier_steps=10", "moa.eval_sentences=3", "gated.efficiency_repeats=1"],
    "moa": ["train.max_steps=20", "moa.sample_size=300", "moa.distill_steps=10",
            "moa.adapter_steps=5", "moa.eval_sentences=3"],
}
"""...and a few steps per stage."""


@pytest.mark.parametrize("recipe", sorted(PIPELINE_SHORT))
def test_the_synthetic_recipe_blocks_run_as_written(recipe, tmp_path):
    block = next(b for _, b in bash_blocks(README.read_text())
                 if any(c.startswith(f"moe-train pipeline {recipe}") for c in b))
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    for command in block:
        argv = cli_argv(command)
        assert argv is not None, command
        short = PIPELINE_SHORT[recipe] if argv[0] == "pipeline" else SHORT.get(argv[0], [])
        run_cli([*argv, *short], tmp_path, timeout=600)
    ev = next((tmp_path / "work").glob(f"{recipe}-synthetic/run/evaluate/eval.json"))
    assert ev.is_file() and ev.stat().st_size > 100


def test_the_extraction_block_runs_as_written(tmp_path):
    """The task-level block (extract, params, translate) on a checkpoint where it expects one:
    a tiny configs/opus-m14-token-target-cpu.yaml model trained on a synthetic en<->de/fr
    corpus into work/opus-m14/token-target/checkpoints."""
    block = next(b for _, b in bash_blocks(README.read_text())
                 if any(c.startswith("moe-train extract") for c in b))
    config = "configs/opus-m14-token-target-cpu.yaml"
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    tiny = ["data.pairs=[en-de,de-en,en-fr]", "data.vocab_size=300", "model.d_model=32",
            "model.n_heads=2", "model.ffn_dim=64", "train.max_steps=4", "checkpoint.save_every=4"]
    run_cli(["synth", "--out", "corpus", "--domains", "1", "--langs", "de,fr", "--train", "60",
             "--dev", "4", "--test", "4"], tmp_path)
    run_cli(["prepare", "--config", config, "--data", "corpus", "--out",
             "work/opus-m14/prepared", *tiny], tmp_path)
    run_cli(["train", "--config", config, *tiny], tmp_path)
    test_en = next((tmp_path / "corpus").glob("*/*.de-en.test.en"))
    (tmp_path / "test.en").write_text(test_en.read_text())
    for command in block:
        run_cli(cli_argv(command), tmp_path)
    sub = tmp_path / "work/opus-m14/token-target/en-de"
    assert (sub / "extract.json").is_file()
    assert (tmp_path / "test.de").read_text().count("\n") == 4
