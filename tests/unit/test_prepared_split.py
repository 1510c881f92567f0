"""`evaluate` / `routing-stats` read a prepared split with the model's domain and language
names: data prepared with other lists (a domain subset, another language set) would be
scored under the wrong names, so it is refused in one line."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from moe_train.commands import _prepared_split
from moe_train.config import load_config
from moe_train.errors import DataError


def _model(prepared, tmp_path, **manifest_changes):
    """An inference bundle of a model trained on `prepared`, its manifest changed."""
    manifest = {**json.loads((prepared / "manifest.json").read_text()), **manifest_changes}
    source = tmp_path / "export"
    source.mkdir()
    shutil.copy(prepared / "spm.model", source / "spm.model")
    return SimpleNamespace(source=source, manifest=manifest,
                           cfg=load_config(None, [f"data.prepared_dir={prepared}"]))


def test_the_model_s_own_data_is_read(tiny_prepared, tmp_path) -> None:
    assert len(_prepared_split(_model(tiny_prepared, tmp_path), None, "test")) > 0


@pytest.mark.parametrize("key", ["domains", "langs"])
def test_data_with_other_names_is_refused(tiny_prepared, tmp_path, key) -> None:
    theirs = json.loads((tiny_prepared / "manifest.json").read_text())[key]
    inf = _model(tiny_prepared, tmp_path, **{key: list(reversed(theirs))})
    with pytest.raises(DataError, match=f"its {key} .* are not the model's"):
        _prepared_split(inf, str(tiny_prepared), "test")


def test_a_converted_model_takes_the_data_s_names(tiny_prepared, tmp_path) -> None:
    """A model converted from Hugging Face saw no corpus (empty lists): the data's own names
    label its groups instead of a refusal."""
    data = json.loads((tiny_prepared / "manifest.json").read_text())
    inf = _model(tiny_prepared, tmp_path, domains=[], langs=[])
    assert len(_prepared_split(inf, None, "test")) > 0
    assert (inf.manifest["domains"], inf.manifest["langs"]) == (data["domains"], data["langs"])


def test_data_of_another_tokenizer_is_refused(tiny_prepared, tmp_path) -> None:
    """Another sentencepiece model, or another kind of tokenizer: the ids would mean other
    pieces (an index error, or a silent score of garbage)."""
    inf = _model(tiny_prepared, tmp_path)
    (inf.source / "spm.model").write_bytes(b"another model")
    with pytest.raises(DataError, match=r"its spm.model is not the model's"):
        _prepared_split(inf, None, "test")
    (tmp_path / "hf").mkdir()
    hf = _model(tiny_prepared, tmp_path / "hf", tokenizer="hf")
    with pytest.raises(DataError, match=r"tokenized with sentencepiece, the model .* with a "
                                         r"Hugging Face tokenizer"):
        _prepared_split(hf, None, "test")


def test_a_converted_model_without_tokenizer_files_is_not_compared(tmp_path) -> None:
    from moe_train.data.prepare import check_model_data

    (tmp_path / "model").mkdir()
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "tokenizer.json").write_text("{}")
    got = check_model_data(tmp_path / "model", {"tokenizer": "hf", "domains": [], "langs": []},
                           tmp_path / "prep", {"tokenizer": "hf", "domains": ["law"],
                                               "langs": ["de", "en"]})
    assert got["domains"] == ["law"] and got["langs"] == ["de", "en"]


@pytest.mark.parametrize("marker", ["config.json", "meta.json"])
def test_an_export_or_step_given_as_prepared_data_says_so(tiny_prepared, tmp_path, marker):
    """`evaluate --prepared <export>`: an export holds the data's manifest but no splits; it
    said "missing ... run `moe-train prepare` again", as if the data were damaged."""
    inf = _model(tiny_prepared, tmp_path)
    given = tmp_path / "given"
    given.mkdir()
    shutil.copy(tiny_prepared / "manifest.json", given / "manifest.json")
    (given / marker).write_text("{}")
    with pytest.raises(DataError, match=f"^{given}: a model's export or checkpoint step, not "
                                        "prepared data"):
        _prepared_split(inf, str(given), "test")
