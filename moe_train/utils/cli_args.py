"""Argument parsing shared by `moe-train` and the benchmark scripts.

A bad argument is a user error like any other: one line starting ``error:`` (``error: PROG:
...`` from the parser, ``error: ...`` from `exit_bad_input`), exit status 2, no usage dump. The
argparse types below complain in that one line and name what they expected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (exit status 2); ``--help`` shows the
    usage. Subparsers made from it are of this class too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def exit_bad_input(message: str) -> NoReturn:
    """Stop on bad input found after parsing (a file, a combination of options): the one
    ``error:`` line on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (and <= `high`)."""
    what = "a positive integer" if low == 1 else f"an integer >= {low}"
    if high is not None:
        what = f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _finite_float(text: str, low: float, strict: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or value == float("inf") or not (value > low if strict else value >= low):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a rate, a budget that must be set)."""
    return _finite_float(text, 0.0, True, "a positive number")


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number from `low` to `high`."""

    def parse(text: str) -> float:
        value = _finite_float(text, low, False, f"a number from {low:g} to {high:g}")
        if value > high:
            raise argparse.ArgumentTypeError(f"expected a number from {low:g} to {high:g}, "
                                             f"got {text!r}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a time budget where 0 means none)."""
    return _finite_float(text, 0.0, False, "a number >= 0")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, as transformers' ``max_shard_size`` takes it (an
    integer, or a number with KB / MB / GB / TB, powers of 1000, or KiB / MiB / GiB / TiB; a
    lowercase final b after K, M, G or T counts bits, "5Gb" being 625 MB); a whole number of
    bytes, at least 1."""
    import re
    from decimal import Decimal

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2) if match else ""
    factor = _SIZE_UNITS.get(unit.upper()) if match else None
    size = Decimal(match.group(1)) * factor if factor else Decimal(0)
    if re.fullmatch(r"[KkMmGgTt]b", unit):
        size /= 8
    if size < 1 or size != size.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes such as 5GB, 500MB "
                                         f"or 2GiB, got {text!r}")
    return int(size)


def path_text(text: str) -> str:
    """An argparse type: a path, not the empty string (an unset shell variable: `--src ""` was
    taken as no --src at all, and another set was scored)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def existing_dir(text: str) -> str:
    """An argparse type: a path that is a directory (returned as given)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}")
    return text


def comma_list(known: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    """An argparse type: a non-empty comma-separated list of names from `known`, in the
    order given, duplicates dropped."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected some of {', '.join(known)}, got {text!r}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        return names

    return parse


def results_path(out: str | None, default: Path, flag: str = "--out") -> Path:
    """Where a script writes its results: `out` when given, else `default`. Checked before any
    work starts: a directory or a place that cannot be written is the one error line (exit 2)
    at once, not a traceback after an hour of measuring."""
    from moe_train.errors import DataError
    from moe_train.utils.atomic import check_out_file

    try:
        return check_out_file(default if out is None else out, flag)
    except DataError as exc:
        exit_bad_input(str(exc))


def script_parser(file: str, doc: str | None) -> OneLineParser:
    """The parser of a script such as benchmarks/x.py: named by its folder and file (how the
    README runs it), described by its docstring's first line."""
    lines = (doc or "").strip().splitlines()
    return OneLineParser(prog=script_name(file), description=lines[0] if lines else None)


def script_name(file: str) -> str:
    """benchmarks/x.py for the script at `file`."""
    path = Path(file)
    return f"{path.parent.name}/{path.name}"


def command_line(file: str, argv: list[str] | None) -> list[str]:
    """The command a script's run records: sys.argv, or the script and `argv` when its main
    was called with arguments (from a test or another script)."""
    return list(sys.argv) if argv is None else [script_name(file), *argv]
