"""A 2-rank run's end stops every thread its process groups started, while Python is whole: a
gloo worker still alive in interpreter finalization can abort the process after a run that
succeeded ("terminate called without an active exception", exit -6, seen once in CI)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, cli_env, debug_overrides

WORKER = str(Path(__file__).with_name("shutdown_worker.py"))
CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def test_training_leaves_no_process_group_threads(tiny_prepared, tmp_path) -> None:
    from moe_train.parallel.runtime import free_port

    port, out = free_port(), tmp_path / "threads"
    args = debug_overrides(tiny_prepared, tmp_path / "w", "moe.num_experts=4", "moe.k=2",
                           "moe.ep_size=2", "data.max_tokens=400", "train.max_steps=2",
                           "train.validate_every=0", "train.bleu_sentences=2")
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(port), str(out), CONFIG,
                               *args], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for rank in (0, 1):
        seen = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert seen["step"] == 2
        # the threads of the finished run's groups are gone: no more than before it started
        assert len(seen["after"]) <= len(seen["before"]), seen
