"""Relabeled: other domain ids for a prepared split, and with domain tags the matching tags."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from moe_train.config.schema import DataConfig
from moe_train.data.corpus import discover
from moe_train.data.prepare import load_vocab, prepare
from moe_train.data.shards import ShardedDataset
from moe_train.data.views import Relabeled
from moe_train.errors import DataError


@pytest.fixture(scope="module")
def prepared(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """`tiny_corpus` (5 domains) prepared without and with domain tags."""
    out = tmp_path_factory.mktemp("views")
    for tags in (False, True):
        prepare(discover(tiny_corpus), out / str(tags),
                DataConfig(vocab_size=300, pairs=["en-de"], domain_tags=tags), seed=1)
    return {tags: out / str(tags) for tags in (False, True)}


def _shifted(ds: ShardedDataset) -> np.ndarray:
    """Every sentence labelled with the next domain (of 5)."""
    return (ds.domain_ids + 1) % 5


def test_untagged_view_changes_domain_ids_only(prepared: dict[bool, Path]) -> None:
    test = ShardedDataset(prepared[False], "test")
    view = Relabeled(test, _shifted(test))
    assert len(view) == len(test) == 40
    assert list(view.domain_ids) == list(_shifted(test)) and view.domain_ids.dtype == np.int64
    assert all(list(view.src(i)) == list(test.src(i)) for i in range(len(view)))
    assert view.src_lengths is test.src_lengths and view.raw_tgt(3) == test.raw_tgt(3)
    assert list(test.domain_ids) == sorted(test.domain_ids)  # the dataset itself is untouched


def test_tagged_view_swaps_the_domain_tag(prepared: dict[bool, Path]) -> None:
    test, vocab = ShardedDataset(prepared[True], "test"), load_vocab(prepared[True])
    domains = test.manifest["domains"]
    view = Relabeled(test, _shifted(test))
    for i in range(len(view)):
        src, new = view.src(i), domains[int(_shifted(test)[i])]
        assert test.src(i)[0] == vocab.domain_tag_id(domains[int(test.domain_ids[i])])
        assert src[0] == vocab.domain_tag_id(new) != test.src(i)[0]
        assert list(src[1:]) == list(test.src(i)[1:]) and src.dtype == np.int64
        assert len(src) == view.src_lengths[i]
    assert list(view.src_lengths) == list(test.src_lengths)
    assert list(view.tgt_lengths) == list(test.tgt_lengths)
    same = Relabeled(test, test.domain_ids)
    assert all(list(same.src(i)) == list(test.src(i)) for i in range(len(same)))
    clone = pickle.loads(pickle.dumps(view))
    assert list(clone.src(7)) == list(view.src(7))


def test_missing_tag_and_bad_ids_are_refused(prepared: dict[bool, Path]) -> None:
    test = ShardedDataset(prepared[False], "test")
    test.manifest = {**test.manifest, "domain_tags": True}  # claims tags the data lacks
    with pytest.raises(DataError, match=r"test: sentence 0 does not start with a domain tag"):
        Relabeled(test, test.domain_ids).src(0)
    with pytest.raises(ValueError, match=r"expected shape \(40,\)"):
        Relabeled(test, test.domain_ids[:3])
    with pytest.raises(ValueError, match=r"ids in 0\.\.4"):
        Relabeled(test, test.domain_ids + 1)
