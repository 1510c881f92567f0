"""Binarized, memory-mapped parallel data: one shard per corpus per split.

Layout of a prepared directory (written by `moe_train.data.prepare`)::

    manifest.json                 corpora, ids, per-split sizes (see prepare.py)
    spm.model / spm.vocab         the joint sentencepiece model
    {split}/{corpus}.src.bin      int32 token ids of all source sentences, concatenated
    {split}/{corpus}.src.idx      int64 offsets into .src.bin, n+1 entries (sentence i is
                                  bin[idx[i]:idx[i+1]])
    {split}/{corpus}.tgt.bin/.idx the same for the target side
    {split}/{corpus}.raw.src/.tgt original text, one sentence per line (dev and test only:
                                  the references for BLEU)

Sentences carry no bos/eos; with tags a source starts with its domain tag (``data.domain_tags``),
then its target-language tag (``data.lang_tags``). Per-sentence metadata (domain, languages) is
constant within a corpus, so it lives in the manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.errors import DataError
from moe_train.utils.atomic import atomic_path, write_text

MANIFEST = "manifest.json"
TOKEN_DTYPE = np.int32
OFFSET_DTYPE = np.int64
RAW_TEXT_SPLITS = ("dev", "test")
"""Splits whose text is kept beside the shards (references for BLEU)."""


def _write_array(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        array.tofile(tmp)


def _flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated tokens (int32) and offsets (int64, n+1 entries)."""
    lengths = np.fromiter((len(s) for s in ids), dtype=OFFSET_DTYPE, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=OFFSET_DTYPE)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for s in ids for t in s), dtype=TOKEN_DTYPE, count=int(offsets[-1]))
    return tokens, offsets


def write_shard(dir: str | os.PathLike, name: str, src_ids: list[list[int]],
                tgt_ids: list[list[int]], raw_src: list[str] | None = None,
                raw_tgt: list[str] | None = None) -> None:
    """Write one corpus's split as ``{dir}/{name}.{src,tgt}.{bin,idx}`` (+ raw text if given).

    Every file is written atomically. Raw lines must not contain newlines.
    """
    dir = Path(dir)
    if len(src_ids) != len(tgt_ids):
        raise ValueError(f"{name}: {len(src_ids)} source but {len(tgt_ids)} target sentences")
    for side, ids in (("src", src_ids), ("tgt", tgt_ids)):
        tokens, offsets = _flatten(ids)
        _write_array(dir / f"{name}.{side}.bin", tokens)
        _write_array(dir / f"{name}.{side}.idx", offsets)
    for side, raw in (("src", raw_src), ("tgt", raw_tgt)):
        if raw is None:
            continue
        if len(raw) != len(src_ids) or any("\n" in line for line in raw):
            raise ValueError(f"{name}.raw.{side}: need {len(src_ids)} lines without newlines")
        write_text(dir / f"{name}.raw.{side}", "".join(f"{line}\n" for line in raw))


MODEL_FILES = ("config.json", "meta.json", "model.safetensors")
"""Files of an export or a checkpoint step, which `prepare` never writes."""


