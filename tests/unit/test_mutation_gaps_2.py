"""Behaviour a mutation audit found unpinned: the epoch stream, resume checks, prepare's length
limits, CRLF input, --task parts, parameter counts, clustering defaults, the TF-IDF classifier's
columns, MoA stage records and decoding, and atomic writes."""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from moe_train.config import load_config
from moe_train.errors import CheckpointError, ConfigError
from tests.unit.test_batching import BOS, EOS, PAD, FakeDataset
from tests.unit.test_gad_stages import FakeData
from tests.unit.test_params import _small_cfg
from tests.unit.test_prepare import _cfg, _corpus, _sentences


# ------------------------------------------------------------------------------ batching
def test_a_downsampled_corpus_continues_its_stream_in_the_next_epoch() -> None:
    """At temperature 5 a 100-sentence corpus gets 70 draws an epoch: epoch 2 must start with
    the 30 sentences epoch 1 did not reach, not replay epoch 1's 70."""
    from moe_train.data.batching import TrainBatchIterator

    it = TrainBatchIterator(FakeDataset([100, 20]), 400, PAD, BOS, EOS, seed=1, temperature=5.0)
    assert it.counts_C.tolist() == [70, 50]
    drawn: dict[int, list[int]] = {0: [], 1: []}
    while True:
        batches = next(it)
        if it.epoch == 2:
            break
        drawn[it.epoch] += [i for b in batches for i in b.indices_B.tolist() if i < 100]
    first, second = drawn[0], drawn[1]
    assert len(first) == len(second) == 70 and len(set(first)) == 70
    unseen = set(range(100)) - set(first)
    assert len(unseen) == 30
    # the rest of the first permutation, then 40 of the next one (which may repeat some)
    assert unseen <= set(second) and max(Counter(second).values()) <= 2


@pytest.mark.parametrize("field, before, now", [pytest.param(*case, id=case[0]) for case in (
    ("seed", dict(seed=1), dict(seed=2)),
    ("temperature", dict(temperature=1.0), dict(temperature=2.0)),
    ("max_tokens", dict(max_tokens=100), dict(max_tokens=300)),
    ("epoch_size", dict(epoch_size=80), dict(epoch_size=60)),
    ("num_sentences", dict(sizes=[50, 30]), dict(sizes=[50, 40])))])
def test_resume_refuses_every_field_that_fixes_the_data_order(field, before, now) -> None:
    """Resuming with another seed, temperature, max_tokens, epoch size or data set would
    silently train on another data order than the checkpoint's position refers to."""
    from moe_train.data.batching import TrainBatchIterator

    def iterator(sizes=(50, 30), max_tokens=100, seed=1, temperature=1.0, epoch_size=80):
        return TrainBatchIterator(FakeDataset(list(sizes)), max_tokens, PAD, BOS, EOS, seed=seed,
                                  temperature=temperature, epoch_size=epoch_size)

    first = iterator(**before)
    next(first)
    state = first.state_dict()
    resumed = iterator(**now)
    old, new = state[field], resumed.state_dict()[field]
    assert old != new
    with pytest.raises(CheckpointError) as exc:
        resumed.load_state_dict(state)
    assert str(exc.value) == (f"data state: {field} is {old!r} in the checkpoint but {new!r} "
                              "now; the data order cannot be resumed")


