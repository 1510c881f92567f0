"""Joint sentencepiece vocabulary: training it (deterministically) and using it.

Fixed special ids: pad=0, unk=1, bos=2, eos=3. Target-language tags ``<2xx>`` and domain tags
``<dom:NAME>`` are user-defined symbols, so each is always one piece with its own id (prefixed to
sources with ``data.lang_tags`` / ``data.domain_tags``).

Small corpora cannot fill a large vocabulary; sentencepiece then refuses with "Vocabulary size too
high ... <= N". We train with ``hard_vocab_limit=False`` (the size is an upper bound) and, should
sentencepiece still refuse, retry once with the size it names. The size actually reached is
`Vocab.size` (and ``vocab_size`` in the manifest).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import sentencepiece as spm

from moe_train.data.corpus import collapse_spaces
from moe_train.errors import DataError
from moe_train.utils.atomic import atomic_path, write_text

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TRAIN_THREADS = 2
"""sentencepiece trainer threads, fixed: the model it learns depends on the thread count, so
taking the machine's core count made two machines prepare different models from the same
text (a tagged preparation refused as another model's, a resume refused its tokenizer)."""


def lang_tag(lang: str) -> str:
    """The target-language tag piece, e.g. ``<2de>``."""
    return f"<2{lang}>"


def domain_tag(domain: str) -> str:
    """The domain tag piece, e.g. ``<dom:EMEA>``."""
    return f"<dom:{domain}>"


_TAG_PIECE = re.compile(r"(?:<2[^>\s]+>|<dom:[^>\s]+>)\Z")
"""What `lang_tag` and `domain_tag` make."""


def _sample(texts: Iterable[str], max_sentences: int, seed: int) -> list[str]:
    """All texts, or a seeded random subset of `max_sentences` of them in their original order."""
    texts = list(texts)
    if len(texts) <= max_sentences:
        return texts
    keep = np.random.default_rng(seed).choice(len(texts), size=max_sentences, replace=False)
    return [texts[i] for i in np.sort(keep)]


def _train(sentences: list[str], vocab_size: int, model_type: str, user_symbols: list[str],
           seed: int) -> bytes:
    """Train in memory and return the serialized model.

    Sentences are streamed from Python and the model comes back as bytes, so the model holds no
    temporary file names and identical inputs give byte-identical models.
    """
    spm.set_random_generator_seed(seed)
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=writer, vocab_size=vocab_size,
        model_type=model_type, hard_vocab_limit=False,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        user_defined_symbols=user_symbols, character_coverage=0.9995,
        input_sentence_size=0, shuffle_input_sentence=False,  # we sample ourselves, seeded
        max_sentence_length=1 << 16, num_threads=TRAIN_THREADS,
        minloglevel=2)
    return writer.getvalue()


def train_sentencepiece(texts: Iterable[str], out_prefix: str | os.PathLike, vocab_size: int,
                        model_type: str, user_symbols: list[str], seed: int,
                        max_sentences: int) -> Path:
    """Train a sentencepiece model on `texts`; write ``{out_prefix}.model`` / ``.vocab``.

    At most `max_sentences` texts (a seeded sample) are used. The model is trained in memory and
    each file is written to a temporary name and renamed into place (the ``.model`` last), so a
    ``.model`` on disk is always complete. Returns the path of the ``.model`` file.
    """
    out_prefix = Path(out_prefix)
    sample = _sample(texts, max_sentences, seed)
    if not sample:
        raise DataError(f"{out_prefix}.model: no training text for sentencepiece")
    size = vocab_size
    for attempt in range(2):
        try:
            proto = _train(sample, size, model_type, list(user_symbols), seed)
            break
        except RuntimeError as err:
            too_high = re.search(r"Please set it to a value <= (\d+)", str(err))
            too_small = re.search(r"required_chars\. (\d+) vs (\d+)", str(err))
            if too_high and attempt == 0:
                size = int(too_high.group(1))  # the corpus cannot fill vocab_size: shrink it
                continue
            if too_small:
                raise DataError(f"data.vocab_size: {vocab_size} is too small; the text needs "
                                f"at least {too_small.group(2)} pieces") from None
            raise DataError(f"{out_prefix}.model: sentencepiece training failed: "
                            f"{str(err).splitlines()[0]}") from None
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab_text = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n"
                         for i in range(sp.get_piece_size()))
    write_text(out_prefix.with_name(f"{out_prefix.name}.vocab"), vocab_text)
    model = out_prefix.with_name(f"{out_prefix.name}.model")
    with atomic_path(model) as tmp:
        tmp.write_bytes(proto)
    return model


class Vocab:
    """A trained sentencepiece model: text <-> token ids."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.path = Path(model_path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: sentencepiece model not found; "
                            "run `moe-train prepare` first")
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self._tags = frozenset(i for i in range(self._sp.get_piece_size())
                               if _TAG_PIECE.match(self._sp.id_to_piece(i)))

    # Pickling (e.g. for worker processes) reloads the model from its file.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def size(self) -> int:
        """Number of pieces (ids are 0 .. size-1)."""
        return self._sp.get_piece_size()

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str) -> list[int]:
        """Token ids of one sentence (no bos/eos)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many sentences in one call (sentencepiece parallelises it)."""
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a token sequence: stops at the first eos, drops pad, bos and the tag pieces
        (source-side only: never text), and collapses whitespace as the references were
        (`collapse_spaces`: a generated "▁▁" or a final "▁" is no extra space)."""
        out: list[int] = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id) and i not in self._tags:
                out.append(i)
        return collapse_spaces(self._sp.decode(out))

    def piece(self, token_id: int) -> str:
        """The piece string of one id."""
        return self._sp.id_to_piece(int(token_id))

    def lang_tag(self, lang: str) -> str:
        """The target-language tag, e.g. ``<2de>``."""
        return lang_tag(lang)

    def _tag_id(self, tag: str, kind: str, what: str) -> int:
        """Id of a user-defined tag piece; DataError naming the model if it has none."""
        token_id = self._sp.piece_to_id(tag)
        if self._sp.id_to_piece(token_id) != tag:
            raise DataError(f"{self.path}: no {kind} tag {tag} in the vocabulary "
                            f"(was the data prepared with this {what}?)")
        return token_id

    def lang_tag_id(self, lang: str) -> int:
        """Id of the ``<2xx>`` tag; DataError if the vocabulary has no such tag."""
        return self._tag_id(lang_tag(lang), "language", "target language")

    def domain_tag_id(self, domain: str) -> int:
        """Id of the ``<dom:NAME>`` tag; DataError if the vocabulary has no such tag."""
        return self._tag_id(domain_tag(domain), "domain", "domain")

    def source_prefix(self, domain: str | None = None, tgt_lang: str | None = None) -> list[int]:
        """Tag ids that start a source: the domain tag (if `domain`), then the language tag (if
        `tgt_lang`)."""
        return ([self.domain_tag_id(domain)] if domain is not None else []) + \
            ([self.lang_tag_id(tgt_lang)] if tgt_lang is not None else [])
