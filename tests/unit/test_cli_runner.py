"""The warm-interpreter runner (tests/cli_runner.py) gives what a fresh `python -m moe_train`
gives: exit status, stdout, stderr, files written relative to the working directory, stdin; a
run past its timeout is killed and raises as `subprocess.run` does."""

import subprocess
import time

import pytest

from tests import cli_runner
from tests.conftest import ROOT, cli_env

CASES = {
    "help": (["--help"], b""),
    "bad stdin": (["translate", "--checkpoint", "nowhere", "--beam", "1"], b"\xff\n"),
    "params": (["params", "--config", str(ROOT / "configs" / "debug-cpu.yaml")], b""),
    "config error": (["train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
                      "moe.k=0"], b""),
    "convert error": (["convert", "--from-hf", "nowhere", "--out", "out"], b""),
    "synth": (["synth", "--out", "corpus", "--domains", "1", "--train", "3", "--dev", "1",
               "--test", "1"], b""),
}


def _run(args, cwd, stdin, fresh: bool, monkeypatch) -> tuple:
    monkeypatch.setenv(cli_runner.FRESH_ENV, "1" if fresh else "0")
    proc = cli_runner.run_moe_train(args, cwd, cli_env(), input=stdin, timeout=120)
    files = sorted((str(p.relative_to(cwd)), p.read_bytes()) for p in cwd.rglob("*")
                   if p.is_file())
    return proc.returncode, proc.stdout, proc.stderr, files


@pytest.mark.parametrize("name", list(CASES))
def test_a_forked_run_equals_a_fresh_one(name, tmp_path, monkeypatch):
    args, stdin = CASES[name]
    (tmp_path / "fresh").mkdir()
    (tmp_path / "warm").mkdir()
    fresh = _run(args, tmp_path / "fresh", stdin, True, monkeypatch)
    warm = _run(args, tmp_path / "warm", stdin, False, monkeypatch)
    assert warm == fresh  # also: nothing printed at exit by what the warm one had loaded
    heavy = args[0] in cli_runner.HEAVY_COMMANDS
    assert cli_runner._zygotes[heavy].serves(cli_env())


def test_a_run_past_its_timeout_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        cli_runner.run_moe_train(["synth", "--out", "big", "--train", "100000000"], tmp_path,
                                 cli_env(), timeout=1.0)
    assert time.monotonic() - start < 30
    assert cli_runner._zygotes[False].serves(cli_env())  # still up for the next run


def test_a_changed_usual_environment_gets_a_new_warm_interpreter(tmp_path, monkeypatch):
    cli_runner.run_moe_train(["--help"], tmp_path, cli_env())
    first = cli_runner._zygotes[False]
    monkeypatch.setenv("SOME_LIBRARY_SETTING", "1")  # as a test setting TRITON_INTERPRET does
    proc = cli_runner.run_moe_train(["--help"], tmp_path, cli_env())
    assert proc.returncode == 0 and cli_runner._zygotes[False] is not first
    assert cli_runner._zygotes[False].serves(cli_env()) and not first.serves(cli_env())


@pytest.mark.parametrize("fresh", [False, True])
def test_ranks_share_one_log_and_a_failed_rank_takes_the_others_down(tmp_path, monkeypatch,
                                                                     fresh, tiny_prepared):
    """Two ranks of one job: each appends to the log and sees its RANK; when one dies (here
    killed before the rendezvous), the other, left waiting there, is killed as a launcher
    would, and the job's status is the dead rank's."""
    import signal

    monkeypatch.setenv(cli_runner.FRESH_ENV, "1" if fresh else "0")
    config = str(ROOT / "configs" / "debug-cpu.yaml")
    ranks = cli_runner.Ranks(["params", "--config", config], tmp_path, cli_env(),
                             tmp_path / "params.log")
    assert ranks.wait(120) == 0
    assert ranks.log.read_text().count("total") == 2 * cli_runner.run_moe_train(
        ["params", "--config", config], tmp_path, cli_env(), text=True).stdout.count("total")

    ranks = cli_runner.Ranks(["train", "--config", config, f"data.prepared_dir={tiny_prepared}",
                              f"checkpoint.dir={tmp_path / 'ckpt'}"], tmp_path, cli_env(),
                             tmp_path / "train.log")
    ranks.send_signal(signal.SIGKILL, rank=1)
    assert ranks.wait(120) == -signal.SIGKILL
    assert ranks._statuses() == [-signal.SIGKILL, -signal.SIGKILL]
    assert not (tmp_path / "ckpt").exists()
