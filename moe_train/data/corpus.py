"""Parallel corpora on disk: find them, read them, reject malformed ones with a one-line error.

Two layouts are understood:

* OPUS-like directories, ``{data_dir}/{domain}/{domain}.{l1}-{l2}.{split}.{lang}`` with
  ``l1 < l2`` alphabetically and ``split`` one of train/dev/test (`discover`);
* a plain source/target file pair with optional tags (`plain_corpus`).

`read_pairs` validates a pair of files (UTF-8, equal line counts, no blank or over-long lines) and
returns the sentences with whitespace minimally normalised. Every problem is a `DataError` whose
message is a single line naming ``file:line`` and what was expected.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from moe_train.errors import ConfigError, DataError

SPLITS: tuple[str, ...] = ("train", "dev", "test")
"""Split names, in the order used everywhere (sorting, manifests)."""

DOMAIN_NAME = "letters, digits, '_', '.' and '-', not starting with '.' or '-'"
LANG_CODE = "letters, digits and '_'"
"""What a domain name and a language code may hold (said by errors): they become parts of file
names (``{domain}.{src}-{tgt}.*``), tags and ``xx-yy`` pairs, so no path separator, no ``..``,
no whitespace, and no ``-`` inside a language code."""
_DOMAIN_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_LANG_RE = re.compile(r"[A-Za-z0-9_]+")


def valid_domain(name: str) -> bool:
    """Whether `name` is a safe domain name (see DOMAIN_NAME; e.g. EMEA, JRC-Acquis, it)."""
    return isinstance(name, str) and _DOMAIN_RE.fullmatch(name) is not None


def valid_lang(code: str) -> bool:
    """Whether `code` is a safe language code (see LANG_CODE; e.g. en, pt_BR)."""
    return isinstance(code, str) and _LANG_RE.fullmatch(code) is not None


@dataclass(frozen=True)
class CorpusFiles:
    """One direction of one domain's parallel text for one split: a source and a target file."""

    domain: str
    src_lang: str
    tgt_lang: str
    split: str
    src: Path
    tgt: Path

    @property
    def name(self) -> str:
        """Corpus name shared by all splits, e.g. ``EMEA.de-en`` (domain, then direction)."""
        return f"{self.domain}.{self.src_lang}-{self.tgt_lang}"


def _sort_key(c: CorpusFiles) -> tuple[str, str, str, int]:
    order = SPLITS.index(c.split) if c.split in SPLITS else len(SPLITS)
    return (c.domain, c.src_lang, c.tgt_lang, order)


def _parse_name(domain: str, filename: str) -> tuple[str, str, str, str] | None:
    """``{domain}.{l1}-{l2}.{split}.{lang}`` -> (l1, l2, split, lang), or None if it is not one."""
    prefix = f"{domain}."
    if not filename.startswith(prefix):
        return None
    parts = filename[len(prefix):].split(".")
    if len(parts) != 3:
        return None
    pair, split, lang = parts
    langs = pair.split("-")
    if split in SPLITS and len(langs) > 2 and "-" in lang:  # en-zh-TW: one of ours, misnamed
        raise DataError(f"language code {lang!r} has a hyphen, which the pair's xx-yy cannot "
                        f"hold; expected letters, digits and '_' (e.g. {lang.replace('-', '_')})")
    if len(langs) != 2 or not all(langs) or split not in SPLITS or lang not in langs:
        return None
    if langs[0] == langs[1]:
        return None
    return langs[0], langs[1], split, lang


