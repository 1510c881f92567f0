"""Config loading and validation: errors name the field (and file/line) and what is allowed."""

import os
import re
import threading
from pathlib import Path

import pytest

from moe_train.config import config_from_dict, load_config, parse_overrides
from moe_train.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_overrides_are_typed():
    cfg = load_config(overrides=["optim.lr=1e-3", "model.d_model=256", "data.pairs=[de-en]",
                                 "train.progress_bar=false", "optim.betas=[0.9, 0.99]"])
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.d_model == 256
    assert cfg.data.pairs == ["de-en"]
    assert cfg.train.progress_bar is False
    assert cfg.optim.betas == (0.9, 0.99)


def test_parse_overrides_nested():
    assert parse_overrides(["a.b.c=3", "a.d=x"]) == {"a": {"b": {"c": 3}, "d": "x"}}


@pytest.mark.parametrize("override, message", [
    ("model.n_heads=3", "model.d_model: expected a multiple of model.n_heads (3)"),
    ("optim.precision=fp8", "optim.precision: expected one of auto, fp32, bf16, fp16"),
    ("optim.zero_stage=4", "optim.zero_stage: expected one of 0, 1, 2, 3"),
    ("model.dropout=1.5", "model.dropout: expected a probability in [0, 1)"),
    ("moe.capacity_factor=.inf", "moe.capacity_factor: expected a finite number, got inf"),
    ("optim.lr=.nan", "optim.lr: expected a finite number, got nan"),
    ("moe.layers=0,²", "moe.layers: expected every_other, all, or a comma list"),
    ("moe.layers=true", "moe.layers: expected every_other, all, or layer indices"),
    ("moe.layers=[1,-1]", "moe.layers: expected every_other, all, or layer indices"),
    ("train.max_steps=abc", "train.max_steps: expected an integer"),
    ("train.max_steps=0", "train.max_steps: expected a positive number"),
    ("data.pairs=[deen]", "data.pairs[0]: expected src-tgt"),
    ("modl.d_model=3", "modl: unknown field (allowed: adapters, checkpoint, data, deepspeed"),
    ("model.dmodel=3", "model.dmodel: unknown field"),
    ("model.activation=swish", "model.activation: expected one of relu, gelu"),
    ("optim.betas=[0.9]", "optim.betas: expected 2 values"),
    ("data.max_tokens=10", "data.max_tokens: expected at least data.max_len"),
    ("nonsense", "expected key.sub=value"),
    ("moa.whiten=7", "moa.whiten: expected true or false"),
    ("checkpoint.dir=", "checkpoint.dir: expected a directory"),
    ("train.bleu_every=15", "train.bleu_every: expected 0 or a multiple of train.validate_every"),
    ("eval.lenpen=400", "eval.lenpen: expected a number from 0 to 10.0"),
    ("eval.beam=1025", "eval.beam: expected at most 1024"),
    ("train.seed=-1", "train.seed: expected an integer in 0..4294967295"),
    ("train.seed=4294967296", "train.seed: expected an integer in 0..4294967295"),
    ("moa.seed=-3", "moa.seed: expected an integer in 0..4294967295"),
    ("moe.encoder_num_experts=8", "moe.encoder_num_experts: expected 0 unless moe.num_experts"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    text = str(err.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("value, stored", [("3", "3"), ("[1, 3]", "1,3"), ("1,3", "1,3"),
                                           ("all", "all")])
def test_moe_layers_takes_an_index_a_list_or_a_comma_list(value, stored) -> None:
    """YAML reads ``layers: 3`` as an integer and ``[1, 3]`` as a list: both mean indices."""
    cfg = load_config(overrides=[f"moe.layers={value}"])
    assert cfg.moe.layers == stored
    assert config_from_dict(cfg.to_dict()) == cfg


def test_yaml_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 64\n   n_heads: [\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value).startswith(f"{bad}:")
    assert "\n" not in str(err.value)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  d_model: 63\n")
    with pytest.raises(ConfigError, match=r"wrong.yaml: model.d_model: expected a multiple"):
        load_config(wrong)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r": a directory; expected a YAML config file$"):
        load_config(tmp_path)


def test_a_config_may_come_through_a_pipe(tmp_path):
    """`--config <(...)` is a FIFO and /dev/null a device: read like files, not "not found"."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("model:\n  d_model: 96\n"),
                              daemon=True)  # blocks until read: must not hold up exit
    writer.start()
    assert load_config(fifo).model.d_model == 96
    writer.join()
    assert load_config(os.devnull) == load_config(None)


@pytest.mark.parametrize("entry, field_", [
    ("deepspeed.zero_optimization.stage=2", "optim.zero_stage"),
    ("deepspeed.bf16.enabled=true", "optim.precision"),
    ("deepspeed.bfloat16.enabled=true", "optim.precision"),
    # DeepSpeed reads bfloat16 only without bf16, which moe_train always writes: dropped
    ("deepspeed.bfloat16.immediate_grad_update=true", "other bf16 options go under bf16"),
    ("deepspeed.fp16.enabled=true", "optim.precision"),
    ("deepspeed.optimizer.type=AdamW", "moe_train builds the optimizer"),
    ("deepspeed.scheduler.type=WarmupLR", "optim.warmup_steps"),
    ("deepspeed.torch_autocast.enabled=true", "optim.precision"),
    ("deepspeed.activation_checkpointing.partition_activations=true",
     "model.activation_checkpointing"),
])
def test_deepspeed_entries_moe_train_acts_on_are_refused(entry, field_) -> None:
    """A raw ZeRO stage, precision, optimizer or scheduler would run something else than the
    config and the log say (ZeRO-0 clipping and the non-finite guard follow optim.zero_stage)."""
    key = entry.split("=")[0].removesuffix(".type").removesuffix(".enabled") \
        .removesuffix(".partition_activations").removesuffix(".immediate_grad_update")
    if key in ("deepspeed.bf16", "deepspeed.fp16"):
        key += ".enabled"
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: set by moe_train from .*"
                                          rf"{re.escape(field_)}"):
        load_config(None, [entry])
    # what moe_train leaves to DeepSpeed passes through
    cfg = load_config(None, ["deepspeed.zero_optimization.overlap_comm=true",
                             "deepspeed.fp16.initial_scale_power=12"])
    assert cfg.deepspeed["zero_optimization"] == {"overlap_comm": True}


@pytest.mark.parametrize("entry, message", [
    ("deepspeed.zero_optimization=true", "deepspeed.zero_optimization: expected a mapping"),
    ("deepspeed.zero_optimization=2", "deepspeed.zero_optimization: expected a mapping"),
    ("deepspeed.bf16=true", "deepspeed.bf16: expected a mapping"),
    ("deepspeed.zero_optimization.round_robin_gradients=true",
     "deepspeed.zero_optimization.round_robin_gradients: True is not supported: moe_train "
     "reads ZeRO partitions in parameter order"),
    ("deepspeed.checkpoint.load_universal=true",
     "deepspeed.checkpoint.load_universal: True is not supported"),
    ("deepspeed.zero_optimization.elastic_checkpoint=true",
     "deepspeed.zero_optimization.elastic_checkpoint: True is not"),
    ("deepspeed.zero_optimization.load_from_fp32_weights=false",
     "deepspeed.zero_optimization.load_from_fp32_weights: False"),
    ("deepspeed.wall_clock_breakdown=true", "deepspeed.wall_clock_breakdown: True is not"),
    ("deepspeed.flops_profiler.enabled=true", "deepspeed.flops_profiler.enabled: True is not"),
    ("deepspeed.autotuning.enabled=true", "deepspeed.autotuning.enabled: True is not supported: "
     "DeepSpeed's autotuning turns on its flops profiler"),
    # DeepSpeed reads a string such as "true" as true
    ('deepspeed.zero_optimization.round_robin_gradients="true"',
     "deepspeed.zero_optimization.round_robin_gradients: expected true or false, got 'true'"),
    ('deepspeed.checkpoint.load_universal="no"',
     "deepspeed.checkpoint.load_universal: expected true or false, got 'no'"),
])
def test_deepspeed_entries_moe_train_cannot_run_are_one_line(entry, message) -> None:
    """Scalars where DeepSpeed reads a section (its old `zero_optimization: true` form ran
    ZeRO 1 while the trainer took its ZeRO-0 path and saw no gradients), and options that
    scramble moe_train's checkpoints or crash at the first backward."""
    with pytest.raises(ConfigError, match=re.escape(f"override {entry}: {message}")):
        load_config(None, [entry])
    off = entry.replace("=true", "=false") if "=true" in entry else None
    if off and "expected a mapping" not in message:  # the harmless value passes
        load_config(None, [off])


def test_to_dict_round_trips():
    from moe_train.config import config_from_dict

    cfg = load_config(ROOT / "configs" / "transformer-base.yaml", ["deepspeed.steps_per_print=7"])
    again = config_from_dict(cfg.to_dict())
    assert again == cfg


def test_a_bad_field_names_the_file_of_the_chain_that_sets_it(tmp_path) -> None:
    """A typo in the extended file is blamed on that file, not on the variant that extends
    it; a bad value the variant sets (over its parent's) on the variant."""
    (tmp_path / "base.yaml").write_text("model:\n  d_modle: 64\n  d_model: 32\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrain:\n  max_steps: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "child.yaml")
    assert str(err.value).startswith(f"{tmp_path / 'base.yaml'} (extended by "
                                      f"{tmp_path / 'child.yaml'}): model.d_modle: unknown")
    (tmp_path / "base.yaml").write_text("model:\n  d_model: 32\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nmodel:\n  d_model: -3\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "child.yaml")
    assert str(err.value).startswith(f"{tmp_path / 'child.yaml'}: model.d_model")
    # a combination: the variant's n_heads against the parent's d_model is the variant's
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nmodel:\n  n_heads: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "child.yaml")
    assert str(err.value).startswith(f"{tmp_path / 'child.yaml'}: model.")
    # a file that validates alone: the overrides made the combination
    (tmp_path / "child.yaml").write_text("extends: base.yaml\n")
    with pytest.raises(ConfigError, match=r"^overrides \(model.n_heads=3\): model\."):
        load_config(tmp_path / "child.yaml", ["model.n_heads=3"])


def test_extends_merges_over_the_parent_and_refuses_cycles(tmp_path) -> None:
    (tmp_path / "base.yaml").write_text("model:\n  d_model: 64\n  n_heads: 4\ntrain:\n  max_steps: 7\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nmodel:\n  d_model: 32\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.max_steps) == (32, 4, 7)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"extends: a.yaml leads back to itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"c.yaml: extends: .*missing.yaml: config file not "
                                          r"found$"):  # names the file that says extends
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("extends: ''\n")
    with pytest.raises(ConfigError, match=r"d.yaml: extends: .*: a directory"):
        load_config(tmp_path / "d.yaml")


def test_yaml_merge_keys_work_and_an_unreadable_file_is_one_error(tmp_path, monkeypatch):
    path = tmp_path / "merge.yaml"
    path.write_text("moe: &r\n  aux_loss_coef: 0.02\n  num_experts: 4\n"
                    "adapters:\n  <<: {aux_loss_coef: 0.05}\n  num_experts: 4\n"
                    "  router: sentence\n  k: 1\n")
    cfg = load_config(path)
    assert cfg.adapters.aux_loss_coef == 0.05 and cfg.moe.aux_loss_coef == 0.02
    import errno

    def refused(self, *args, **kwargs):  # a file without read permission (root reads all)
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(ConfigError, match=r"merge.yaml: cannot read it \(Permission denied\)"):
        load_config(path)


@pytest.mark.parametrize("clusterer,auto", [("gmm", True), ("kmeans", False), ("birch", False)])
def test_cluster_projection_defaults_follow_the_clusterer(clusterer, auto) -> None:
    """moa.whiten / moa.unit_norm unset: on for GMM only; set: kept (null means unset)."""
    cfg = load_config(overrides=[f"moa.clusterer={clusterer}"])
    assert (cfg.moa.whiten, cfg.moa.unit_norm) == (auto, auto)
    flip = str(not auto).lower()
    cfg = load_config(overrides=[f"moa.clusterer={clusterer}", f"moa.whiten={flip}",
                                 "moa.unit_norm=null"])
    assert (cfg.moa.whiten, cfg.moa.unit_norm) == (not auto, auto)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 4\n  d_model: 128\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:4: duplicate key 'd_model'"):
        load_config(path)


@pytest.mark.parametrize("template", ["Translate: {source:d}", "Translate: {source!x}",
                                      "{source} into {tgt_name:>{width}}"])
def test_prompt_template_that_cannot_format_is_refused_at_load(template, tmp_path) -> None:
    """It used to pass validation and raise a traceback in `prepare`."""
    path = tmp_path / "p.yaml"
    path.write_text(f"data:\n  prompt_template: {template!r}\n")
    with pytest.raises(ConfigError, match=r"data\.prompt_template: "):
        load_config(path)
    path.write_text("data:\n  prompt_template: 'Translate {src_name}: {source}'\n")
    assert load_config(path).data.prompt_template == "Translate {src_name}: {source}"


@pytest.mark.parametrize("flag", ["--src", "--ref", "--prepared", "--hyps", "--json"])
def test_an_empty_evaluate_path_is_refused_not_taken_as_absent(flag, capsys):
    """`evaluate --src "$UNSET" --ref "$UNSET"` scored the prepared test split instead, and
    `--hyps ""` wrote nothing, both with status 0."""
    from moe_train.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--checkpoint", "some/export", flag, ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert f"{flag}: expected a path, got an empty string" in err[0]
