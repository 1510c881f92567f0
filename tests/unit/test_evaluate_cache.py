"""The evaluate stage's backbone-score cache: keyed on the export's content, the test data and
the decode settings; reused entries say "cached": true, and any key change decodes again."""

from __future__ import annotations

import json

import pytest

from moe_train.config.schema import EvalConfig
from moe_train.stages.evaluate import CACHE_FORMAT, backbone_cache_key, cached_scores


@pytest.fixture
def fake_run(tmp_path):
    """A fake export (weights, config, tokenizer) and a fake prepared test split."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"\x01" * 3000)
    (export / "config.json").write_text("{}")
    (export / "spm.model").write_bytes(b"sp")
    prepared = tmp_path / "prepared"
    (prepared / "test").mkdir(parents=True)
    (prepared / "manifest.json").write_text(json.dumps({"domains": ["a", "b"]}))
    (prepared / "test" / "a.src.bin").write_bytes(b"\x00" * 64)
    (prepared / "test" / "a.raw.tgt").write_text("ref\n")
    (prepared / "dev").mkdir()
    (prepared / "dev" / "a.src.bin").write_bytes(b"\x00")
    return tmp_path, export, prepared


class Decoder:
    """Stands in for decoding the backbone: counts calls, returns fixed scores."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return {"all": {"bleu": 12.5, "chrf": 40.0, "sentences": 2}, "parameters": 7}


def _key(export, prepared, **decode):
    return backbone_cache_key(export, prepared, "test", EvalConfig(**decode), 100, 3000)


def test_second_call_is_cached_and_equal(fake_run):
    tmp, export, prepared = fake_run
    decode, key = Decoder(), _key(export, prepared, beam=4)
    first = cached_scores(tmp / "cache", key, decode)
    second = cached_scores(tmp / "cache", key, decode)
    assert decode.calls == 1
    assert first["cached"] is False and second["cached"] is True
    assert {k: v for k, v in first.items() if k != "cached"} == \
        {k: v for k, v in second.items() if k not in ("cached", "measured_by")}
    assert len(key["checkpoint_sha256"]) == 64 and len(key["test_data_sha256"]) == 64


@pytest.mark.parametrize("change", ["weights", "config", "test_split", "manifest", "beam",
                                    "lenpen", "max_len_b"])
def test_any_key_change_decodes_again(fake_run, change):
    tmp, export, prepared = fake_run
    decode = Decoder()
    cached_scores(tmp / "cache", _key(export, prepared, beam=4), decode)
    settings = {"beam": 4}
    if change == "weights":
        (export / "model.safetensors").write_bytes(b"\x01" * 2999 + b"\x02")  # same size
    elif change == "config":
        (export / "config.json").write_text('{"d_model": 8}')
    elif change == "test_split":
        (prepared / "test" / "a.raw.tgt").write_text("other ref\n")
    elif change == "manifest":
        (prepared / "manifest.json").write_text(json.dumps({"domains": ["b", "a"]}))
    else:
        settings[change] = {"beam": 5, "lenpen": 0.6, "max_len_b": 20}[change]
    again = cached_scores(tmp / "cache", _key(export, prepared, **settings), decode)
    assert decode.calls == 2 and again["cached"] is False


def test_a_reused_entry_names_the_run_that_measured_it(fake_run):
    tmp, export, prepared = fake_run
    decode, key = Decoder(), _key(export, prepared, beam=4)
    first = cached_scores(tmp / "cache", key, decode, measured_by={"command": ["first"]})
    assert "measured_by" not in first  # measured by this process: its own provenance
    again = cached_scores(tmp / "cache", key, decode, measured_by={"command": ["second"]})
    assert again["cached"] is True and again["measured_by"] == {"command": ["first"]}


@pytest.mark.parametrize("change", [{"rnd_seed": 2}, {"device": "cuda"},
                                    {"code": {"commit": "b" * 40, "dirty": False}}])
def test_the_rnd_seed_device_and_code_are_in_the_key(fake_run, change):
    tmp, export, prepared = fake_run
    decode = Decoder()
    base = {"rnd_seed": 1, "device": "cpu", "code": {"commit": "a" * 40, "dirty": False}}

    def key(**kw):
        return backbone_cache_key(export, prepared, "test", EvalConfig(beam=4), 100, 3000,
                                  **{**base, **kw})

    cached_scores(tmp / "cache", key(), decode)
    assert cached_scores(tmp / "cache", key(), decode)["cached"] is True
    assert cached_scores(tmp / "cache", key(**change), decode)["cached"] is False


def test_other_splits_do_not_touch_the_key(fake_run):
    tmp, export, prepared = fake_run
    key = _key(export, prepared, beam=4)
    (prepared / "dev" / "a.src.bin").write_bytes(b"\x05")
    assert _key(export, prepared, beam=4) == key


def test_unreadable_or_foreign_entry_is_recomputed(fake_run):
    tmp, export, prepared = fake_run
    decode, key = Decoder(), _key(export, prepared, beam=4)
    cached_scores(tmp / "cache", key, decode)
    [entry] = (tmp / "cache").iterdir()
    entry.write_text("{torn")
    assert cached_scores(tmp / "cache", key, decode)["cached"] is False
    stored = json.loads(entry.read_text())
    stored["key"]["decode"]["beam"] = 9  # an entry whose stored key does not match
    entry.write_text(json.dumps(stored))
    assert cached_scores(tmp / "cache", key, decode)["cached"] is False
    entry.write_bytes(b"\xff\xfe not UTF-8")
    assert cached_scores(tmp / "cache", key, decode)["cached"] is False
    entry.write_text(json.dumps({"key": key}))  # the right key, no scores
    assert cached_scores(tmp / "cache", key, decode)["cached"] is False
    assert decode.calls == 5


def test_entry_of_an_older_format_is_recomputed(fake_run):
    """Entries written before hypotheses were cached (no "format" in their key) miss."""
    tmp, export, prepared = fake_run
    decode, key = Decoder(), _key(export, prepared, beam=4)
    assert key["format"] == CACHE_FORMAT
    cached_scores(tmp / "cache", {k: v for k, v in key.items() if k != "format"}, decode)
    assert cached_scores(tmp / "cache", key, decode)["cached"] is False
    assert decode.calls == 2


def test_non_main_rank_does_not_write(fake_run):
    tmp, export, prepared = fake_run
    cached_scores(tmp / "cache", _key(export, prepared), Decoder(), write=False)
    assert not (tmp / "cache").exists() or not any((tmp / "cache").iterdir())