def discover(data_dir: str | os.PathLike, pairs: Iterable[str] = (), domains: Iterable[str] = (),
             splits: Iterable[str] = SPLITS) -> list[CorpusFiles]:
    """Find the corpora of an OPUS-like directory, filtered by direction, domain and split.

    `pairs` are directed ``src-tgt`` pairs (``en-de`` reads the ``de-en`` files backwards); empty
    means every pair found, in the direction its file name gives (l1 -> l2). `domains` empty means
    all domains. The result is sorted by (domain, src_lang, tgt_lang, split).
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found")
    pairs, domains, splits = list(pairs), list(domains), list(splits)
    for split in splits:
        if split not in SPLITS:
            raise DataError(f"splits: unknown split {split!r} "
                            f"(expected one of {', '.join(SPLITS)})")

    # (domain, l1, l2, split) -> {lang: path}
    found: dict[tuple[str, str, str, str], dict[str, Path]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            try:
                parsed = _parse_name(folder.name, path.name)
            except DataError as exc:  # a corpus file of ours, misnamed: never skipped
                raise DataError(f"{path}: {exc}") from None
            if parsed is None or not path.is_file():
                continue
            l1, l2, split, lang = parsed
            found.setdefault((folder.name, l1, l2, split), {})[lang] = path

    all_domains = sorted({key[0] for key in found})
    if not all_domains:
        raise DataError(f"{root}: no corpus files named {{domain}}/{{domain}}.{{l1}}-{{l2}}."
                        "{split}.{lang}")
    for domain in domains:
        if domain not in all_domains:
            raise DataError(f"data.domains: unknown domain {domain!r} "
                            f"(found: {', '.join(all_domains)})")
    wanted_domains = set(domains) or set(all_domains)

    file_pairs = sorted({f"{k[1]}-{k[2]}" for k in found if k[0] in wanted_domains})
    for pair in pairs:
        src, _, tgt = pair.partition("-")
        if f"{src}-{tgt}" not in file_pairs and f"{tgt}-{src}" not in file_pairs:
            raise DataError(f"data.pairs: unknown pair {pair!r} (found: {', '.join(file_pairs)})")

    result: list[CorpusFiles] = []
    for (domain, l1, l2, split), sides in sorted(found.items()):
        if domain not in wanted_domains or split not in splits:
            continue
        directions = [(l1, l2)] if not pairs else [
            (s, t) for s, _, t in (p.partition("-") for p in pairs) if {s, t} == {l1, l2}]
        if not directions:
            continue
        _check_names(sides, domain, l1, l2)  # only of what is used: an odd folder aside is fine
        for lang, other in ((l1, l2), (l2, l1)):
            if lang not in sides:
                present = sides[other]
                missing = present.with_name(f"{domain}.{l1}-{l2}.{split}.{lang}")
                side = "target" if lang == directions[0][1] else "source"
                raise DataError(f"{missing}: missing {side} side for {present}")
        for src, tgt in dict.fromkeys(directions):
            result.append(CorpusFiles(domain, src, tgt, split, sides[src], sides[tgt]))
    if not result:
        raise DataError(f"{root}: no corpus matches data.pairs={pairs} data.domains={domains} "
                        f"splits={splits}")
    used = {c.domain for c in result}
    for domain in domains:  # asked for by name: it must take part, not vanish from the data
        if domain not in used:
            has = sorted({f"{k[1]}-{k[2]}" for k in found if k[0] == domain})
            raise DataError(f"data.domains: {domain!r} has no corpus of data.pairs "
                            f"{', '.join(pairs)} (its files are {', '.join(has)}); drop it or "
                            "add one of its pairs")
    return sorted(result, key=_sort_key)


def _check_names(sides: dict[str, Path], domain: str, l1: str, l2: str) -> None:
    path = next(iter(sides.values()))
    if not valid_domain(domain):
        raise DataError(f"{path}: domain {domain!r} (the folder name) must be {DOMAIN_NAME}")
    for code in (l1, l2):
        if not valid_lang(code):
            raise DataError(f"{path}: language code {code!r} in the file name must be "
                            f"{LANG_CODE}")


def plain_corpus(src: str | os.PathLike, tgt: str | os.PathLike, domain: str = "default",
                 src_lang: str = "src", tgt_lang: str = "tgt", split: str = "train"
                 ) -> CorpusFiles:
    """A corpus given as an explicit source file and target file."""
    if split not in SPLITS:
        raise DataError(f"{src}: unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    if not valid_domain(domain):
        raise ConfigError(f"--domain: expected a name of {DOMAIN_NAME}, got {domain!r}")
    for option, code in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
        if not valid_lang(code):
            raise ConfigError(f"{option}: expected a language code of {LANG_CODE}, got {code!r}")
    if src_lang == tgt_lang:
        raise DataError(f"{src}: source and target language are both {src_lang!r}")
    return CorpusFiles(domain, src_lang, tgt_lang, split, Path(src), Path(tgt))


def _decode_lines(data: bytes, name: str | Path) -> list[str]:
    """UTF-8 bytes -> lines (a final newline ends the last line; ``\\r\\n`` is one newline);
    invalid UTF-8 is a DataError naming ``name:line`` and the column. A carriage return alone
    inside a line is whitespace, but a file whose lines end in one is refused: it would read as
    one line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line_no = data.count(b"\n", 0, err.start) + 1
        column = len(data[line_start:err.start].decode("utf-8")) + 1
        raise DataError(f"{name}:{line_no}: not valid UTF-8 (byte 0x{data[err.start]:02x} at "
                        f"column {column})") from None
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not part of line 1
    lone_cr = text.count("\r") - text.count("\r\n") - text.endswith("\r")  # not a final one
    if lone_cr > (newlines := text.count("\n")):  # else read as one line (or a few)
        raise DataError(f"{name}: lines end in a lone carriage return ({lone_cr}, against "
                        f"{newlines} newlines: old Mac line endings); expected LF or CRLF")
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()  # the final newline ends the last line; it does not start a new one
    return [line.removesuffix("\r") for line in raw]


