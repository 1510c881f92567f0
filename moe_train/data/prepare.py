"""The `prepare` step: validated text corpora -> sentencepiece model + binarized shards.

Steps: read and validate every corpus; carve dev/test from train where a corpus has no such files;
drop every train pair holding a dev/test source of any corpus, on either side in the same language
(``train_dropped_overlap``), so no held-out source is ever trained on (a reference may still be a
training target of another source: a common phrase, not the pair); train one joint sentencepiece
model on the train text of both sides, with every ``<2xx>`` target-language tag and every
``<dom:NAME>`` domain tag as a user-defined symbol whether or not they are used (so tagged and
untagged preparations of the same corpora share the model byte for byte); encode (optionally
prefixing each source with its domain tag, then its target-language tag); skip pairs with a side
longer than ``data.max_len`` tokens (tags included); write one shard per corpus per split and
``manifest.json``. Everything is built in a temporary directory renamed onto the output at the end,
so a failed run leaves nothing.

Manifest (``manifest.json``)::

    version, spm_model, vocab_size, pad_id, unk_id, bos_id, eos_id, lang_tags, domain_tags,
    domains (sorted), langs (sorted),
    corpora: [{name, domain, domain_id, src_lang, tgt_lang, src_lang_id, tgt_lang_id,
               lang_tag_id, domain_tag_id, carved: [splits carved from train],
               train_dropped_overlap, files: {split: {src, tgt}}}],
    splits: {split: {corpus_sizes: [per corpus], sentences, src_tokens, tgt_tokens,
                     skipped_too_long: [per corpus], skipped_empty: [per corpus],
                     sha256: digest of the split's shards}},
    data_config: {the DataConfig fields}, seed,
    content_sha256: digest of every other file of the directory (shards, tokenizer)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from moe_train.config.schema import DataConfig
from moe_train.data.corpus import DOMAIN_NAME, LANG_CODE, SPLITS, CorpusFiles, read_pairs, \
    valid_domain, valid_lang
from moe_train.data.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer
from moe_train.data.prompts import format_prompt
from moe_train.data.shards import MANIFEST, RAW_TEXT_SPLITS, ShardedDataset, read_manifest, \
    write_shard
from moe_train.data.vocab import Vocab, domain_tag, lang_tag, \
    train_sentencepiece
from moe_train.errors import ConfigError, DataError
from moe_train.utils.atomic import atomic_dir, check_out_dir, write_json
from moe_train.utils.provenance import digest_tree

MANIFEST_VERSION = 1
SPM_PREFIX = "spm"

Pairs = tuple[list[str], list[str]]


def load_manifest(prepared_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared directory (DataError if missing)."""
    manifest = read_manifest(prepared_dir)
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(f"{Path(prepared_dir) / MANIFEST}: manifest version "
                        f"{manifest.get('version')!r}, expected {MANIFEST_VERSION}; "
                        "run `moe-train prepare` again")
    return manifest


def check_fits_model(prepared_dir: str | os.PathLike, max_positions: int,
                     splits: tuple[str, ...] = ("train", "dev"),
                     field: str = "model.max_positions") -> None:
    """Refuse to train a model whose positions (`field`) are too few for the longest sentence
    of the training or validation split (+1 for the end-of-sentence token; for a decoder-only
    model's data, prompt and target together), before anything starts, rather than at the
    first batch or validation that meets it."""
    have = load_manifest(prepared_dir)["splits"]
    for split in (s for s in splits if s in have):
        data = ShardedDataset(prepared_dir, split)
        sides = (("source", data.src_lengths, 1), ("target", data.tgt_lengths, 1))
        if data.concatenated:  # one row: the prompt without its eos, the target after bos
            sides = (("prompt + target", data.src_lengths + data.tgt_lengths, 0),)
        for side, lengths, eos in sides:
            longest = int(lengths.max()) + eos if len(lengths) else 0
            if longest > max_positions:
                limit = "data.max_len" if split == "train" else "data.eval_max_len"
                raise ConfigError(
                    f"{field}: expected at least {longest}, got {max_positions} "
                    f"(the {split} split of {prepared_dir} has {side} sentences of "
                    f"{longest - eos} tokens" + (" plus end-of-sentence" if eos else "") +
                    f"; prepare limits each side with {limit})")


