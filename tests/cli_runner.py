"""`python -m moe_train ARGS` for the tests, forked from a warm interpreter (tests/zygote.py).

`run_moe_train` returns what `subprocess.run(..., capture_output=True)` would. The run is a real
process with its own exit status, stdin, stdout, stderr and working directory; it saves the ~3 s
of CPU that importing torch costs a fresh interpreter. `Ranks` starts the ranks of one job the
same way, with the variables a launcher sets (the deepspeed launcher's own two processes cost
another ~7 s of CPU a job). A run whose environment differs from the warm interpreter's in more
than the project's own MOE_TRAIN_* variables, a launcher's rank variables and pytest's (torch
and the OpenMP runtime read theirs when loaded) starts a fresh interpreter instead, and so does
every run when MOE_TRAIN_TEST_FRESH_PROCESSES=1.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")
FRESH_ENV = "MOE_TRAIN_TEST_FRESH_PROCESSES"


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _settable(name: str) -> bool:
    """Variables a run may set differently from the warm interpreter: ours and a launcher's
    rank variables, read at run time, and pytest's (PYTEST_CURRENT_TEST names each test)."""
    return name.startswith(("MOE_TRAIN_", "PYTEST_")) or name in RANK_VARS


class _Zygote:
    """One warm interpreter per test process; thread-safe."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env = {k: v for k, v in env.items() if not _settable(k)}
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), *preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.waiting: dict[int, dict] = {}  # id -> {"started", "pid", "event", "status"}
        threading.Thread(target=self._read, daemon=True).start()

    def serves(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and \
            {k: v for k, v in env.items() if not _settable(k)} == self.env

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.lock:
                slot = self.waiting[reply["id"]]
                slot.update(reply)
                if "status" in reply:
                    del self.waiting[reply["id"]]
                    slot["event"].set()
                else:
                    slot["started"].set()
        with self.lock:  # it ended: nothing more will come for the runs still waiting
            for slot in self.waiting.values():
                slot.setdefault("status", None)
                slot["started"].set()
                slot["event"].set()

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], files: dict[str, str],
              append: bool = False, script: str | None = None) -> dict:
        """Fork a run; its slot: "started" and "event" (ended) Events, then "pid", "status"."""
        with self.lock:
            rid = next(self.ids)
            slot = self.waiting[rid] = {"event": threading.Event(), "started": threading.Event()}
            self.proc.stdin.write((json.dumps({"id": rid, "argv": argv, "cwd": str(cwd),
                                               "env": env, "append": append, "script": script,
                                               **files}) + "\n").encode())
            self.proc.stdin.flush()
        slot["started"].wait()
        return slot

    def finish(self, slot: dict, timeout: float | None) -> int | None:
        """The run's exit status (None: still running after `timeout`)."""
        if not slot["event"].wait(timeout):
            return None
        if slot["status"] is None:
            raise RuntimeError(f"the warm interpreter {ZYGOTE} ended during a run "
                               f"(exit {self.proc.poll()})")
        return slot["status"]

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], stdin: bytes,
            timeout: float | None) -> tuple[int, bytes, bytes]:
        with tempfile.TemporaryDirectory(prefix="moe-train-run-") as tmp:
            files = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            Path(files["stdin"]).write_bytes(stdin)
            slot = self.start(argv, cwd, env, files)
            status = self.finish(slot, timeout)
            if status is None:
                if slot.get("pid"):
                    os.kill(slot["pid"], signal.SIGKILL)
                self.finish(slot, None)
                raise subprocess.TimeoutExpired(["python", "-m", "moe_train", *argv], timeout)
            return (status, Path(files["stdout"]).read_bytes(),
                    Path(files["stderr"]).read_bytes())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


HEAVY_COMMANDS = ("train", "pipeline", "convert")
"""Subcommands that import torch._dynamo, deepspeed and (Qwen, convert) transformers: they fork
from a second warm interpreter that has imported those too."""
HEAVY_PRELOAD = ("torch._dynamo", "deepspeed", "transformers",
                 "transformers.models.qwen2_moe.modeling_qwen2_moe")

_zygotes: dict[bool, _Zygote] = {}
_start_lock = threading.Lock()


def _warm(env: dict[str, str], heavy: bool = False) -> _Zygote | None:
    """The warm interpreter (`heavy`: the one with HEAVY_PRELOAD) if it can serve a run with
    `env`. It is started on first use with the tests' usual CLI environment, and again whenever
    that environment has changed (a test that sets a variable in its own process, e.g.
    TRITON_INTERPRET); the old one is left to end with the test process, as a run of another
    thread may still use it."""
    if os.environ.get(FRESH_ENV) == "1":
        return None
    from tests.conftest import cli_env

    with _start_lock:
        usual = cli_env()
        zygote = _zygotes.get(heavy)
        if zygote is None or not zygote.serves(usual):
            zygote = _zygotes[heavy] = _Zygote(usual, HEAVY_PRELOAD if heavy else ())
            atexit.register(zygote.close)
    return zygote if zygote.serves(env) else None