# ------------------------------------------------------------------------------ prepare
def test_data_max_len_drops_long_training_pairs_only(tmp_path: Path) -> None:
    """data.max_len filters what is trained on; a long dev pair must stay, or validation
    scores a different (easier) dev set than the one given."""
    from moe_train.data.corpus import plain_corpus
    from moe_train.data.prepare import prepare
    from moe_train.data.shards import ShardedDataset

    d = tmp_path / "data"
    d.mkdir()
    src, tgt = _sentences(40, seed=8)
    src[3] += " haus" * 30  # the one training pair over 30 tokens
    dev_src, dev_tgt = _sentences(5, seed=9)
    dev_src[0] += " haus" * 30
    dev_tgt[0] += " house" * 30
    for name, lines in (("tr.de", src), ("tr.en", tgt), ("dv.de", dev_src), ("dv.en", dev_tgt)):
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpora = [plain_corpus(d / "tr.de", d / "tr.en", "x", "de", "en"),
               plain_corpus(d / "dv.de", d / "dv.en", "x", "de", "en", split="dev")]
    manifest = prepare(corpora, tmp_path / "out", _cfg(max_len=30, dev_per_domain=0,
                                                       test_per_domain=0))
    train, dev = manifest["splits"]["train"], manifest["splits"]["dev"]
    assert (train["sentences"], train["skipped_too_long"]) == (39, [1])
    assert (dev["sentences"], dev["skipped_too_long"]) == (5, [0])
    dev_data = ShardedDataset(tmp_path / "out", "dev")
    assert dev_data.src_lengths.max() > 30 and dev_data.tgt_lengths.max() > 30
    # a model of 31 positions trains on these pairs but cannot validate on the long dev one:
    # the refusal names the dev split and data.eval_max_len, which filters it
    from moe_train.data.prepare import check_fits_model

    with pytest.raises(ConfigError, match=r"\(the dev split of .* has source sentences of "
                                          r"\d+ tokens plus end-of-sentence; prepare limits "
                                          r"each side with data.eval_max_len\)$"):
        check_fits_model(tmp_path / "out", 31)
    manifest = prepare(corpora, tmp_path / "out2", _cfg(max_len=30, eval_max_len=30,
                                                        dev_per_domain=0, test_per_domain=0))
    assert (manifest["splits"]["dev"]["sentences"],
            manifest["splits"]["dev"]["skipped_too_long"]) == (4, [1])
    check_fits_model(tmp_path / "out2", 31)


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_max_positions_must_hold_the_longest_row_exactly(tmp_path: Path, decoder_only) -> None:
    """A model with exactly enough positions (longest sentence + eos; decoder-only: prompt +
    target) must start; one position fewer is refused up front, not at the first long batch."""
    from moe_train.data.prepare import check_fits_model, load_manifest, prepare
    from moe_train.data.shards import ShardedDataset
    from moe_train.utils.atomic import write_json

    out = tmp_path / "out"
    prepare([_corpus(tmp_path / "data", "law", 40, seed=1)], out, _cfg())
    if decoder_only:  # what marks a decoder-only model's data (prompts filled by a template)
        manifest = load_manifest(out)
        manifest["data_config"]["prompt_template"] = "{src}"
        write_json(out / "manifest.json", manifest)
    train, dev = (ShardedDataset(out, s) for s in ("train", "dev"))
    assert train.concatenated == dev.concatenated == decoder_only
    # the longest rows are in train: a 24-token source, 47 tokens of prompt + target
    assert (train.src_lengths.max(), train.tgt_lengths.max()) == (24, 23)
    assert (train.src_lengths + train.tgt_lengths).max() == 47
    assert max(dev.src_lengths.max(), dev.tgt_lengths.max()) < 24
    need, what = ((47, "prompt + target sentences of 47 tokens") if decoder_only else
                  (25, "source sentences of 24 tokens plus end-of-sentence"))
    check_fits_model(out, need)
    with pytest.raises(ConfigError) as exc:
        check_fits_model(out, need - 1)
    assert str(exc.value) == (f"model.max_positions: expected at least {need}, got {need - 1} "
                              f"(the train split of {out} has {what}; prepare limits each "
                              "side with data.max_len)")


# ------------------------------------------------------------------------------ corpus
def test_crlf_text_input_lines_have_no_carriage_return(tmp_path: Path) -> None:
    """A Windows-edited file to translate or score: a '\\r' left on each line would be
    translated as part of the sentence and written back into the output."""
    from moe_train.data.corpus import read_text_input

    path = tmp_path / "in.txt"
    path.write_bytes(b"the cat sat\r\n\r\non the mat\r\n")
    assert read_text_input(path) == (str(path), ["the cat sat", "", "on the mat"])


# ------------------------------------------------------------------------------ extract
def test_task_with_two_parts_for_one_side_is_refused() -> None:
    """--task law,de,fr for a domain encoder and a target-language decoder names two decoder
    tasks: refused, rather than extracting for one of them picked at random."""
    from moe_train.eval.extract import side_tasks

    manifest = {"langs": ["de", "en", "fr"], "domains": ["it", "law"], "corpora": [
        {"src_lang": "en", "tgt_lang": "de", "domain": "law"},
        {"src_lang": "en", "tgt_lang": "fr", "domain": "law"}]}
    sources = {"encoder": "domain", "decoder": "tgt_lang"}
    assert side_tasks("law,fr", sources, manifest) == {"encoder": 1, "decoder": 2}
    with pytest.raises(ConfigError) as exc:
        side_tasks("law,de,fr", sources, manifest)
    assert str(exc.value) == ("--task law,de,fr: expected exactly one part for the tgt_lang "
                              "routing (de, fr), found 2")


# ------------------------------------------------------------------------------ params
def test_a_router_shared_across_layers_is_counted_once() -> None:
    """Sentence routers are one module for all of a side's MoE layers: counting it per layer
    reports twice the router parameters the model has."""
    from moe_train.eval.params import count_parameters

    cfg = _small_cfg(["moe.num_experts=4", "moe.k=1", "moe.layers=all",
                      "moe.encoder_router=sentence", "moe.decoder_router=sentence"])
    report = count_parameters(cfg, 10)
    assert (report["encoder_moe_layers"], report["decoder_moe_layers"]) == (2, 2)
    # one d_model x num_experts gate per side: 8 * 4
    assert (report["encoder_routers"], report["decoder_routers"]) == (32, 32)