def check_prompt_template(prepared_dir: str | os.PathLike, template: str) -> None:
    """Refuse to train with another data.prompt_template than the one the prepared prompts
    were filled with ('' for none): a decoder-only model (whose config always has one) would
    learn other prompts than translate fills, and on data prepared without one it would be
    batched and checked as if source and target were two sequences; an encoder-decoder
    ('') would be budgeted as if they were one. Data written before the field: not checked."""
    stored = load_manifest(prepared_dir).get("data_config", {}).get("prompt_template")
    if stored is not None and stored != template:
        raise ConfigError(f"data.prompt_template: {prepared_dir} was prepared with "
                          f"{stored or 'none'!r}; expected the same template, got "
                          f"{template or 'none'!r} (a decoder-only model needs data prepared "
                          "with its template, an encoder-decoder data prepared without one; "
                          "or prepare again)")


def load_vocab(prepared_dir: str | os.PathLike) -> Vocab | HFTokenizer:
    """The tokenizer of a prepared directory: its sentencepiece model, or the Hugging Face
    tokenizer `prepare` copied there (``data.tokenizer``)."""
    return open_tokenizer(Path(prepared_dir), load_manifest(prepared_dir))


def open_tokenizer(directory: Path, manifest: dict[str, Any]) -> Vocab | HFTokenizer:
    """The tokenizer a manifest names, read from `directory` (a prepared dir or an export)."""
    if manifest.get("tokenizer") == HFTokenizer.kind:
        return HFTokenizer(directory)
    return Vocab(directory / manifest.get("spm_model", "spm.model"))


def tokenizer_files(directory: Path, manifest: dict[str, Any]) -> list[Path]:
    """The files of a manifest's tokenizer in `directory` (copied into checkpoints/exports)."""
    if manifest.get("tokenizer") == HFTokenizer.kind:
        return [directory / TOKENIZER_JSON, directory / TOKENIZER_CONFIG]
    return [directory / manifest.get("spm_model", "spm.model")]


def check_model_data(model_dir: Path, model_manifest: dict[str, Any], prepared: Path,
                     manifest: dict[str, Any]) -> dict[str, Any]:
    """Refuse prepared data a model did not see: another tokenizer (kind or file bytes), or
    other domain / language lists (the data's ids are read with the model's names). A model
    whose lists are empty (converted, it saw no corpus) takes the data's, and one without
    tokenizer files (converted from a directory that had none) is not compared; returns its
    manifest with the lists. One DataError line naming both directories."""
    kind = ["a Hugging Face tokenizer" if m.get("tokenizer") == HFTokenizer.kind
            else "sentencepiece" for m in (manifest, model_manifest)]
    if kind[0] != kind[1]:
        raise DataError(f"{prepared}: tokenized with {kind[0]}, the model {model_dir} with "
                        f"{kind[1]}; expected data prepared with the model's tokenizer")
    files = tokenizer_files(prepared, manifest)
    carried = any((model_dir / path.name).is_file() for path in files)  # converted: maybe none
    for path in files if carried else ():
        mine = model_dir / path.name
        if path.is_file() and (not mine.is_file() or mine.read_bytes() != path.read_bytes()):
            raise DataError(f"{prepared}: its {path.name} is not the model's ({model_dir}); "
                            "expected data prepared with the model's tokenizer")
    model_manifest = dict(model_manifest)
    for key in ("domains", "langs"):
        ours, theirs = list(manifest.get(key, [])), list(model_manifest.get(key, []))
        if not theirs:
            model_manifest[key] = ours
        elif ours != theirs:
            raise DataError(f"{prepared}: its {key} {', '.join(ours) or 'none'} are not the "
                            f"model's ({', '.join(theirs) or 'none'}, {model_dir}); prepare "
                            "the data with the model's data settings")
    return model_manifest


def _check_out_dir(out_dir: Path, overwrite: bool, sources: list[Path]) -> None:
    """Before any work: refuse to clobber prepared data (unless `overwrite`), anything that is
    not ours, the corpus itself, a mount point or the working directory, and a place where
    the directory cannot be made (`utils.atomic.check_out_dir`)."""
    check_out_dir(out_dir, "--out", MANIFEST, "prepare", sources)
    if (out_dir / MANIFEST).is_file() and not overwrite:
        raise DataError(f"{out_dir}: already holds prepared data; use --overwrite to replace it")


def _group(corpora: list[CorpusFiles]) -> dict[str, dict[str, CorpusFiles]]:
    """Corpus name -> split -> files, names sorted by (domain, src_lang, tgt_lang)."""
    if not corpora:
        raise DataError("prepare: no corpora given")
    groups: dict[str, dict[str, CorpusFiles]] = {}
    for files in sorted(corpora, key=lambda c: (c.domain, c.src_lang, c.tgt_lang)):
        by_split = groups.setdefault(files.name, {})
        if files.split in by_split:
            raise DataError(f"{files.src}: corpus {files.name} given twice for split "
                            f"{files.split} (also {by_split[files.split].src})")
        by_split[files.split] = files
    for name, by_split in groups.items():
        if "train" not in by_split:
            some = next(iter(by_split.values()))
            raise DataError(f"{some.src}: corpus {name} has no train split")
    return groups