def _heavy(argv: list[str], heavy: bool | None) -> bool:
    return heavy if heavy is not None else bool(argv) and argv[0] in HEAVY_COMMANDS


def run_moe_train(args: list[str], cwd: Path | str, env: dict[str, str], *, input: bytes = b"",
                  timeout: float | None = None, text: bool = False,
                  heavy: bool | None = None) -> subprocess.CompletedProcess:
    """`python -m moe_train ARGS` in `cwd` with `env` and `input` on stdin, output captured.
    `heavy`: fork from the interpreter with HEAVY_PRELOAD (default: for HEAVY_COMMANDS)."""
    argv = [str(a) for a in args]
    zygote = _warm(env, _heavy(argv, heavy))
    if zygote is None:
        proc = subprocess.run([sys.executable, "-m", "moe_train", *argv], cwd=cwd, env=env,
                              input=input, capture_output=True, timeout=timeout)
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        status, out, err = zygote.run(argv, Path(cwd).resolve(), env, input, timeout)
    if text:  # as subprocess decodes: the locale's encoding, universal newlines
        out, err = (io.TextIOWrapper(io.BytesIO(data)).read() for data in (out, err))
    return subprocess.CompletedProcess([sys.executable, "-m", "moe_train", *argv], status, out,
                                       err)


class Ranks:
    """The `nprocs` ranks of one `python -m moe_train` job on this host, started as a launcher
    starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each
    forked from the warm interpreter where it can serve them, all writing to one log. As under
    the deepspeed launcher and torchrun, a rank that fails takes the others down (SIGKILL), and
    the job's exit status is that of the first rank to fail (0 when all succeed)."""

    KILL_AFTER_S = 1.0
    """How long the others may go on after a rank failed: the deepspeed launcher polls its ranks
    once a second, so a peer's own error line (printed just after) still comes out."""

    def __init__(self, args: list[str], cwd: Path | str, env: dict[str, str], log: Path,
                 nprocs: int = 2, script: Path | None = None) -> None:
        """`script`: each rank runs `python SCRIPT ARGS` instead of `python -m moe_train ARGS`."""
        from moe_train.parallel.runtime import free_port

        argv = [str(a) for a in args]
        command = [str(script)] if script else ["-m", "moe_train"]
        port = str(free_port())
        self.log = log
        self.returncode: int | None = None
        self._failed: int | None = None
        self._ended = threading.Event()
        self._ranks: list[subprocess.Popen | dict] = []  # a fresh process, or a forked run's slot
        log.touch()
        for rank in range(nprocs):
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(nprocs),
                        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            zygote = _warm(rank_env, _heavy(argv, None))
            if zygote is None:
                with open(log, "ab") as out:
                    self._ranks.append(subprocess.Popen(
                        [sys.executable, *command, *argv], cwd=cwd, env=rank_env,
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
            else:
                self._ranks.append(zygote.start(
                    argv, Path(cwd).resolve(), rank_env,
                    {"stdin": os.devnull, "stdout": str(log), "stderr": str(log)},
                    append=True, script=str(script) if script else None))
        self.pids = [r.get("pid") if isinstance(r, dict) else r.pid for r in self._ranks]
        threading.Thread(target=self._watch, daemon=True).start()

    def _statuses(self) -> list[int | None]:
        """Each rank's exit status, None while it runs (-255: the warm interpreter died)."""
        return [((-255 if r["status"] is None else r["status"]) if r["event"].is_set() else None)
                if isinstance(r, dict) else r.poll() for r in self._ranks]

    def _watch(self) -> None:
        """Poll the ranks; on the first failure kill the rest; set `returncode` at the end."""
        failed_at = None
        while True:
            statuses = self._statuses()
            failed = [s for s in statuses if s not in (None, 0)]
            if failed and self._failed is None:
                self._failed, failed_at = failed[0], time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= self.KILL_AFTER_S:
                self.send_signal(signal.SIGKILL)
            if all(s is not None for s in statuses):
                self.returncode = self._failed or 0
                self._ended.set()
                return
            time.sleep(0.02)

    def send_signal(self, sig: int, rank: int | None = None) -> None:
        """`sig` to one rank, or to every rank still running."""
        for i, (pid, status) in enumerate(zip(self.pids, self._statuses())):
            if (rank is None or i == rank) and status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["moe_train ranks"], timeout)
        return self.returncode

    def finish(self, expect_ok: bool = True, timeout: float = 500) -> str:
        """Wait (killing every rank on a timeout) and return the log; assert a zero exit when
        `expect_ok`."""
        try:
            self.wait(timeout)
        finally:
            self.kill()
            self.wait(60)
        text = self.log.read_text(errors="replace")
        if expect_ok:
            assert self.returncode == 0, text[-5000:]
        return text
