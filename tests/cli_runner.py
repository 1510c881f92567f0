"""`python -m moe_train ARGS` for the tests, forked from a warm interpreter (tests/zygote.py).

`run_moe_train` returns what `subprocess.run(..., capture_output=True)` would. The run is a real
process with its own exit status, stdin, stdout, stderr and working directory; it saves the ~3 s
of CPU that importing torch costs a fresh interpreter. A run whose environment differs from the
warm interpreter's in more than the project's own MOE_TRAIN_* variables and pytest's (torch and the OpenMP
runtime read theirs when loaded) starts a fresh interpreter instead, and so does every run when
MOE_TRAIN_TEST_FRESH_PROCESSES=1.
"""

from __future__ import annotations

import atexit
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")
FRESH_ENV = "MOE_TRAIN_TEST_FRESH_PROCESSES"


def _settable(name: str) -> bool:
    """Variables a run may set differently from the warm interpreter: ours, read at run time,
    and pytest's (PYTEST_CURRENT_TEST names each test)."""
    return name.startswith(("MOE_TRAIN_", "PYTEST_"))


class _Zygote:
    """One warm interpreter per test process; thread-safe."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {k: v for k, v in env.items() if not _settable(k)}
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], env=env,
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
                    slot["event"].set()
                else:
                    slot["started"].set()
        with self.lock:  # it ended: nothing more will come for the runs still waiting
            for slot in self.waiting.values():
                slot.setdefault("status", None)
                slot["started"].set()
                slot["event"].set()

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], stdin: bytes,
            timeout: float | None) -> tuple[int, bytes, bytes]:
        with tempfile.TemporaryDirectory(prefix="moe-train-run-") as tmp:
            files = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            Path(files["stdin"]).write_bytes(stdin)
            with self.lock:
                rid = next(self.ids)
                slot = self.waiting[rid] = {"event": threading.Event(),
                                            "started": threading.Event()}
                self.proc.stdin.write((json.dumps({"id": rid, "argv": argv, "cwd": str(cwd),
                                                   "env": env, **files}) + "\n").encode())
                self.proc.stdin.flush()
            try:
                if not slot["event"].wait(timeout):
                    slot["started"].wait()
                    if slot.get("pid"):
                        os.kill(slot["pid"], signal.SIGKILL)
                    slot["event"].wait()
                    raise subprocess.TimeoutExpired(["python", "-m", "moe_train", *argv],
                                                    timeout)
            finally:
                with self.lock:
                    del self.waiting[rid]
            if slot["status"] is None:
                raise RuntimeError(f"the warm interpreter {ZYGOTE} ended during a run "
                                   f"(exit {self.proc.poll()})")
            return (slot["status"], Path(files["stdout"]).read_bytes(),
                    Path(files["stderr"]).read_bytes())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_zygote: _Zygote | None = None
_start_lock = threading.Lock()


def _warm(env: dict[str, str]) -> _Zygote | None:
    """The warm interpreter if it can serve a run with `env`. It is started on first use with
    the tests' usual CLI environment, and again whenever that environment has changed (a test
    that sets a variable in its own process, e.g. TRITON_INTERPRET); the old one is left to
    end with the test process, as a run of another thread may still use it."""
    global _zygote
    if os.environ.get(FRESH_ENV) == "1":
        return None
    from tests.conftest import cli_env

    with _start_lock:
        usual = cli_env()
        if _zygote is None or not _zygote.serves(usual):
            _zygote = _Zygote(usual)
            atexit.register(_zygote.close)
    return _zygote if _zygote.serves(env) else None


def run_moe_train(args: list[str], cwd: Path | str, env: dict[str, str], *, input: bytes = b"",
                  timeout: float | None = None, text: bool = False) -> subprocess.CompletedProcess:
    """`python -m moe_train ARGS` in `cwd` with `env` and `input` on stdin, output captured."""
    argv = [str(a) for a in args]
    zygote = _warm(env)
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