def _carve_sizes(n: int, dev: int, test: int) -> tuple[int, int]:
    """Dev/test sizes to hold out of n pairs: as asked, but at most a third of n in total
    (shared in proportion to what was asked)."""
    budget = n // 3
    if dev + test <= budget:
        return dev, test
    dev_n = budget * dev // (dev + test)
    return dev_n, budget - dev_n


def _carve(files: CorpusFiles, pairs: dict[str, Pairs], cfg: DataConfig, seed: int
           ) -> list[str]:
    """Hold out dev/test pairs from train for the splits without files (in place); return
    the splits carved.

    The selection is seeded by `seed` and the file pair (not the direction), so ``de-en`` and
    ``en-de`` built from the same files hold out the same lines.
    """
    wanted = {s: n for s, n in (("dev", cfg.dev_per_domain), ("test", cfg.test_per_domain))
              if s not in pairs}
    src, tgt = pairs["train"]
    dev_n, test_n = _carve_sizes(len(src), wanted.get("dev", 0), wanted.get("test", 0))
    key = ".".join([files.domain, *sorted((files.src_lang, files.tgt_lang))])
    rng = np.random.default_rng([seed, zlib.crc32(key.encode("utf-8"))])
    order = rng.permutation(len(src))
    held = {"dev": np.sort(order[:dev_n]), "test": np.sort(order[dev_n:dev_n + test_n])}
    for split in wanted:
        pairs[split] = ([src[i] for i in held[split]], [tgt[i] for i in held[split]])
    keep = np.ones(len(src), dtype=bool)
    keep[order[:dev_n + test_n]] = False
    pairs["train"] = ([s for s, k in zip(src, keep) if k], [t for t, k in zip(tgt, keep) if k])
    return sorted(wanted, key=SPLITS.index)


def _drop_held_out_sources(texts: dict[str, dict[str, Pairs]], langs: dict[str, tuple[str, str]]
                           ) -> dict[str, int]:
    """Drop every train pair that holds a dev or test source of any corpus, on either side in
    the same language (in place), so that no held-out sentence is trained on, not even through
    another domain or the reverse direction that shares it (its source as a training target);
    sentences compare as sentencepiece reads them (`_norm`). `langs`: each
    corpus's (source, target) language. Returns the pairs dropped per corpus."""
    held = {(langs[name][0], _norm(s)) for name, by_split in texts.items()
            for split in ("dev", "test") if split in by_split for s in by_split[split][0]}
    dropped = {}
    for name, by_split in texts.items():
        src, tgt = by_split["train"]
        src_lang, tgt_lang = langs[name]
        keep = [i for i, (s, t) in enumerate(zip(src, tgt))
                if (src_lang, _norm(s)) not in held and (tgt_lang, _norm(t)) not in held]
        by_split["train"] = ([src[i] for i in keep], [tgt[i] for i in keep])
        dropped[name] = len(src) - len(keep)
    return dropped


def _check_no_tags(files: CorpusFiles, pairs: Pairs, tags: list[str], kept_for: str,
                   normalized: bool = False) -> None:
    """No sentence holds a control piece of this vocabulary: a tag (``<2de>``, ``<dom:law>``) of
    sentencepiece, which matches its user-defined pieces inside any text, or a special token
    (``<|endoftext|>``) of a Hugging Face tokenizer, which does the same. Such a sentence would
    carry a control token (a target language, a domain, an end of text) the model obeys.
    `normalized`: also as sentencepiece reads the line (NFKC: full-width ``＜2en＞`` is the
    tag; only a non-ASCII line can change)."""
    for path, lines in zip((files.src, files.tgt), pairs):
        hit = first_tag(lines, tags, normalized)
        if hit is not None:
            raise DataError(f"{path}:{hit[0]}: holds {hit[1]!r}, which this vocabulary keeps "
                            f"for {kept_for}; remove or reword it")


