"""Where commands write, and what they read of foreign files, is checked before the work: an
output path that cannot be written, an output directory that holds someone else's files or the
command's own input, a Hugging Face config.json of the wrong types and a DeepSpeed config that
DeepSpeed rejects are each one line naming the place, never a traceback or lost files."""

from __future__ import annotations


import pytest

from moe_train.errors import ConfigError, DataError
from moe_train.models.hf_io import config_from_hf
from moe_train.utils.atomic import (atomic_dir, check_dir_setting, check_out_dir,
                                    check_out_file)

HF = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 32, "moe_intermediate_size": 8,
      "shared_expert_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
      "max_position_embeddings": 32}


def test_out_dir_new_empty_or_own_earlier_output(tmp_path) -> None:
    assert check_out_dir(tmp_path / "new" / "out", "--out", "manifest.json", "export")
    (tmp_path / "empty").mkdir()
    assert check_out_dir(tmp_path / "empty", "--out", "manifest.json", "export")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text("{}")
    assert check_out_dir(tmp_path / "old", "--out", "manifest.json", "export")


def test_out_dir_refuses_foreign_files_a_file_and_its_input(tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep\n")
    with pytest.raises(DataError, match="holds no manifest.json of an earlier export"):
        check_out_dir(mine, "--out", "manifest.json", "export")
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match="exists and is not a directory"):
        check_out_dir(tmp_path / "f", "--out", "manifest.json", "export")
    src = tmp_path / "run" / "ckpt"
    src.mkdir(parents=True)
    (src / "manifest.json").write_text("{}")  # even an earlier export: it is the input
    for out in (src, src.parent, tmp_path / "run" / "ckpt" / ".." / "ckpt"):
        with pytest.raises(DataError, match="is or contains the input"):
            check_out_dir(out, "--out", "manifest.json", "export", sources=[src])
    assert check_out_dir(src / "sub", "--out", "manifest.json", "export", sources=[src])
    with pytest.raises(DataError, match="f is not a directory"):
        check_out_dir(tmp_path / "f" / "out", "--out", "manifest.json", "export")
    assert (mine / "notes.txt").read_text() == "keep\n"


def test_out_file_checks(tmp_path) -> None:
    assert check_out_file(tmp_path / "a" / "b.txt", "--output") == tmp_path / "a" / "b.txt"
    with pytest.raises(DataError, match="--output: expected a file path"):
        check_out_file("", "--output")
    with pytest.raises(DataError, match="is a directory"):
        check_out_file(tmp_path, "--output")
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match=r"--output .*f/o.txt: .*f is not a directory"):
        check_out_file(tmp_path / "f" / "o.txt", "--output")
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_dir_setting_that_is_a_file(tmp_path) -> None:
    check_dir_setting("", "logging.tensorboard_dir")  # off
    check_dir_setting(tmp_path / "ck", "checkpoint.dir")
    (tmp_path / "ck").write_text("x")
    with pytest.raises(DataError, match="checkpoint.dir: .*ck exists and is not a directory"):
        check_dir_setting(tmp_path / "ck", "checkpoint.dir")


def test_atomic_dir_replaces_a_file_without_leftovers(tmp_path) -> None:
    out = tmp_path / "out"
    out.write_text("old file")
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("key, value, needle", [
    ("num_hidden_layers", "two", "num_hidden_layers is 'two'; expected a non-negative integer"),
    ("decoder_sparse_step", "x", "decoder_sparse_step is 'x'"),
    ("mlp_only_layers", 5, "mlp_only_layers is 5; expected a list of layer indices"),
    ("mlp_only_layers", "x", "mlp_only_layers is 'x'"),
    ("rope_parameters", [1], "rope_parameters is [1]; expected an object"),
    ("rope_parameters", {"rope_theta": "x"}, "rope_theta is 'x'; expected a number"),
    ("num_experts_per_tok", 9, "num_experts_per_tok is 9; expected at most num_experts (4)"),
])
def test_hf_config_types_name_the_file_and_key(tmp_path, key, value, needle) -> None:
    source = tmp_path / "config.json"
    assert config_from_hf(HF, source).moe.num_experts == 4
    with pytest.raises(ConfigError) as err:
        config_from_hf({**HF, key: value}, source)
    assert str(err.value).startswith(f"{source}: ") and needle in str(err.value)
    assert "\n" not in str(err.value)


def test_deepspeed_validation_is_one_config_line() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from moe_train.train.ds_config import deepspeed_config_errors

    with pytest.raises(ConfigError) as err, deepspeed_config_errors():
        DeepSpeedZeroConfig(**{"stage": 7})
    text = str(err.value)
    assert text.startswith("deepspeed config (DeepSpeedZeroConfig): stage: ") and "\n" not in text
