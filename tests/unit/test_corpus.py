"""Corpus discovery and validation: malformed input is a one-line DataError naming file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_train.data.corpus import CorpusFiles, discover, plain_corpus, read_pairs
from moe_train.errors import DataError


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def _pair(tmp_path: Path, src: str | bytes, tgt: str | bytes) -> CorpusFiles:
    return plain_corpus(_write(tmp_path / "a.src", src), _write(tmp_path / "a.tgt", tgt))


def _error(files: CorpusFiles, max_chars: int = 100) -> str:
    with pytest.raises(DataError) as info:
        read_pairs(files, max_chars)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- read_pairs ---------------------------------------------------------------------------------

def test_read_pairs_strips_newlines_and_normalises_whitespace(tmp_path: Path) -> None:
    files = _pair(tmp_path, "\ufeffHallo  Welt\r\n\tzwei\u00a0Wörter \r\nohne Zeilenende",
                  "hello world\n\ufefftwo words\nno new\ufeffline at end\n")
    src, tgt = read_pairs(files, max_chars=100)
    assert src == ["Hallo Welt", "zwei Wörter", "ohne Zeilenende"]
    # a byte-order mark mid-file (concatenated files) goes too: no reference can keep one
    assert tgt == ["hello world", "two words", "no newline at end"]


def test_mismatched_line_counts(tmp_path: Path) -> None:
    files = _pair(tmp_path, "a\nb\nc\n", "x\ny\n")
    assert _error(files) == f"{files.src}: 3 lines but {files.tgt} has 2"


def test_invalid_utf8_names_line_byte_and_column(tmp_path: Path) -> None:
    files = _pair(tmp_path, b"fine\n\xc3\xa4b\xffc\nmore\n", "x\ny\nz\n")
    # line 2 is "äb" then 0xff: the third character (column 3), not byte 4.
    assert _error(files) == f"{files.src}:2: not valid UTF-8 (byte 0xff at column 3)"


def test_invalid_utf8_on_target_side(tmp_path: Path) -> None:
    files = _pair(tmp_path, "a\nb\n", b"x\n\x80\n")
    assert _error(files) == f"{files.tgt}:2: not valid UTF-8 (byte 0x80 at column 1)"


@pytest.mark.parametrize("bad", ["", "   ", "\t\r"])
def test_empty_or_blank_line(tmp_path: Path, bad: str) -> None:
    files = _pair(tmp_path, "a\nb\nc\n", f"x\ny\n{bad}\n")
    assert _error(files) == f"{files.tgt}:3: empty line"


def test_trailing_blank_line_is_an_empty_line(tmp_path: Path) -> None:
    files = _pair(tmp_path, "a\nb\n\n", "x\ny\n\n")
    assert _error(files) == f"{files.src}:3: empty line"


def test_too_long_line(tmp_path: Path) -> None:
    files = _pair(tmp_path, "short\n" + "x" * 12 + "\n", "a\nb\n")
    assert _error(files, max_chars=10) == (
        f"{files.src}:2: 12 characters, longer than data.max_chars=10")
    src, _ = read_pairs(files, max_chars=12)  # exactly max_chars is allowed
    assert src[1] == "x" * 12


def test_missing_file(tmp_path: Path) -> None:
    files = plain_corpus(_write(tmp_path / "a.src", "a\n"), tmp_path / "nope.tgt")
    message = _error(files)
    assert message == f"{tmp_path / 'nope.tgt'}: file not found"


def test_empty_file(tmp_path: Path) -> None:
    files = _pair(tmp_path, "", "")
    assert _error(files) == f"{files.src}: empty file (expected one sentence per line)"


def test_plain_corpus_defaults() -> None:
    files = plain_corpus("x.de", "x.en")
    assert files == CorpusFiles("default", "src", "tgt", "train", Path("x.de"), Path("x.en"))
    assert files.name == "default.src-tgt"
    assert plain_corpus("a", "b", domain="law", src_lang="de", tgt_lang="en",
                        split="dev").name == "law.de-en"
    with pytest.raises(DataError):
        plain_corpus("a", "b", split="valid")


# --- discover -----------------------------------------------------------------------------------

@pytest.fixture()
def opus(tmp_path: Path) -> Path:
    """law: de-en (train, dev), en-fr (train); med: de-en (train); plus a stray README."""
    root = tmp_path / "opus"
    for rel in ["law/law.de-en.train.de", "law/law.de-en.train.en", "law/law.de-en.dev.de",
                "law/law.de-en.dev.en", "law/law.en-fr.train.en", "law/law.en-fr.train.fr",
                "med/med.de-en.train.de", "med/med.de-en.train.en"]:
        _write(root / rel, "a\n")
    _write(root / "README.md", "not a corpus\n")
    _write(root / "law" / "notes.txt", "not a corpus\n")
    return root


def _summary(corpora: list[CorpusFiles]) -> list[tuple[str, str, str, str, str]]:
    return [(c.domain, c.src_lang, c.tgt_lang, c.split, c.src.name) for c in corpora]


def test_discover_all_in_file_direction(opus: Path) -> None:
    assert _summary(discover(opus)) == [
        ("law", "de", "en", "train", "law.de-en.train.de"),
        ("law", "de", "en", "dev", "law.de-en.dev.de"),
        ("law", "en", "fr", "train", "law.en-fr.train.en"),
        ("med", "de", "en", "train", "med.de-en.train.de"),
    ]


def test_discover_reversed_pair_and_both_directions(opus: Path) -> None:
    found = discover(opus, pairs=["en-de"], splits=["train"])
    assert _summary(found) == [("law", "en", "de", "train", "law.de-en.train.en"),
                               ("med", "en", "de", "train", "med.de-en.train.en")]
    assert found[0].tgt.name == "law.de-en.train.de"
    assert found[0].name == "law.en-de"
    both = discover(opus, pairs=["de-en", "en-de"], domains=["med"])
    assert [c.name for c in both] == ["med.de-en", "med.en-de"]


def test_discover_filters(opus: Path) -> None:
    assert _summary(discover(opus, pairs=["fr-en"])) == [
        ("law", "fr", "en", "train", "law.en-fr.train.fr")]
    assert [c.name for c in discover(opus, domains=["med"])] == ["med.de-en"]
    assert [c.split for c in discover(opus, domains=["law"], splits=["dev"])] == ["dev"]


def test_discover_unknown_domain_and_pair(opus: Path) -> None:
    with pytest.raises(DataError) as info:
        discover(opus, domains=["med", "news"])
    assert str(info.value) == "data.domains: unknown domain 'news' (found: law, med)"
    with pytest.raises(DataError) as info:
        discover(opus, pairs=["de-fr"])
    assert str(info.value) == "data.pairs: unknown pair 'de-fr' (found: de-en, en-fr)"
    # med has only de-en: asked for by name with en-fr only, it would vanish from the data
    with pytest.raises(DataError) as info:
        discover(opus, domains=["law", "med"], pairs=["fr-en"])
    assert str(info.value) == ("data.domains: 'med' has no corpus of data.pairs fr-en (its files "
                               "are de-en); drop it or add one of its pairs")
    with pytest.raises(DataError, match="unknown pair 'en-fr'"):
        discover(opus, pairs=["en-fr"], domains=["med"])  # exists, but not in the chosen domain


def test_discover_missing_side(opus: Path) -> None:
    (opus / "med" / "med.de-en.train.en").unlink()
    with pytest.raises(DataError) as info:
        discover(opus)
    missing, present = opus / "med" / "med.de-en.train.en", opus / "med" / "med.de-en.train.de"
    assert str(info.value) == f"{missing}: missing target side for {present}"
    with pytest.raises(DataError) as info:
        discover(opus, pairs=["en-de"])
    assert str(info.value) == f"{missing}: missing source side for {present}"


def test_a_hyphenated_region_code_is_an_error_not_a_missing_domain(opus: Path) -> None:
    """zh-TW in a file name cannot be split from its pair: the domain used to vanish."""
    for side in ("en", "zh-TW"):
        _write(opus / "sub" / f"sub.en-zh-TW.train.{side}", "a\n")
    with pytest.raises(DataError, match=r"sub\.en-zh-TW\.train\.zh-TW: language code 'zh-TW' "
                                        r"has a hyphen.*\(e\.g\. zh_TW\)"):
        discover(opus)


def test_discover_missing_dir_and_nothing_found(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data directory not found"):
        discover(tmp_path / "absent")
    (tmp_path / "empty" / "law").mkdir(parents=True)
    with pytest.raises(DataError, match="no corpus files"):
        discover(tmp_path / "empty")


def test_discover_no_match_for_split(opus: Path) -> None:
    with pytest.raises(DataError) as info:
        discover(opus, domains=["med"], splits=["test"])
    assert "no corpus matches" in str(info.value) and "\n" not in str(info.value)


def test_raw_text_input_from_a_pipe(tmp_path: Path) -> None:
    """`--input <(...)`, a FIFO, /dev/stdin: not regular files, but inputs all the same."""
    import os
    import threading

    from moe_train.data.corpus import read_text_input

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a b\nc d\n"))
    writer.start()
    assert read_text_input(fifo) == (str(fifo), ["a b", "c d"])
    writer.join()
    with pytest.raises(DataError, match="a directory; expected a text file"):
        read_text_input(tmp_path)
    with pytest.raises(DataError, match="nope: file not found"):
        read_text_input(tmp_path / "nope")


@pytest.mark.parametrize("text,lone", [("a\rb\rc\r", 2), ("a\rb", 1), ("a\rb\rc\n", 2)])
def test_lone_carriage_return_line_endings_are_refused(tmp_path: Path, text: str,
                                                       lone: int) -> None:
    """Old Mac line endings would read as one line holding the whole file (or a count
    mismatch naming the wrong cause): refused, file named."""
    files = _pair(tmp_path, text, "x\ny\nz\n")
    assert _error(files, max_chars=1000) == (
        f"{files.src}: lines end in a lone carriage return ({lone}, against "
        f"{text.count(chr(10))} newlines: old Mac line endings); expected LF or CRLF")


@pytest.mark.parametrize("text,want", [("one\r", ["one"]), ("a b\rc\nd\n", ["a b c", "d"]),
                                       ("a\r\nb\r\n", ["a", "b"])])
def test_a_final_or_stray_carriage_return_is_whitespace(tmp_path: Path, text: str,
                                                        want: list[str]) -> None:
    files = _pair(tmp_path, text, "\n".join("x" * len(want)) + "\n")
    assert read_pairs(files, max_chars=100)[0] == want