def first_tag(lines: Iterable[str], tags: list[str], normalized: bool = False
              ) -> tuple[int, str] | None:
    """(line number from 1, the tag) of the first of `lines` holding one of `tags`, None when
    none does; `normalized`: also as sentencepiece reads the line (see `_check_no_tags`)."""
    found = re.compile("|".join(map(re.escape, tags))) if tags else None
    if found is None:
        return None
    for line_no, line in enumerate(lines, start=1):
        hit = found.search(line) or (normalized and not line.isascii()
                                     and found.search(_norm(line)))
        if hit:
            return line_no, hit.group()
    return None


def _norm(sentence: str) -> str:
    """`sentence` as sentencepiece's default rule (nmt_nfkc) reads it: NFKC, without control or
    zero-width characters (a BOM or U+200B in the middle of a file), spaces collapsed. Two
    sentences equal here encode alike, so a held-out one cannot come back through an invisible
    difference."""
    return _nmt_nfkc().normalize(sentence)


@functools.lru_cache(maxsize=1)
def _nmt_nfkc() -> Any:
    import sentencepiece as spm

    return spm.SentencePieceNormalizer(rule_name="nmt_nfkc")


def _encode_split(vocab: Vocab, src: list[str], tgt: list[str], prefix: list[int],
                  max_len: int) -> tuple[list[list[int]], list[list[int]], list[int], int, int]:
    """Encode a corpus split, each source after the tag ids `prefix`; keep pairs whose sides are
    non-empty and at most max_len tokens (the tags included). Returns (src_ids, tgt_ids, kept
    indices, skipped_too_long, skipped_empty)."""
    src_all, tgt_all = vocab.encode_batch(src), vocab.encode_batch(tgt)
    src_ids, tgt_ids, kept = [], [], []
    too_long = empty = 0
    for i, (s, t) in enumerate(zip(src_all, tgt_all)):
        if not s or not t:  # e.g. a line of zero-width characters the normaliser removes
            empty += 1
            continue
        s = [*prefix, *s]
        if len(s) > max_len or len(t) > max_len:
            too_long += 1
            continue
        src_ids.append(s)
        tgt_ids.append(t)
        kept.append(i)
    return src_ids, tgt_ids, kept, too_long, empty


