"""prepare -> ShardedDataset round trips, carving, lang and domain tags, atomicity, determinism,
vocab."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from moe_train.config.schema import DataConfig
from moe_train.data.corpus import CorpusFiles, discover, plain_corpus, read_pairs
from moe_train.data.prepare import _carve_sizes, _encode_split, load_manifest, load_vocab, \
    prepare
from moe_train.data.shards import ShardedDataset, nonempty_split, write_shard
from moe_train.data.vocab import Vocab, train_sentencepiece
from moe_train.errors import DataError
from moe_train.utils.atomic import write_json

OPUS = Path("/work/shared/data/opus-multidomain")
SRC_WORDS = "der die das haus katze hund baum wasser gruen rot blau klein gross alt neu".split()
TGT_WORDS = "the the the house cat dog tree water green red blue small big old new".split()


def _sentences(n: int, seed: int, lengths: tuple[int, int] = (2, 6)) -> tuple[list[str], list[str]]:
    """n unique aligned pairs (a running number keeps every source distinct)."""
    rng = random.Random(seed)
    src, tgt = [], []
    for i in range(n):
        idx = [rng.randrange(len(SRC_WORDS)) for _ in range(rng.randint(*lengths))]
        src.append(" ".join(SRC_WORDS[j] for j in idx) + f" {i}")
        tgt.append(" ".join(TGT_WORDS[j] for j in idx) + f" {i}")
    return src, tgt


def _corpus(root: Path, domain: str, n: int, seed: int, split: str = "train",
            src_lang: str = "de", tgt_lang: str = "en") -> CorpusFiles:
    src, tgt = _sentences(n, seed)
    folder = root / domain
    folder.mkdir(parents=True, exist_ok=True)
    src_path = folder / f"{domain}.{src_lang}-{tgt_lang}.{split}.{src_lang}"
    tgt_path = folder / f"{domain}.{src_lang}-{tgt_lang}.{split}.{tgt_lang}"
    src_path.write_text("\n".join(src) + "\n", encoding="utf-8")
    tgt_path.write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return plain_corpus(src_path, tgt_path, domain, src_lang, tgt_lang, split)


def _cfg(**kw: object) -> DataConfig:
    base: dict[str, object] = dict(vocab_size=120, dev_per_domain=5, test_per_domain=4,
                                   max_len=64, max_tokens=65)
    base.update(kw)
    return DataConfig(**base)  # type: ignore[arg-type]


@pytest.fixture()
def two_domains(tmp_path: Path) -> list[CorpusFiles]:
    return [_corpus(tmp_path / "data", "law", 60, seed=1),
            _corpus(tmp_path / "data", "med", 45, seed=2)]


def _texts(ds: ShardedDataset, vocab: Vocab, side: str) -> list[str]:
    get = ds.src if side == "src" else ds.tgt
    return [vocab.decode(get(i)) for i in range(len(ds))]


# --- round trip ---------------------------------------------------------------------------------

def test_round_trip_carving_ids_and_lengths(tmp_path: Path,
                                            two_domains: list[CorpusFiles]) -> None:
    out = tmp_path / "prepared"
    manifest = prepare(two_domains, out, _cfg(), seed=3)
    assert manifest == load_manifest(out)
    assert manifest["domains"] == ["law", "med"] and manifest["langs"] == ["de", "en"]
    assert [(c["name"], c["domain_id"], c["src_lang_id"], c["tgt_lang_id"])
            for c in manifest["corpora"]] == [("law.de-en", 0, 0, 1), ("med.de-en", 1, 0, 1)]
    assert (manifest["pad_id"], manifest["unk_id"], manifest["bos_id"], manifest["eos_id"]) == (
        0, 1, 2, 3)
    vocab = load_vocab(out)
    assert manifest["vocab_size"] == vocab.size == len(vocab) <= 120

    full = [read_pairs(c, 2048) for c in two_domains]
    ds = {split: ShardedDataset(out, split) for split in ("train", "dev", "test")}
    assert [ds["dev"].corpus_sizes, ds["test"].corpus_sizes] == [[5, 5], [4, 4]]
    assert ds["train"].corpus_sizes == [60 - 9, 45 - 9]
    assert list(ds["train"].corpus_offsets) == [0, 51]
    assert ds["train"].corpus_names == ["law.de-en", "med.de-en"] and ds["train"].num_corpora == 2

    for c, (src, tgt) in enumerate(full):
        held = {split: {ds[split].raw_src(i) for i in range(len(ds[split]))
                        if ds[split].corpus_ids[i] == c} for split in ("dev", "test")}
        assert held["dev"].isdisjoint(held["test"])
        # train keeps every other pair, in file order; dev/test are real pairs of the corpus
        expected_train = [i for i, s in enumerate(src) if s not in held["dev"] | held["test"]]
        lo = int(ds["train"].corpus_offsets[c])
        for k, i in enumerate(expected_train):
            assert list(ds["train"].src(lo + k)) == vocab.encode(src[i])
            assert list(ds["train"].tgt(lo + k)) == vocab.encode(tgt[i])
        for split in ("dev", "test"):
            d = ds[split]
            for i in np.flatnonzero(d.corpus_ids == c):
                j = src.index(d.raw_src(i))
                assert d.raw_tgt(i) == tgt[j]
                assert list(d.src(i)) == vocab.encode(src[j])
                assert list(d.tgt(i)) == vocab.encode(tgt[j])

    train = ds["train"]
    assert len(train) == 87 and train.src(0).dtype == np.int64
    assert list(train.corpus_ids) == [0] * 51 + [1] * 36
    assert list(train.domain_ids) == [0] * 51 + [1] * 36
    assert set(train.src_lang_ids) == {0} and set(train.tgt_lang_ids) == {1}
    assert [len(train.src(i)) for i in range(len(train))] == list(train.src_lengths)
    assert [len(train.tgt(i)) for i in range(len(train))] == list(train.tgt_lengths)
    assert manifest["splits"]["train"]["src_tokens"] == int(train.src_lengths.sum())
    assert manifest["splits"]["train"]["sentences"] == 87
    with pytest.raises(DataError, match="only kept for dev and test"):
        train.raw_src(0)
    with pytest.raises(IndexError):
        train.src(87)


def test_round_trip_decodes_to_text(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    out = tmp_path / "prepared"
    prepare(two_domains, out, _cfg())
    vocab, dev = load_vocab(out), ShardedDataset(out, "dev")
    assert _texts(dev, vocab, "src") == [dev.raw_src(i) for i in range(len(dev))]
    assert _texts(dev, vocab, "tgt") == [dev.raw_tgt(i) for i in range(len(dev))]


def test_carve_sizes_capped_at_a_third() -> None:
    assert _carve_sizes(100, 5, 4) == (5, 4)
    assert _carve_sizes(12, 10, 10) == (2, 2)  # budget 4 shared in proportion
    assert _carve_sizes(30, 20, 0) == (10, 0)
    assert _carve_sizes(2, 5, 5) == (0, 0)


def test_small_corpus_holds_out_at_most_a_third(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "data", "tiny", 12, seed=4)
    manifest = prepare([corpus], tmp_path / "out", _cfg(dev_per_domain=10, test_per_domain=10))
    sizes = {s: manifest["splits"][s]["corpus_sizes"] for s in ("train", "dev", "test")}
    assert sizes == {"train": [8], "dev": [2], "test": [2]}


def test_existing_dev_files_are_used_not_carved(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _corpus(root, "law", 30, seed=5)
    _corpus(root, "law", 7, seed=5, split="dev")  # same seed: repeats train pairs 0..6
    corpora = discover(root)
    manifest = prepare(corpora, tmp_path / "out", _cfg(dev_per_domain=5, test_per_domain=3))
    assert manifest["corpora"][0]["carved"] == ["test"]
    dev_src, _ = read_pairs(corpora[1], 2048)
    dev = ShardedDataset(tmp_path / "out", "dev")
    assert [dev.raw_src(i) for i in range(len(dev))] == dev_src
    # train sources equal to a dev source are dropped so that dev is never trained on
    vocab = load_vocab(tmp_path / "out")
    train_src = set(_texts(ShardedDataset(tmp_path / "out", "train"), vocab, "src"))
    assert train_src.isdisjoint(dev_src)
    overlap = manifest["corpora"][0]["train_dropped_overlap"]
    assert 4 <= overlap <= 7  # pairs 0..6 minus those carved into test
    assert manifest["splits"]["train"]["corpus_sizes"] == [30 - 3 - overlap]


def test_held_out_sources_are_not_trained_on_in_any_corpus(tmp_path: Path) -> None:
    """Two domains sharing their sentences: what one holds out, the other does not train on
    (a carved test sentence seen through another domain or direction is a leak)."""
    root = tmp_path / "data"
    _corpus(root, "law", 30, seed=6)
    _corpus(root, "med", 30, seed=6)  # the same 30 pairs
    _corpus(root, "it", 30, seed=6, src_lang="en", tgt_lang="de")  # en sources: not the same text
    manifest = prepare(discover(root), tmp_path / "out", _cfg(dev_per_domain=3, test_per_domain=3))
    vocab, names = load_vocab(tmp_path / "out"), [c["name"] for c in manifest["corpora"]]

    def by_corpus(split: str) -> dict[str, set[str]]:
        texts = iter(_texts(ShardedDataset(tmp_path / "out", split), vocab, "src"))
        sizes = manifest["splits"][split]["corpus_sizes"]
        return {name: {next(texts) for _ in range(n)} for name, n in zip(names, sizes)}

    train, dev, test = by_corpus("train"), by_corpus("dev"), by_corpus("test")
    held_de = set().union(*(split[n] for split in (dev, test) for n in ("law.de-en", "med.de-en")))
    assert len(held_de) >= 6 and not (train["law.de-en"] | train["med.de-en"]) & held_de
    by_name = {c["name"]: c for c in manifest["corpora"]}
    law_held, med_held = dev["law.de-en"] | test["law.de-en"], dev["med.de-en"] | test["med.de-en"]
    assert by_name["law.de-en"]["train_dropped_overlap"] == len(med_held - law_held) > 0
    assert len(train["law.de-en"]) == 30 - 6 - by_name["law.de-en"]["train_dropped_overlap"]
    # a corpus in another source language is compared in its own language only
    assert by_name["it.en-de"]["train_dropped_overlap"] == 0


def test_zero_dev_split_is_empty_but_loadable(tmp_path: Path,
                                              two_domains: list[CorpusFiles]) -> None:
    prepare(two_domains, tmp_path / "out", _cfg(dev_per_domain=0))
    dev = ShardedDataset(tmp_path / "out", "dev")
    assert len(dev) == 0 and dev.corpus_sizes == [0, 0] and dev.src_lengths.shape == (0,)


# --- lang and domain tags, length filter --------------------------------------------------------

def test_lang_tags_prefix_source_and_both_directions_hold_out_same_lines(tmp_path: Path) -> None:
    _corpus(tmp_path / "data", "law", 40, seed=7)
    corpora = discover(tmp_path / "data", pairs=["de-en", "en-de"])
    out = tmp_path / "out"
    manifest = prepare(corpora, out, _cfg(lang_tags=True))
    vocab = load_vocab(out)
    tags = {lang: vocab.lang_tag_id(lang) for lang in ("de", "en")}
    assert vocab.piece(tags["en"]) == "<2en>" and vocab.lang_tag("de") == "<2de>"
    assert [c["lang_tag_id"] for c in manifest["corpora"]] == [tags["en"], tags["de"]]
    dev = ShardedDataset(out, "dev")
    for i in range(len(dev)):
        tgt_lang = manifest["langs"][dev.tgt_lang_ids[i]]
        src = dev.src(i)
        assert src[0] == tags[tgt_lang]
        assert list(src[1:]) == vocab.encode(dev.raw_src(i))
    # de-en dev sources are exactly the en-de dev targets (same lines held out)
    de_en = [dev.raw_src(i) for i in range(len(dev)) if dev.corpus_ids[i] == 0]
    en_de = [dev.raw_tgt(i) for i in range(len(dev)) if dev.corpus_ids[i] == 1]
    assert de_en == en_de and len(de_en) == 5


def test_lang_tags_off_keeps_tags_in_vocab_but_not_in_source(
        tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    prepare(two_domains, tmp_path / "out", _cfg())
    vocab, train = load_vocab(tmp_path / "out"), ShardedDataset(tmp_path / "out", "train")
    tag = vocab.lang_tag_id("en")
    assert all(tag not in train.src(i) for i in range(len(train)))
    with pytest.raises(DataError, match=r"<2fr>"):
        vocab.lang_tag_id("fr")

    # A hypothesis reads as the references do: no tag piece (source-side only), no "▁▁" run
    # or final "▁" as extra spaces.
    words, space = vocab.encode("katze hund"), vocab._sp.piece_to_id("▁")
    assert vocab.decode([tag, *words, space, space, *words, space]) == "katze hund katze hund"


def test_domain_tags_come_first_and_leave_the_spm_model_as_it_is(
        tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    plain = prepare(two_domains, tmp_path / "plain", _cfg(lang_tags=True))
    tagged = prepare(two_domains, tmp_path / "tagged", _cfg(lang_tags=True, domain_tags=True))
    assert (plain["domain_tags"], tagged["domain_tags"]) == (False, True)
    # the tags are in the vocabulary either way: one model serves tagged and untagged data
    assert (tmp_path / "plain" / "spm.model").read_bytes() == \
        (tmp_path / "tagged" / "spm.model").read_bytes()
    assert plain["corpora"] == tagged["corpora"]
    vocab = load_vocab(tmp_path / "tagged")
    dom = {d: vocab.domain_tag_id(d) for d in ("law", "med")}
    assert vocab.piece(dom["med"]) == "<dom:med>" and len(set(dom.values())) == 2
    assert [c["domain_tag_id"] for c in tagged["corpora"]] == [dom["law"], dom["med"]]
    assert vocab.source_prefix("med", "en") == [dom["med"], vocab.lang_tag_id("en")]
    with pytest.raises(DataError, match=r"tagged/spm\.model: no domain tag <dom:news>"):
        vocab.domain_tag_id("news")
    for split in ("train", "dev"):
        a, b = ShardedDataset(tmp_path / "plain", split), ShardedDataset(tmp_path / "tagged", split)
        assert len(a) == len(b) and list(b.src_lengths) == list(a.src_lengths + 1)
        for i in range(len(a)):
            src = b.src(i)
            assert src[0] == dom[tagged["domains"][b.domain_ids[i]]]
            assert list(src[1:]) == list(a.src(i)) and src[1] == vocab.lang_tag_id("en")
            assert list(b.tgt(i)) == list(a.tgt(i))
    train = ShardedDataset(tmp_path / "plain", "train")
    assert all(not set(dom.values()) & set(train.src(i).tolist()) for i in range(len(train)))


def test_tags_count_towards_max_len(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    prepare(two_domains, tmp_path / "out", _cfg())
    vocab = load_vocab(tmp_path / "out")
    src, tgt = ["katze hund baum 7"], ["cat"]  # the source is the longer side
    n = len(vocab.encode(src[0]))
    tags = vocab.source_prefix("law", "en")
    assert _encode_split(vocab, src, tgt, [], n)[2:] == ([0], 0, 0)
    assert _encode_split(vocab, src, tgt, tags, n + 1)[2:] == ([], 1, 0)
    src_ids, _, kept, _, _ = _encode_split(vocab, src, tgt, tags, n + 2)
    assert kept == [0] and src_ids[0] == [*tags, *vocab.encode(src[0])]


def test_too_long_pairs_are_skipped_and_counted(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    src, tgt = _sentences(40, seed=8)
    src[3] = src[3] + " haus" * 30  # ~33 words: far more than max_len tokens
    tgt[10] = tgt[10] + " house" * 30
    (folder).mkdir()
    (folder / "s.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    (folder / "s.en").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    corpus = plain_corpus(folder / "s.de", folder / "s.en", "d", "de", "en")
    manifest = prepare([corpus], tmp_path / "out", _cfg(max_len=20, dev_per_domain=0,
                                                       test_per_domain=0))
    vocab = load_vocab(tmp_path / "out")
    expected = sum(len(vocab.encode(s)) > 20 or len(vocab.encode(t)) > 20
                   for s, t in zip(src, tgt))
    assert expected >= 2
    assert manifest["splits"]["train"]["skipped_too_long"] == [expected]
    train = ShardedDataset(tmp_path / "out", "train")
    assert len(train) == 40 - expected and train.src_lengths.max() <= 20
    kept = set(_texts(train, vocab, "src"))
    assert src[3] not in kept and src[10] not in kept


# --- atomicity, overwrite, determinism ----------------------------------------------------------

def test_failing_prepare_leaves_nothing(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    bad = two_domains[1].tgt
    bad.write_text(bad.read_text(encoding="utf-8") + "extra line\n", encoding="utf-8")
    parent = tmp_path / "work"
    with pytest.raises(DataError, match="lines but"):
        prepare(two_domains, parent / "prepared", _cfg())
    assert not (parent / "prepared").exists()
    # a failure inside the temporary directory (sentencepiece) also cleans up after itself
    with pytest.raises(DataError) as info:
        prepare(two_domains[:1], parent / "prepared", _cfg(vocab_size=8))
    assert str(info.value).startswith("data.vocab_size: 8 is too small")
    assert not parent.exists() or list(parent.iterdir()) == []






def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_deterministic_bytes(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    prepare(two_domains, tmp_path / "a", _cfg(), seed=5)
    a = _tree(tmp_path / "a")
    prepare(two_domains, tmp_path / "b", _cfg(), seed=5)
    b = _tree(tmp_path / "b")
    assert "spm.model" in a and "train/law.de-en.src.bin" in a and a == b
    prepare(two_domains, tmp_path / "c", _cfg(), seed=6)
    c = _tree(tmp_path / "c")
    assert c["dev/law.de-en.raw.src"] != a["dev/law.de-en.raw.src"]


def test_the_manifest_changes_with_the_content_at_the_same_sizes(tmp_path: Path) -> None:
    """Two training lines swapped: the same sizes, token counts and vocabulary, other shards.
    The manifest (whose digest the recipe stages compare to see stale data) changes by its
    `content_sha256`, the digest of the directory's other files, and by the training split's
    `sha256`, which a resume compares."""
    from moe_train.utils.provenance import digest_tree

    corpus = _corpus(tmp_path / "data", "law", 30, seed=3)
    prepare([corpus], tmp_path / "a", _cfg(dev_per_domain=0, test_per_domain=0), seed=5)
    for side in (corpus.src, corpus.tgt):
        lines = side.read_text(encoding="utf-8").splitlines(keepends=True)
        lines[0], lines[1] = lines[1], lines[0]
        side.write_text("".join(lines), encoding="utf-8")
    prepare([corpus], tmp_path / "b", _cfg(dev_per_domain=0, test_per_domain=0), seed=5)
    a, b = (load_manifest(tmp_path / name) for name in "ab")
    (tmp_path / "a" / "manifest.json").unlink()
    assert a["content_sha256"] == digest_tree(tmp_path / "a")
    assert a["splits"]["train"]["sha256"] == digest_tree(tmp_path / "a" / "train")
    assert a["content_sha256"] != b["content_sha256"]
    assert a["splits"]["train"]["sha256"] != b["splits"]["train"]["sha256"]  # what resume reads
    assert a["splits"]["dev"]["sha256"] == b["splits"]["dev"]["sha256"]
    for m in (a, b):
        del m["content_sha256"]
        for stats in m["splits"].values():
            del stats["sha256"]
    assert a == b  # sizes, token counts, vocabulary: all as before


# --- shards and vocab directly ------------------------------------------------------------------

def test_sharded_dataset_with_an_empty_corpus_in_the_middle(tmp_path: Path) -> None:
    split = tmp_path / "train"
    write_shard(split, "a", [[5, 6], [7]], [[8], [9, 10, 11]])
    write_shard(split, "b", [], [])
    write_shard(split, "c", [[12, 13, 14]], [[15]])
    corpora = [{"name": n, "domain_id": d, "src_lang_id": 0, "tgt_lang_id": t}
               for n, d, t in (("a", 0, 1), ("b", 1, 1), ("c", 1, 2))]
    write_json(tmp_path / "manifest.json", {"version": 1, "corpora": corpora,
                                            "splits": {"train": {"corpus_sizes": [2, 0, 1]}}})
    ds = ShardedDataset(tmp_path, "train")
    assert len(ds) == 3 and list(ds.corpus_offsets) == [0, 2, 2]
    assert [list(ds.src(i)) for i in range(3)] == [[5, 6], [7], [12, 13, 14]]
    assert [list(ds.tgt(i)) for i in range(3)] == [[8], [9, 10, 11], [15]]
    assert list(ds.src_lengths) == [2, 1, 3] and list(ds.tgt_lengths) == [1, 3, 1]
    assert list(ds.corpus_ids) == [0, 0, 2] and list(ds.domain_ids) == [0, 0, 1]
    assert list(ds.tgt_lang_ids) == [1, 1, 2]
    assert np.fromfile(split / "a.src.idx", dtype=np.int64).tolist() == [0, 2, 3]
    assert np.fromfile(split / "a.src.bin", dtype=np.int32).tolist() == [5, 6, 7]
    clone = pickle.loads(pickle.dumps(ds))
    assert list(clone.src(2)) == [12, 13, 14]
    for damage, needle in (({"sizes": None}, r"splits.train.corpus_sizes: expected 3 counts"),
                           ({"sizes": [2, 1]}, r"corpus_sizes: expected 3 counts.*\[2, 1\]"),
                           ({"drop": "domain_id"}, r"corpora\[1\].domain_id: expected an integer"),
                           ({"drop": "name"}, r"corpora\[1\].name: expected a string")):
        broken = [dict(c) for c in corpora]
        broken[1].pop(damage.get("drop", "-"), None)
        train = {} if damage.get("sizes", 0) is None else \
            {"corpus_sizes": damage.get("sizes", [2, 0, 1])}
        write_json(tmp_path / "manifest.json", {"version": 1, "corpora": broken,
                                                "splits": {"train": train}})
        with pytest.raises(DataError, match=needle + r".*\(corrupt\); run `moe-train prepare`"):
            ShardedDataset(tmp_path, "train")
    write_json(tmp_path / "manifest.json", {"version": 1, "corpora": corpora,
                                            "splits": {"train": {"corpus_sizes": [2, 0, 1]}}})
    (split / "c.src.bin").write_bytes(b"\0" * 4)  # truncated
    with pytest.raises(DataError, match="corrupt shard"):
        ShardedDataset(tmp_path, "train")


def test_sharded_dataset_missing(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    with pytest.raises(DataError, match="run `moe-train prepare` first") as info:
        ShardedDataset(tmp_path / "nothing", "train")
    assert str(tmp_path / "nothing") in str(info.value)
    prepare(two_domains, tmp_path / "out", _cfg())
    with pytest.raises(DataError, match="no such split.*run `moe-train prepare` first"):
        ShardedDataset(tmp_path / "out", "valid")
    with pytest.raises(DataError, match="run `moe-train prepare` first"):
        load_vocab(tmp_path / "nothing")


def test_vocab_special_ids_decode_and_pickle(tmp_path: Path) -> None:
    src, tgt = _sentences(30, seed=9)
    model = train_sentencepiece(src + tgt, tmp_path / "sp" / "m", vocab_size=1000,
                                model_type="bpe", user_symbols=["<2de>", "<2en>"], seed=1,
                                max_sentences=1000)
    assert model == tmp_path / "sp" / "m.model" and (tmp_path / "sp" / "m.vocab").is_file()
    assert sorted(p.name for p in (tmp_path / "sp").iterdir()) == ["m.model", "m.vocab"]
    vocab = Vocab(model)
    assert 50 < vocab.size < 1000  # too little text for 1000 pieces: the size shrinks
    assert (vocab.pad_id, vocab.unk_id, vocab.bos_id, vocab.eos_id) == (0, 1, 2, 3)
    ids = vocab.encode("katze hund 7")
    assert vocab.encode_batch(["katze hund 7", "baum"]) == [ids, vocab.encode("baum")]
    assert vocab.decode([2, *ids, 0]) == "katze hund 7"
    assert vocab.decode([*ids, 3, *vocab.encode("baum")]) == "katze hund 7"  # stops at eos
    assert vocab.decode(np.asarray([0, 0, *ids])) == "katze hund 7"
    assert vocab.piece(vocab.lang_tag_id("en")) == "<2en>"
    assert vocab.lang_tag_id("en") in vocab.encode("<2en> katze")  # a user symbol is one piece
    assert pickle.loads(pickle.dumps(vocab)).encode("katze hund 7") == ids
    with pytest.raises(DataError, match="not found"):
        Vocab(tmp_path / "absent.model")


def test_spm_sampling_respects_max_sentences(tmp_path: Path) -> None:
    src, _ = _sentences(200, seed=10)
    unique = [f"zz{i}qq" for i in range(5)]  # rare strings, seen only if sampled
    a = train_sentencepiece(src + unique, tmp_path / "a", 80, "unigram", [], 1, 200)
    b = train_sentencepiece(src + unique, tmp_path / "b", 80, "unigram", [], 1, 200)
    full = train_sentencepiece(src + unique, tmp_path / "c", 80, "unigram", [], 1, 205)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != full.read_bytes()


# --- real data ----------------------------------------------------------------------------------

@pytest.mark.skipif(not (OPUS / "EMEA").is_dir(), reason="OPUS multi-domain data not present")
def test_real_opus_de_en_two_domains(tmp_path: Path) -> None:
    corpora = discover(OPUS, pairs=["de-en"], domains=["EMEA", "TED2020"])
    assert [c.name for c in corpora] == ["EMEA.de-en", "TED2020.de-en"]
    # sentencepiece sees a 4000-sentence sample only: keeps the test fast
    cfg = DataConfig(vocab_size=1000, spm_max_sentences=4000)
    manifest = prepare(corpora, tmp_path / "out", cfg)
    assert manifest["vocab_size"] == 1000
    splits = manifest["splits"]
    for c, entry in enumerate(manifest["corpora"]):
        total = sum(splits[s]["corpus_sizes"][c] + splits[s]["skipped_too_long"][c]
                    + splits[s]["skipped_empty"][c] for s in ("train", "dev", "test"))
        assert total + entry["train_dropped_overlap"] == 5000
    dev, vocab = ShardedDataset(tmp_path / "out", "dev"), load_vocab(tmp_path / "out")
    assert dev.corpus_sizes == [200 - splits["dev"]["skipped_too_long"][c] for c in range(2)]
    assert list(dev.src(0)) == vocab.encode(dev.raw_src(0))


def test_an_empty_split_is_one_line_where_it_must_hold_sentences(tmp_path: Path) -> None:
    """dev/test carved with 0 per domain are listed but empty: training validates nothing on
    them; scoring or classifying them is one DataError, not an IndexError from sacrebleu."""
    folder = tmp_path / "data"
    folder.mkdir()
    src, tgt = _sentences(20, seed=9)
    (folder / "s.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    (folder / "s.en").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    corpus = plain_corpus(folder / "s.de", folder / "s.en", "d", "de", "en")
    manifest = prepare([corpus], tmp_path / "out", _cfg(dev_per_domain=0, test_per_domain=0))
    assert {"dev", "test"} <= set(manifest["splits"])
    assert len(nonempty_split(tmp_path / "out", "train")) == 20
    for split in ("dev", "test"):
        assert len(ShardedDataset(tmp_path / "out", split)) == 0
        with pytest.raises(DataError, match=f"out/{split}: holds no sentences .*"
                                            f"data.{split}_per_domain=0"):
            nonempty_split(tmp_path / "out", split)


def test_held_out_sources_are_not_training_targets_nor_hidden_by_unicode_form(
        tmp_path: Path) -> None:
    """A held-out de source comes back as the de target of the reverse direction in another
    domain, as a source in NFD form in a third, and behind a zero-width space or BOM in a
    fourth: all those pairs leave train."""
    import unicodedata

    root = tmp_path / "data"
    law = _corpus(root, "law", 30, seed=6)  # de -> en
    de, en = _sentences(30, 6)
    med = root / "med"
    med.mkdir()
    (med / "med.en-de.train.en").write_text("".join(f"other {e}\n" for e in en))
    (med / "med.en-de.train.de").write_text("".join(f"{d} ä\n" for d in de))  # law's sources
    it = root / "it"
    it.mkdir()
    nfd = [unicodedata.normalize("NFD", d + " ä") for d in de]  # law's, decomposed
    (it / "it.de-en.train.de").write_text("".join(f"{d}\n" for d in nfd))
    (it / "it.de-en.train.en").write_text("".join(f"{e}\n" for e in en))
    (root / "law" / "law.de-en.train.de").write_text("".join(f"{d} ä\n" for d in de))
    # law's again behind characters sentencepiece drops: a zero-width space, a mid-file BOM
    sub = root / "sub"
    sub.mkdir()
    hidden = [("\u200b" if i % 2 else "\ufeff") + f"{d} ä" for i, d in enumerate(de)]
    (sub / "sub.de-en.train.de").write_text("".join(f"x{i}\n{h}\n" for i, h in enumerate(hidden)))
    (sub / "sub.de-en.train.en").write_text("".join(f"y{i}\nsub {e}\n" for i, e in enumerate(en)))
    corpora = discover(root, pairs=["de-en", "en-de"])
    manifest = prepare(corpora, tmp_path / "out", _cfg(dev_per_domain=3, test_per_domain=3))
    by_name = {c["name"]: c for c in manifest["corpora"]}
    assert law.src.exists()
    assert by_name["med.en-de"]["train_dropped_overlap"] >= 6  # law's held-out, as targets
    assert by_name["it.de-en"]["train_dropped_overlap"] >= 6  # law's held-out, in NFD
    assert by_name["sub.de-en"]["train_dropped_overlap"] >= 6  # law's held-out, invisibly marked
    assert manifest["seed"] == 1  # what carved the held-out sets


def test_the_sentencepiece_model_does_not_depend_on_the_machines_cores(tmp_path, monkeypatch):
    """Its thread count changes what sentencepiece learns: it is fixed, not the core count."""
    import os

    from moe_train.data.vocab import train_sentencepiece

    src, tgt = _sentences(400, 9, lengths=(3, 12))
    models = []
    for cores in (1, 8):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        path = train_sentencepiece([*src, *tgt], tmp_path / f"spm{cores}", 60, "unigram", [],
                                   seed=1, max_sentences=10_000)
        models.append(path.read_bytes())
    assert models[0] == models[1]
