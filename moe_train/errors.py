"""User-facing errors.

Every error a user can cause by bad input (a config field, a data file, a missing artifact) is a
`MoeTrainError`. Its message is one line that names the place (field, file:line) and what was
expected; the CLI prints it as ``error: <message>`` and exits with status 2, no traceback.
"""


class MoeTrainError(Exception):
    """Base class for errors caused by user input; the message is one line."""


class ConfigError(MoeTrainError):
    """A config field has a bad value, type or name."""


class DataError(MoeTrainError):
    """A data file is missing, malformed or inconsistent."""


class CheckpointError(MoeTrainError):
    """A checkpoint is missing or does not match the run."""
