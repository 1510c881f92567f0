"""A Hugging Face tokenizer (``tokenizer.json``) behind the `Vocab` interface.

Decoder-only models (``model.arch: hf_qwen2_moe``) keep their own tokenizer: ``data.tokenizer``
names a local directory with ``tokenizer.json`` (read with the `tokenizers` library: a JSON
description, no code runs) and ``tokenizer_config.json`` (its special tokens). `prepare` then
encodes with it instead of training sentencepiece and copies both files beside the shards.

Special ids: eos is the config's ``eos_token``; pad is its ``pad_token`` when that differs
from eos, else the first id past the tokenizer (an embedding row no text maps to): the loss
ignores padding, so pad must never be eos, which is a label. bos is the config's
``bos_token`` or, without one (Qwen), eos; decoder-only models never read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moe_train.data.corpus import collapse_spaces
from moe_train.errors import DataError
from moe_train.utils.safe_load import read_json_object

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """Text <-> ids with a ``tokenizer.json`` of a Hugging Face model directory."""

    kind = "hf"

    def __init__(self, directory: str | os.PathLike) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.path = self.directory / TOKENIZER_JSON
        if not self.path.is_file():
            raise DataError(f"{self.path}: missing; expected the Hugging Face tokenizer of "
                            "data.tokenizer (a model directory with tokenizer.json)")
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # noqa: BLE001  (tokenizers raises its own Exception types)
            raise DataError(f"{self.path}: not a readable tokenizer.json "
                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
        config = read_json_object(self.directory / TOKENIZER_CONFIG,
                                  "the tokenizer's special tokens (tokenizer_config.json)",
                                  DataError)
        # rows the ids need: one past the largest (a count would land on a real id where the
        # tokenizer leaves a gap, and a pad placed there could be eos)
        self._size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        eos = _token(config, "eos_token")
        self._eos = self._id(eos, "eos_token")
        pad = _token(config, "pad_token")
        self._pad = self._id(pad, "pad_token") if pad is not None and pad != eos else self._size
        bos = _token(config, "bos_token")
        self._bos = self._id(bos, "bos_token") if bos is not None else self._eos
        unk = _token(config, "unk_token")
        self._unk = self._id(unk, "unk_token") if unk is not None else self._pad

    def _id(self, token: str | None, key: str) -> int:
        token_id = None if token is None else self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(f"{self.directory / TOKENIZER_CONFIG}: {key} {token!r} is not a "
                            f"token of {TOKENIZER_JSON}; expected one of its special tokens")
        return token_id

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def unk_id(self) -> int:
        return self._unk

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def size(self) -> int:
        """Ids the model must hold: the tokenizer's, plus the pad row when pad is its own."""
        return max(self._size, self._pad + 1)

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a token sequence: stops at the first eos, drops pad and special tokens, and
        collapses whitespace as the references were (`collapse_spaces`)."""
        out: list[int] = []
        for i in (int(x) for x in ids):
            if i == self._eos:
                break
            if i != self._pad:
                out.append(i)
        return collapse_spaces(self._tok.decode(out, skip_special_tokens=True))

    def piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    def special_tokens(self) -> list[str]:
        """The texts of its special added tokens (``<|endoftext|>``, ``<|im_start|>``): the
        tokenizer reads them as those tokens wherever they appear in a text."""
        return sorted(t.content for t in self._tok.get_added_tokens_decoder().values()
                      if t.special and t.content)

    def files(self) -> list[Path]:
        """The files `prepare` copies beside the shards."""
        return [self.path, self.directory / TOKENIZER_CONFIG]


def train_bpe_tokenizer(texts: Sequence[str], out_dir: str | os.PathLike, vocab_size: int,
                        eos_token: str = "<|endoftext|>") -> Path:
    """Train a byte-level BPE tokenizer (Qwen's kind, with its end-of-text token as eos and
    pad) on `texts` and write tokenizer.json + tokenizer_config.json to `out_dir` atomically:
    a local stand-in for a model directory's tokenizer (tests, the tiny CPU configs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moe_train.utils.atomic import atomic_dir

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    out = Path(out_dir)
    with atomic_dir(out, overwrite=True) as tmp:
        tok.save(str(tmp / TOKENIZER_JSON))
        config = {"eos_token": eos_token, "pad_token": eos_token, "bos_token": None,
                  "model_max_length": 32768}
        (tmp / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