def test_human_units_switch_exactly_at_their_scale() -> None:
    """A count of exactly one million (or billion) is printed as 1.0M (1.00B), not
    1000.0K (1000.0M)."""
    from moe_train.eval.params import human

    assert [human(n) for n in (999, 1000, 999_949, 10**6, -10**6, 10**9)] == \
        ["999", "1.0K", "999.9K", "1.0M", "-1.0M", "1.00B"]
    # a rounding that reaches 1000 takes the next unit
    assert [human(n) for n in (999_999, -999_999, 999_999_999, 14_320_000_000)] == \
        ["1.0M", "-1.0M", "1.00B", "14.32B"]


# ------------------------------------------------------------------------------ clustering
def _features(n: int = 30) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, 6))


def test_kmeans_runs_at_least_ten_initialisations() -> None:
    """moa.cluster_inits below 10 must not lower k-means' restarts (the papers' sklearn
    default): fewer restarts land in worse local optima and cost purity."""
    from moe_train.stages.cluster_core import fit_clusterer

    assert fit_clusterer(_features(), 3, "kmeans", pca_dim=4, inits=2).model.n_init == 10
    assert fit_clusterer(_features(), 3, "kmeans", pca_dim=4, inits=12).model.n_init == 12


def test_as_many_clusters_as_sentences_is_allowed() -> None:
    """K equal to the N sampled sentences is a valid (if degenerate) clustering: refusing it
    stops a small run for nothing."""
    from moe_train.stages.cluster_core import fit_clusterer

    fitted = fit_clusterer(_features(4), 4, "kmeans", pca_dim=4)
    assert fitted.predict(_features(4)).tolist() == [0, 1, 2, 3]
    assert fitted.fit_sizes_K.tolist() == [1, 1, 1, 1]


def test_clustering_standardizes_features_by_default() -> None:
    """Without standardizing, the few features of largest scale decide the PCA and so the
    clusters; the default divides each feature by its standard deviation."""
    from moe_train.stages.cluster_core import fit_clusterer

    x = _features() * np.arange(1, 7)
    fitted = fit_clusterer(x, 3, "kmeans", pca_dim=4)
    np.testing.assert_array_equal(fitted.scale_D, x.std(axis=0))
    assert fitted.scale_D.tolist() != [1.0] * 6


# ------------------------------------------------------------------------------ classifier
def test_tfidf_probabilities_land_in_their_domains_columns() -> None:
    """Domain 1 has no training sentences: its column stays 0 and domain 2's probabilities
    stay in column 2 (shifted left, domain-2 sentences were sent to domain 1's expert)."""
    from moe_train.stages.classifier_core import TfidfClassifier

    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 4], [7, 8, 9], [7, 8, 6], [7, 8, 9, 6]]
    docs = [" ".join(map(str, r)) for r in rows]
    data = FakeData(rows, [0, 0, 0, 2, 2, 2], [""] * 6)
    clf = TfidfClassifier.fit(docs, data.domain_ids, num_domains=3, ngrams=1)
    probs = clf.predict_proba(data, np.arange(6))
    raw = clf.pipeline.predict_proba(docs).astype(np.float32)
    np.testing.assert_array_equal(probs[:, [0, 2]], raw)
    assert (probs[:, 1] == 0).all()
    assert probs.argmax(1).tolist() == [0, 0, 0, 2, 2, 2]


# ------------------------------------------------------------------------------ MoA stages
def test_features_stage_depends_on_moa_seed() -> None:
    """The features stage samples sentences with moa.seed: another seed must make its record
    stale, or the old features are reused for a run that asked for another sample."""
    from moe_train.stages.record import config_fields

    one = config_fields("features", load_config(None, ["moa.seed=1"]))
    two = config_fields("features", load_config(None, ["moa.seed=2"]))
    assert {k for k in one if k.startswith("moa.")} == {
        "moa.sample_size", "moa.anchors_per_domain", "moa.anchor_domains", "moa.seed"}
    assert (one["moa.seed"], two["moa.seed"]) == (1, 2)


def test_quality_tables_decode_with_moa_eval_beam() -> None:
    """The MoA quality tables use moa.eval_beam, not eval.beam (the training-time
    validation beam): a run set to beam 5 there must not be scored greedily."""
    from moe_train.stages.common import quality_decoding

    cfg = load_config(None, ["eval.beam=1", "moa.eval_beam=5", "eval.lenpen=0.7"])
    decoding = quality_decoding(cfg)
    assert (decoding.beam, decoding.lenpen) == (5, 0.7)


# ------------------------------------------------------------------------------ atomic writes
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["022", "027"])
def test_atomically_written_files_get_the_usual_permissions(tmp_path, umask, mode) -> None:
    """Files written through a temporary file must not keep mkstemp's 0600: other users (or a
    job's other account) could not read the outputs."""
    from moe_train.utils.atomic import write_json

    old = os.umask(umask)
    try:
        write_json(tmp_path / "out.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == mode


def test_atomic_dir_does_not_replace_an_existing_directory_without_overwrite(tmp_path) -> None:
    """Without overwrite an existing output directory is an error and stays as it was; the
    new content is thrown away, with nothing left beside it."""
    from moe_train.utils.atomic import atomic_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError) as exc:
        with atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("new")
    assert str(exc.value) == f"{out}: already exists"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