STDIN = "-"
STDIN_NAME = "<stdin>"
"""How errors name standard input."""


def read_text_input(path: str | os.PathLike) -> tuple[str, list[str]]:
    """The lines of a raw-text input file (``-``: standard input) to translate or score, and
    the name errors use for it. Lines are kept as they are (a blank line stays a line); the input
    must be UTF-8 and hold at least one line."""
    if str(path) == STDIN:
        if sys.stdin is None:  # `moe-train translate <&-`
            raise DataError(f"{STDIN_NAME}: standard input is closed (expected one sentence per "
                            "line, or a file name instead of -)")
        name, data = STDIN_NAME, sys.stdin.buffer.read()
    else:
        name, data = str(path), _read_input_bytes(Path(path))
    lines = _decode_lines(data, name)
    if not lines:
        raise DataError(f"{name}: empty input (expected one sentence per line)")
    return name, lines


def _read_input_bytes(path: Path) -> bytes:
    """The bytes of a file, or of a pipe (`<(...)`, a FIFO, /dev/stdin); one-line errors."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: a directory; expected a text file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror})") from None


def _read_lines(path: Path, max_chars: int) -> list[str]:
    """Decode, split and validate one side; return its lines with whitespace normalised."""
    raw = _decode_lines(_read_input_bytes(path), path)
    lines: list[str] = []
    for line_no, line in enumerate(raw, start=1):
        if len(line) > max_chars:
            raise DataError(f"{path}:{line_no}: {len(line)} characters, longer than "
                            f"data.max_chars={max_chars}")
        clean = collapse_spaces(line)
        if not clean:
            raise DataError(f"{path}:{line_no}: empty line")
        lines.append(clean)
    if not lines:
        raise DataError(f"{path}: empty file (expected one sentence per line)")
    return lines


def read_pairs(files: CorpusFiles, max_chars: int) -> tuple[list[str], list[str]]:
    """Read and validate both sides of a corpus; return (sources, targets), aligned by line."""
    for path in (files.src, files.tgt):
        if not path.exists():
            raise DataError(f"{path}: file not found")
    src = _read_lines(files.src, max_chars)
    tgt = _read_lines(files.tgt, max_chars)
    if len(src) != len(tgt):
        raise DataError(f"{files.src}: {len(src)} lines but {files.tgt} has {len(tgt)}")
    return src, tgt


def collapse_spaces(line: str) -> str:
    """The one normalisation of text before tokenization, in training data and in what is
    translated alike: runs of any Unicode whitespace become one space, ends stripped (stray line
    separators inside a line, \r \v \f U+0085 U+2028..., go too), and byte-order marks
    (U+FEFF, left mid-file where files were concatenated) removed: sentencepiece drops them, so
    a reference keeping one could never be matched."""
    return " ".join(line.replace("\ufeff", "").split())