def prepare(corpora: list[CorpusFiles], out_dir: str | os.PathLike, data_cfg: DataConfig,
            seed: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Validate, split, tokenize and binarize `corpora` into `out_dir`; return the manifest.

    An existing prepared `out_dir` is replaced only with `overwrite` (after the new one is
    complete). Prints nothing.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite, [p for files in corpora for p in (files.src, files.tgt)])
    groups = _group(corpora)
    for files in corpora:  # each domain is one <dom:NAME> piece of the vocabulary
        if not valid_domain(files.domain):  # and names the shard files: no "/", "..", spaces
            raise ConfigError(f"{files.src}: domain {files.domain!r} must be a non-empty name of "
                              f"{DOMAIN_NAME} (it becomes the domain tag <dom:NAME> and part of "
                              "the shard file names)")
        for lang in (files.src_lang, files.tgt_lang):
            if not valid_lang(lang):
                raise ConfigError(f"{files.src}: language code {lang!r} must be {LANG_CODE} "
                                  "(it becomes part of the xx-yy pair and the shard file names)")
    names = list(groups)
    train_files = {name: by_split["train"] for name, by_split in groups.items()}

    if data_cfg.tokenizer:
        tags, kept_for = HFTokenizer(data_cfg.tokenizer).special_tokens(), "a special token"
    else:
        tags = [*map(lang_tag, sorted({c.tgt_lang for c in train_files.values()})),
                *map(domain_tag, sorted({c.domain for c in train_files.values()}))]
        kept_for = "a tag (target language / domain)"
    texts: dict[str, dict[str, Pairs]] = {}
    carved: dict[str, list[str]] = {}
    for name, by_split in groups.items():
        texts[name] = {split: read_pairs(files, data_cfg.max_chars)
                       for split, files in by_split.items()}
        for split, files in by_split.items():
            _check_no_tags(files, texts[name][split], tags, kept_for,
                           normalized=not data_cfg.tokenizer)
        carved[name] = _carve(train_files[name], texts[name], data_cfg, seed)
    dropped = _drop_held_out_sources(texts, {n: (f.src_lang, f.tgt_lang)
                                             for n, f in train_files.items()})

    domains = sorted({c.domain for c in train_files.values()})
    langs = sorted({lang for c in train_files.values() for lang in (c.src_lang, c.tgt_lang)})
    tgt_langs = sorted({c.tgt_lang for c in train_files.values()})

    with atomic_dir(out_dir, overwrite=True) as tmp:
        if data_cfg.tokenizer:
            for path in HFTokenizer(data_cfg.tokenizer).files():
                shutil.copyfile(path, tmp / path.name)
            vocab: Vocab | HFTokenizer = HFTokenizer(tmp)
            model = tmp / TOKENIZER_JSON
        else:
            train_text = (line for name in names for side in texts[name]["train"]
                          for line in side)
            model = train_sentencepiece(
                train_text, tmp / SPM_PREFIX, data_cfg.vocab_size, data_cfg.spm_model_type,
                [*map(lang_tag, tgt_langs), *map(domain_tag, domains)], seed,
                data_cfg.spm_max_sentences)
            vocab = Vocab(model)

        corpus_entries = []
        for name in names:
            files = train_files[name]
            corpus_entries.append({
                "name": name, "domain": files.domain, "domain_id": domains.index(files.domain),
                "src_lang": files.src_lang, "tgt_lang": files.tgt_lang,
                "src_lang_id": langs.index(files.src_lang),
                "tgt_lang_id": langs.index(files.tgt_lang),
                "lang_tag_id": None if data_cfg.tokenizer else vocab.lang_tag_id(files.tgt_lang),
                "domain_tag_id": None if data_cfg.tokenizer else
                vocab.domain_tag_id(files.domain),
                "carved": carved[name], "train_dropped_overlap": dropped[name],
                "files": {split: {"src": str(f.src), "tgt": str(f.tgt)}
                          for split, f in groups[name].items()},
            })

        splits: dict[str, dict[str, Any]] = {}
        for split in SPLITS:
            split_dir = tmp / split
            split_dir.mkdir()
            stats: dict[str, Any] = {"corpus_sizes": [], "sentences": 0, "src_tokens": 0,
                                     "tgt_tokens": 0, "skipped_too_long": [],
                                     "skipped_empty": []}
            for name in names:
                src, tgt = texts[name].get(split, ([], []))
                files = train_files[name]
                prefix = [] if data_cfg.tokenizer else vocab.source_prefix(
                    files.domain if data_cfg.domain_tags else None,
                    files.tgt_lang if data_cfg.lang_tags else None)
                limit = data_cfg.max_len if split == "train" else data_cfg.eval_max_len
                prompts = src if not data_cfg.prompt_template else [
                    format_prompt(data_cfg.prompt_template, line, files.src_lang,
                                  files.tgt_lang) for line in src]
                src_ids, tgt_ids, kept, too_long, empty = _encode_split(
                    vocab, prompts, tgt, prefix, limit)
                raw = split in RAW_TEXT_SPLITS
                write_shard(split_dir, name, src_ids, tgt_ids,
                            raw_src=[src[i] for i in kept] if raw else None,
                            raw_tgt=[tgt[i] for i in kept] if raw else None)
                stats["corpus_sizes"].append(len(src_ids))
                stats["sentences"] += len(src_ids)
                stats["src_tokens"] += sum(map(len, src_ids))
                stats["tgt_tokens"] += sum(map(len, tgt_ids))
                stats["skipped_too_long"].append(too_long)
                stats["skipped_empty"].append(empty)
            if split == "train" and not stats["sentences"]:  # `train` would refuse it later
                raise DataError(
                    f"{out_dir}: no training pair is left ({sum(stats['skipped_too_long'])} "
                    f"longer than data.max_len={data_cfg.max_len} tokens, "
                    f"{sum(stats['skipped_empty'])} with no tokens); expected some (raise "
                    "data.max_len)")
            stats["sha256"] = digest_tree(split_dir)  # resume compares the training split's
            splits[split] = stats

        manifest = {
            "version": MANIFEST_VERSION, "spm_model": model.name, "vocab_size": vocab.size,
            "tokenizer": HFTokenizer.kind if data_cfg.tokenizer else "spm",
            "pad_id": vocab.pad_id, "unk_id": vocab.unk_id, "bos_id": vocab.bos_id,
            "eos_id": vocab.eos_id,
            "lang_tags": data_cfg.lang_tags, "domain_tags": data_cfg.domain_tags,
            "domains": domains, "langs": langs,
            "corpora": corpus_entries, "splits": splits,
            "data_config": dataclasses.asdict(data_cfg),
            "seed": seed,  # what carved dev / test and sampled sentencepiece's text
            # every file written above, so that re-prepared data of the same sizes (a fixed
            # sentence, a reordered corpus) still changes this manifest and the stages that
            # read it (stages/record.py) see it
            "content_sha256": digest_tree(tmp),
        }
        write_json(tmp / MANIFEST, manifest)  # last: its presence marks a complete directory
    return manifest
