"""`evaluate` and `routing-stats` under a launcher shut their process group down at the end:
after waiting for the peers when the work succeeded, without waiting when this rank failed (a
peer may be inside a collective, where a barrier would hang both)."""

import os
from types import SimpleNamespace

import pytest

import moe_train.parallel.runtime as runtime
from moe_train.commands import _runtime
from tests.conftest import launcher_var


@pytest.fixture
def launched(monkeypatch):
    calls = []
    rt = runtime.ParallelRuntime(rank=0, world_size=2, backend="gloo")
    monkeypatch.setattr(runtime, "detect_launch", lambda env: SimpleNamespace(multi_process=True))
    monkeypatch.setattr(runtime, "init_runtime", lambda: calls.append("init") or rt)
    monkeypatch.setattr(runtime, "shutdown",
                        lambda r, barrier=True: calls.append(("shutdown", r is rt, barrier)))
    return calls


def test_a_launched_command_waits_for_its_peers_then_shuts_down(launched) -> None:
    with _runtime() as rt:
        assert rt.world_size == 2 and launched == ["init"]
    assert launched == ["init", ("shutdown", True, True)]


def test_a_failed_rank_shuts_down_without_waiting_and_keeps_its_error(launched) -> None:
    with pytest.raises(KeyError, match="boom"), _runtime():
        raise KeyError("boom")
    assert launched == ["init", ("shutdown", True, False)]


def test_without_a_launcher_there_is_no_process_group(monkeypatch) -> None:
    # an in-process single-rank run of another test in this worker may have left RANK & co.
    for name in [n for n in os.environ if launcher_var(n)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(runtime, "init_runtime", lambda: pytest.fail("no process group expected"))
    monkeypatch.setattr(runtime, "shutdown", lambda *a, **k: pytest.fail("nothing to shut down"))
    with _runtime() as rt:
        assert not rt.distributed and rt.world_size == 1
