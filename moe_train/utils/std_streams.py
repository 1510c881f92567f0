"""Standard output whose write errors name it.

The CLI reports an OSError that names a file and whose errno says the machine refused it (a full
disk) in one line; one without a file name is a bug's and keeps its traceback. A write to standard
output raises without a name, so `moe-train params ... > /dev/full` was a traceback: while a
command runs, `sys.stdout` is this wrapper, whose errors name ``<stdout>``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

STDOUT_NAME = "<stdout>"
"""How errors name standard output."""


@contextlib.contextmanager
def _named(name: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = name
        raise


class NamedStream:
    """A text stream (and its `.buffer`) whose OSErrors carry `name` as their file name; all else
    is the wrapped stream's."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, data):
        with _named(self._name):
            return self._stream.write(data)

    def writelines(self, lines) -> None:
        with _named(self._name):
            self._stream.writelines(lines)

    def flush(self) -> None:
        with _named(self._name):
            self._stream.flush()

    @property
    def buffer(self) -> NamedStream:
        return NamedStream(self._stream.buffer, self._name)

    def __getattr__(self, attr: str):
        return getattr(self._stream, attr)


@contextlib.contextmanager
def named_stdout() -> Iterator[None]:
    """`sys.stdout` names itself in its errors inside the block, which ends with a flush (so a
    full device is found here, not at interpreter exit); a closed stdout (None) stays None."""
    stdout = sys.stdout
    if stdout is None:
        yield
        return
    sys.stdout = NamedStream(stdout, STDOUT_NAME)
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = stdout
