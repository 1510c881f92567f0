"""prepare's refusals before any work: its output directory (never another command's, a mount
point, the working directory or the corpus) and the prompt template data and model share."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_train.data.corpus import CorpusFiles
from moe_train.data.prepare import load_manifest, prepare
from moe_train.errors import DataError
from tests.unit.test_prepare import _cfg, _corpus


@pytest.fixture()
def two_domains(tmp_path: Path) -> list[CorpusFiles]:
    return [_corpus(tmp_path / "data", "law", 60, seed=1),
            _corpus(tmp_path / "data", "med", 45, seed=2)]


def test_existing_output(tmp_path: Path, two_domains: list[CorpusFiles]) -> None:
    out = tmp_path / "out"
    first = prepare(two_domains[:1], out, _cfg())
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare(two_domains, out, _cfg())
    assert load_manifest(out) == first
    second = prepare(two_domains, out, _cfg(), overwrite=True)
    assert load_manifest(out) == second and len(second["corpora"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="refusing to replace it"):
        prepare(two_domains, foreign, _cfg(), overwrite=True)
    assert (foreign / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare(two_domains, empty, _cfg())
    assert (empty / "manifest.json").is_file()


def test_outputs_refused_before_any_work(tmp_path: Path, two_domains: list[CorpusFiles],
                                         monkeypatch) -> None:
    """prepare and synth check --out as every other command does, before reading a line: a
    mount point (EBUSY at the final rename, after the work), the working directory (replaced
    under the shell's feet: `--out .` printed `wrote .` and left the shell in a deleted
    directory), the corpus itself."""
    from moe_train.data import prepare as prepare_mod
    from moe_train.data.synthetic_dir import write_synthetic
    from moe_train.errors import MoeTrainError
    from moe_train.utils import atomic

    def no_reading(*args, **kwargs):
        raise AssertionError("read the corpus before checking --out")

    volume = tmp_path / "vol"
    volume.mkdir()
    monkeypatch.setattr(atomic, "mount_points", lambda: {str(volume.resolve())})
    monkeypatch.setattr(prepare_mod, "read_pairs", no_reading)
    with pytest.raises(DataError, match=r"--out .*vol: is a mount point"):
        prepare(two_domains, volume, _cfg())
    with pytest.raises(MoeTrainError, match=r"synth --out .*vol: is a mount point"):
        write_synthetic(volume)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(DataError, match="is the working directory"):
        prepare(two_domains, Path("."), _cfg())
    with pytest.raises(MoeTrainError, match="is the working directory"):
        write_synthetic(".")
    with pytest.raises(DataError, match="is or contains the input"):
        prepare(two_domains, tmp_path / "data", _cfg(), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "here", "vol"]


def test_the_prompt_template_must_be_the_data_s(tmp_path: Path,
                                                two_domains: list[CorpusFiles]) -> None:
    """A decoder-only model (whose config always has a template) on data prepared without one
    was batched and checked as two sequences, and translate filled a prompt it never saw; an
    encoder-decoder on prompted data is budgeted as one sequence. Both refused by name."""
    import json

    from moe_train.data.prepare import check_prompt_template
    from moe_train.data.prompts import DEFAULT_PROMPT
    from moe_train.errors import ConfigError

    out = tmp_path / "p"
    prepare(two_domains, out, _cfg())
    check_prompt_template(out, "")  # encoder-decoder data for an encoder-decoder
    with pytest.raises(ConfigError, match=r"data.prompt_template: .* was prepared with 'none'; "
                                          r"expected the same template, got 'Translate"):
        check_prompt_template(out, DEFAULT_PROMPT)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["data_config"]["prompt_template"] = DEFAULT_PROMPT
    (out / "manifest.json").write_text(json.dumps(manifest))
    check_prompt_template(out, DEFAULT_PROMPT)
    with pytest.raises(ConfigError, match="got 'none'"):
        check_prompt_template(out, "")
    del manifest["data_config"]["prompt_template"]  # written before the field: not checked
    (out / "manifest.json").write_text(json.dumps(manifest))
    check_prompt_template(out, DEFAULT_PROMPT)


def test_evaluate_scores_prepared_data_only_with_the_model_s_prompts(tiny_prepared, monkeypatch):
    """evaluate --prepared on a decoder-only model: data whose prompts were filled with another
    template (or none) is refused as training refuses it, not scored (BLEU 0.20 on prompts
    the model never saw)."""
    from types import SimpleNamespace

    import moe_train.data.prepare as prepare_mod
    from moe_train.commands import _prepared_split
    from moe_train.data.prompts import DEFAULT_PROMPT
    from moe_train.errors import ConfigError

    monkeypatch.setattr(prepare_mod, "check_model_data", lambda src, m, prepared, dm: m)
    qwen = SimpleNamespace(decoder_only=True, data=SimpleNamespace(
        prompt_template=DEFAULT_PROMPT, prepared_dir=str(tiny_prepared)),
        moe=SimpleNamespace(extracted_task=""))
    inf = SimpleNamespace(cfg=qwen, source="model", manifest={})
    with pytest.raises(ConfigError, match="was prepared with 'none'; expected the same"):
        _prepared_split(inf, str(tiny_prepared), "test")
    seq2seq = SimpleNamespace(decoder_only=False, data=qwen.data,
                              moe=SimpleNamespace(extracted_task=""))
    assert _prepared_split(SimpleNamespace(cfg=seq2seq, source="model", manifest={}),
                           str(tiny_prepared), "test") is not None