def read_manifest(prepared_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared directory; DataError if there is none."""
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: not found (no prepared data); run `moe-train prepare` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err}); run `moe-train prepare` again") from None
    splits = manifest.get("splits", {}) if isinstance(manifest, dict) else None
    if any((path.parent / name).is_file() for name in MODEL_FILES):  # its manifest's copy
        raise DataError(f"{path.parent}: a model's export or checkpoint step, not prepared "
                        "data (its manifest.json is the data's copy, without the splits' "
                        "files); expected the directory `moe-train prepare` wrote")
    if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
        raise DataError(f"{path}: not a manifest `moe-train prepare` writes (expected an object "
                        "whose splits are objects); run `moe-train prepare` again")
    return manifest


CORPUS_KEYS = {"name": (str, "a string"), "domain_id": (int, "an integer"),
               "src_lang_id": (int, "an integer"), "tgt_lang_id": (int, "an integer")}
"""What a dataset reads of each manifest corpus entry, and its type."""


def _check_corpus_entries(path: Path, corpora: Any, split: str, info: dict[str, Any]) -> None:
    """The manifest's corpus entries and `split`'s per-corpus sizes are what a dataset reads
    (a damaged manifest is one DataError line, not a KeyError inside the loader)."""
    again = "(corrupt); run `moe-train prepare` again"
    if not isinstance(corpora, list):
        raise DataError(f"{path}: corpora: expected a list {again}")
    for i, corpus in enumerate(corpora):
        for key, (kind, expected) in CORPUS_KEYS.items():
            value = corpus.get(key) if isinstance(corpus, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise DataError(f"{path}: corpora[{i}].{key}: expected {expected}, got "
                                f"{value!r} {again}")
    sizes = info.get("corpus_sizes")
    if not (isinstance(sizes, list) and len(sizes) == len(corpora)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)):
        raise DataError(f"{path}: splits.{split}.corpus_sizes: expected {len(corpora)} "
                        f"counts, one per corpus, got {sizes!r} {again}")


def _open_tokens(path: Path, n_tokens: int) -> np.ndarray:
    """Memory-map a token file (an empty file cannot be mapped: use an empty array)."""
    if not path.is_file():
        raise DataError(f"{path}: missing shard file; run `moe-train prepare` first")
    if path.stat().st_size != n_tokens * np.dtype(TOKEN_DTYPE).itemsize:
        raise DataError(f"{path}: {path.stat().st_size} bytes, expected {n_tokens} int32 tokens "
                        "(corrupt shard); run `moe-train prepare` again")
    if n_tokens == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(n_tokens,))


_CHECK_CHUNK = 1 << 22
"""Tokens per piece of the id check (16 MiB: min then max of a piece read it once from RAM)."""
_IDS_CHECKED: set[tuple[str, int, int, int | None]] = set()
"""Shards (path, size, mtime, vocab_size) this process has checked: train builds a split more
than once (length check, trainer, stages), the check runs once per file."""


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int | None) -> None:
    """Every token id of a shard within [0, vocab_size) (one pass, in pieces), so a damaged
    shard fails here, naming its file, not as an index error inside the model."""
    if len(tokens) == 0:
        return
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, vocab_size)
    if key in _IDS_CHECKED:
        return
    lows, highs = [], []
    for start in range(0, len(tokens), _CHECK_CHUNK):  # each piece read once from memory
        piece = tokens[start:start + _CHECK_CHUNK]
        lows.append(int(piece.min()))
        highs.append(int(piece.max()))
    low, high = min(lows), max(highs)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        expected = "non-negative ids" if vocab_size is None else \
            f"ids in [0, {vocab_size}) (vocab_size {vocab_size} in {MANIFEST})"
        raise DataError(f"{path}: token ids range over [{low}, {high}], expected {expected} "
                        "(corrupt shard); run `moe-train prepare` again")
    _IDS_CHECKED.add(key)


def _vocab_size(manifest: dict[str, Any], path: Path) -> int | None:
    """The manifest's vocab_size (None when it has none: ids are then only checked >= 0)."""
    size = manifest.get("vocab_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise DataError(f"{path}: vocab_size {size!r}, expected a positive integer (corrupt); "
                        "run `moe-train prepare` again")
    return size


def _read_offsets(path: Path, n: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: missing shard file; run `moe-train prepare` first")
    offsets = np.fromfile(path, dtype=OFFSET_DTYPE)
    if len(offsets) != n + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise DataError(f"{path}: expected {n + 1} increasing offsets (corrupt shard); "
                        "run `moe-train prepare` again")
    return offsets


class ShardedDataset:
    """All sentence pairs of one split, corpora concatenated in manifest order.

    Global index i runs over corpus 0's sentences, then corpus 1's, ... Arrays of length n:
    `src_lengths`, `tgt_lengths`, `corpus_ids`, `domain_ids`, `src_lang_ids`, `tgt_lang_ids`
    (all int64). `src(i)` / `tgt(i)` return the token ids (int64) read from memory-mapped shards.
    """

    def __init__(self, prepared_dir: str | os.PathLike, split: str) -> None:
        self.prepared_dir = Path(prepared_dir)
        self.split = split
        self.manifest = read_manifest(self.prepared_dir)
        splits = self.manifest.get("splits", {})
        split_dir = self.prepared_dir / split
        if split not in splits:
            raise DataError(f"{split_dir}: no such split (expected one of "
                            f"{', '.join(splits)}; run `moe-train prepare` first for others)")
        if not split_dir.is_dir():
            raise DataError(f"{split_dir}: missing, though {MANIFEST} lists it (incomplete "
                            "data); run `moe-train prepare` again")
        corpora = self.manifest.get("corpora", [])
        if not corpora:
            raise DataError(f"{self.prepared_dir / MANIFEST}: lists no corpora (corrupt); "
                            "run `moe-train prepare` again")
        _check_corpus_entries(self.prepared_dir / MANIFEST, corpora, split, splits[split])
        self.corpus_names: list[str] = [c["name"] for c in corpora]
        self.corpus_sizes: list[int] = [int(s) for s in splits[split]["corpus_sizes"]]
        self.num_corpora = len(corpora)
        sizes = np.asarray(self.corpus_sizes, dtype=np.int64)
        self.corpus_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

        self._src_idx = [_read_offsets(split_dir / f"{c}.src.idx", n)
                         for c, n in zip(self.corpus_names, self.corpus_sizes)]
        self._tgt_idx = [_read_offsets(split_dir / f"{c}.tgt.idx", n)
                         for c, n in zip(self.corpus_names, self.corpus_sizes)]
        self._open()
        vocab_size = _vocab_size(self.manifest, self.prepared_dir / MANIFEST)
        for side in ("src", "tgt"):  # once, here (not when a pickled copy re-maps the files)
            for name, tokens in zip(self.corpus_names, getattr(self, f"_{side}_bin")):
                _check_ids(split_dir / f"{name}.{side}.bin", tokens, vocab_size)

        def per_sentence(key: str) -> np.ndarray:
            return np.repeat(np.asarray([c[key] for c in corpora], dtype=np.int64), sizes)

        self.corpus_ids = np.repeat(np.arange(self.num_corpora, dtype=np.int64), sizes)
        self.domain_ids = per_sentence("domain_id")
        self.src_lang_ids = per_sentence("src_lang_id")
        self.tgt_lang_ids = per_sentence("tgt_lang_id")
        self.src_lengths = np.concatenate([np.diff(o) for o in self._src_idx]).astype(np.int64)
        self.tgt_lengths = np.concatenate([np.diff(o) for o in self._tgt_idx]).astype(np.int64)
        self._raw: dict[str, list[list[str]]] = {}
        self.concatenated = bool(self.manifest.get("data_config", {}).get("prompt_template"))
        """Whether a model reads source (a prompt) and target as one sequence (decoder-only):
        batching then budgets their summed length."""

    def _open(self) -> None:
        """Memory-map every token file once."""
        split_dir = self.prepared_dir / self.split
        self._src_bin = [_open_tokens(split_dir / f"{c}.src.bin", int(o[-1]))
                         for c, o in zip(self.corpus_names, self._src_idx)]
        self._tgt_bin = [_open_tokens(split_dir / f"{c}.tgt.bin", int(o[-1]))
                         for c, o in zip(self.corpus_names, self._tgt_idx)]

    # Pickling (e.g. into worker processes) re-maps the files instead of copying their contents.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_src_bin"], state["_tgt_bin"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self.src_lengths)

    def _locate(self, i: int) -> tuple[int, int]:
        """Global index -> (corpus, index within the corpus)."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sentence {i} out of range for {len(self)} sentences")
        # The last corpus starting at or before i; it cannot be empty (the next one starts
        # after i, or it is the last corpus and i < n).
        corpus = int(np.searchsorted(self.corpus_offsets, i, side="right")) - 1
        return corpus, i - int(self.corpus_offsets[corpus])

    def src(self, i: int) -> np.ndarray:
        """Source token ids of sentence i (int64; starts with its tags, if any)."""
        c, j = self._locate(i)
        o = self._src_idx[c]
        return np.asarray(self._src_bin[c][o[j]:o[j + 1]], dtype=np.int64)

    def tgt(self, i: int) -> np.ndarray:
        """Target token ids of sentence i (int64)."""
        c, j = self._locate(i)
        o = self._tgt_idx[c]
        return np.asarray(self._tgt_bin[c][o[j]:o[j + 1]], dtype=np.int64)

    def _raw_lines(self, side: str, corpus: int) -> list[str]:
        if side not in self._raw:
            self._raw[side] = [None] * self.num_corpora  # type: ignore[list-item]
        lines = self._raw[side][corpus]
        if lines is None:
            path = self.prepared_dir / self.split / f"{self.corpus_names[corpus]}.raw.{side}"
            if not path.is_file():
                if self.split in RAW_TEXT_SPLITS:
                    raise DataError(f"{path}: missing raw text file of the {self.split} split "
                                    "(incomplete data); run `moe-train prepare` again")
                raise DataError(f"{path}: raw text is only kept for "
                                f"{' and '.join(RAW_TEXT_SPLITS)} splits")
            lines = path.read_text(encoding="utf-8").split("\n")[:-1]
            if len(lines) != self.corpus_sizes[corpus]:
                raise DataError(f"{path}: {len(lines)} lines, expected "
                                f"{self.corpus_sizes[corpus]} (corrupt); run `moe-train prepare`")
            self._raw[side][corpus] = lines
        return lines

    def raw_src(self, i: int) -> str:
        """Original (whitespace-normalised) source text of sentence i; dev/test only."""
        c, j = self._locate(i)
        return self._raw_lines("src", c)[j]

    def raw_tgt(self, i: int) -> str:
        """Original (whitespace-normalised) target text of sentence i: the BLEU reference."""
        c, j = self._locate(i)
        return self._raw_lines("tgt", c)[j]


def nonempty_split(prepared_dir: str | os.PathLike, split: str) -> ShardedDataset:
    """`split` of the prepared data, refused in one line when it holds no sentence (a split
    carved with ``data.<split>_per_domain=0``): nothing to train on, validate or score."""
    dataset = ShardedDataset(prepared_dir, split)
    if len(dataset) == 0:
        knob = "" if split == "train" else f" (prepared with data.{split}_per_domain=0?)"
        raise DataError(f"{dataset.prepared_dir / split}: holds no sentences{knob}")
    return dataset
