"""provenance(): commit and dirty flag of the checkout, command, machine, library versions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from moe_train.utils.provenance import (REPO, SOURCE_COMMIT_ENV, finish, git_state,
                                        provenance)

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


@needs_git
def test_git_state_follows_commits_and_edits(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    clean = git_state(tmp_path)
    assert clean["commit"] == _git(tmp_path, "rev-parse", "HEAD")
    assert clean["dirty"] is False and clean["dirty_paths"] == []

    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")
    dirty = git_state(tmp_path)
    assert dirty["commit"] == clean["commit"]
    assert dirty["dirty"] is True
    assert sorted(dirty["dirty_paths"]) == ["a.py", "new.py"]


@needs_git
def test_an_installed_copy_inside_another_checkout_is_not_that_checkout(tmp_path, monkeypatch):
    """Installed under a project's .venv (site-packages), the code is not the enclosing
    checkout's: recorded as no commit, not that project's commit and clean state. Untracked
    files count whatever the git config says."""
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    site = tmp_path / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    state = git_state(site)
    assert state["commit"] is None and "the enclosing checkout is" in state["note"]
    _git(tmp_path, "config", "status.showUntrackedFiles", "no")
    (tmp_path / "patch.py").write_text("")
    assert git_state(tmp_path)["dirty"] is True


def test_not_a_checkout_gives_null_commit_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    state = git_state(tmp_path)
    assert state["commit"] is None and state["dirty"] is None
    assert "not a git checkout" in state["note"]


def test_a_copied_tree_takes_its_commit_from_the_sender(tmp_path, monkeypatch):
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "0123abcd")
    state = git_state(tmp_path)
    assert state["commit"] == "0123abcd" and state["dirty"] is None
    assert "not a git checkout" in state["note"] and SOURCE_COMMIT_ENV in state["note"]


def test_record_names_command_machine_and_libraries():
    prov = provenance(["benchmarks/x.py", "--quick"])
    assert prov["command"][1:] == ["benchmarks/x.py", "--quick"]
    m = prov["machine"]
    assert m["logical_cores"] == os.cpu_count()
    assert m["torch_threads"] == torch.get_num_threads()
    assert len(m["loadavg_1_5_15min_start"]) == 3 and m["cpu_model"]
    assert prov["libraries"]["torch"] == torch.__version__
    assert "python" in prov["libraries"] and "megatron-core" in prov["libraries"]
    if shutil.which("git") and (REPO / ".git").exists():
        assert prov["git"]["commit"] == _git(REPO, "rev-parse", "HEAD")

    done = finish(prov)
    assert len(done["machine"]["loadavg_1_5_15min_end"]) == 3
    assert done["wall_seconds"] >= 0 and done["finished_at"] >= done["started_at"]
    assert json.loads(json.dumps(done)) == done  # plain JSON, nothing else
