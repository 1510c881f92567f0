"""User-facing errors.

Every error a user can cause by bad input (a config field, a data file, a missing artifact) is a
`MoeTrainError`. Its message is one line that names the place (field, file:line) and what was
expected; the CLI prints it as ``error: <message>`` and exits with status 2, no traceback.
An OSError whose errno is in `MACHINE_ERRNOS` and that names a file is the machine refusing a
write (a full disk, a read-only mount): one line ``error: <file>: <reason>``, status 1.
"""

import errno

MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG,
                            errno.EBUSY, errno.EPERM, errno.EACCES})
"""Errnos that say the machine refused an operation, not that the code or input is wrong (a
missing file, a directory where a file was meant stay tracebacks: they are bugs by then, inputs
being checked first)."""


class MoeTrainError(Exception):
    """Base class for errors caused by user input; the message is one line."""


class ConfigError(MoeTrainError):
    """A config field has a bad value, type or name."""


class DataError(MoeTrainError):
    """A data file is missing, malformed or inconsistent."""


class CheckpointError(MoeTrainError):
    """A checkpoint is missing or does not match the run."""


class PeerFailed(Exception):
    """Another rank failed where this one did not (rank 0 alone writes a checkpoint's metadata
    and the export: a full disk there): this rank stops too, in one line pointing at that
    rank's error (status 1), instead of training on alone or waiting for it forever."""


class OutOfMemory(Exception):
    """The machine ran out of memory reading a file (a checkpoint larger than what is free):
    one line naming the file and the allocation that failed, status 1, never blamed on the
    file as bad input."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: Python's MemoryError, or torch's CPU / CUDA
    allocator refusing (a RuntimeError, torch.OutOfMemoryError on CUDA)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower())
