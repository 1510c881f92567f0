"""Stage records (stages/record.py): a finished stage is reused only while its config fields,
its prepared data and the stages it read are what they were; otherwise one ConfigError line
names what changed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_train.config import load_config
from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.stages.backbone import backbone_config
from moe_train.stages.common import DONE, StageContext
from moe_train.stages.record import config_fields, differences, made_from


def _ctx(tmp_path, *overrides: str) -> StageContext:
    prepared = tmp_path / "prepared"
    prepared.mkdir(exist_ok=True)
    if not (prepared / "manifest.json").exists():
        (prepared / "manifest.json").write_text('{"version": 1}')
    cfg = load_config(None, [f"moa.workdir={tmp_path / 'run'}",
                             f"data.prepared_dir={prepared}", *overrides])
    return StageContext(cfg, ParallelRuntime())


def _finish(ctx: StageContext, stage: str, cfg=None, reads: tuple[str, ...] = ()) -> dict:
    assert ctx.reuse(stage, cfg or ctx.cfg) is None
    for name in reads:
        ctx.require(name, stage)
    ctx.stage_dir(stage).mkdir(parents=True, exist_ok=True)
    return ctx.finish(stage, {"value": 1}, cfg or ctx.cfg)


def test_fields_leave_out_what_no_artifact_depends_on(tmp_path) -> None:
    cfg = _ctx(tmp_path).cfg
    fields = config_fields("adapters", cfg)
    assert "train.max_steps" in fields and "model.d_model" in fields
    assert "moa.adapter_steps" in fields and "moa.seed" not in fields
    assert not [f for f in fields if f.startswith(("logging.", "checkpoint."))]
    assert "data.prepared_dir" not in fields and "moa.workdir" not in fields
    assert "train.progress_bar" not in fields and "data.num_workers" not in fields
    # The backbone depends on its adapter's shape, not on MoA's stage settings or routing;
    # without an adapter, on their count only.
    backbone = config_fields("backbone", cfg)
    assert "adapters.dim" not in backbone and backbone["adapters.num_experts"] == 0
    injected = config_fields("backbone", _ctx(tmp_path, "adapters.num_experts=1").cfg)
    assert "adapters.dim" in injected and "adapters.num_experts" in injected
    assert not [f for f in injected if f.startswith("moa.")]
    assert "adapters.tau" not in injected and "adapters.task_source" not in injected
    # No stage reads a section its model does not use: THOR's, Qwen's, a gated router's.
    gumbel = _ctx(tmp_path, "adapters.num_experts=4", "adapters.router=gumbel").cfg
    for stage in ("adapters", "evaluate"):
        assert not [f for f in config_fields(stage, gumbel)
                    if f.startswith(("thor.", "qwen.", "gated."))], stage
    gated = _ctx(tmp_path, "adapters.num_experts=4", "adapters.router=gated").cfg
    assert "gated.temperature" in config_fields("adapters", gated)
    # Features, clusters and the gate read the data and the moa section only.
    gate = config_fields("cluster", cfg)
    assert "moa.num_clusters" in gate and "data.vocab_size" in gate
    assert not [f for f in gate if f.startswith(("model.", "train.", "adapters.", "optim."))]
    assert "moa.adapter_steps" not in gate and "moa.distill_steps" not in gate
    assert "moa.num_clusters" not in config_fields("features", cfg)
    assert "moa.adapter_steps" in config_fields("adapters", cfg)
    assert "moa.distill_steps" not in config_fields("adapters", cfg)
    # The gad recipe's MIX is that backbone: a GAD, AD or evaluation setting leaves it current
    # (it was retrained for a new gated.ad_steps); its other stages depend on the whole config.
    assert config_fields("backbone", cfg, recipe="gad") == backbone
    ad = config_fields("ad", cfg, recipe="gad")
    assert "gated.lr" in ad and "gated.ad_steps" in ad and "train.max_steps" in ad
    assert "gated.gad_init" not in ad and "gated.alpha" not in ad and "moa.adapter_steps" not in ad
    gad = config_fields("gad", cfg, recipe="gad")
    assert {"gated.gad_init", "gated.encoder_loss_norm", "gated.alpha"} <= set(gad)
    assert "gated.ad_steps" not in gad and "gated.efficiency_batch" not in gad
    classifier = config_fields("classifier", cfg, recipe="gad")
    assert "gated.classifier_steps" in classifier and "data.max_tokens" in classifier
    assert not [f for f in classifier
                if f.startswith(("adapters.", "train.", "optim.", "model.", "moe."))]
    assert "gated.efficiency_batch" in config_fields("evaluate", cfg, recipe="gad")


def test_differences_name_fields_data_and_inputs() -> None:
    old = {"config": {"a.x": 1, "a.y": [1, 2], "a.gone": 0}, "data": "d1",
           "inputs": {"backbone": "h1", "cluster": "h2"}}
    new = {"config": {"a.x": 2, "a.y": [1, 2], "a.new": 5}, "data": "d2",
           "inputs": {"backbone": "h1", "cluster": "h3"}}
    assert differences(old, new) == ["a.x: 1 -> 2", "the prepared data (manifest.json differs)",
                                     "the output of stage cluster (rerun since)"]
    assert differences(old, old) == []


def test_unchanged_stage_is_reused(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "features")
    again = _ctx(tmp_path, "train.log_every=7", "train.progress_bar=true",
                 "checkpoint.keep_last=9")
    record = again.reuse("features", again.cfg)
    assert record is not None and record["value"] == 1 and "made_from" in record


def test_changed_config_is_one_line_naming_the_fields(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "cluster")
    changed = _ctx(tmp_path, "moa.num_clusters=7", "moa.pca_dim=9")
    with pytest.raises(ConfigError) as err:
        changed.reuse("cluster", changed.cfg)
    msg = str(err.value)
    assert "\n" not in msg and "stage cluster" in msg and str(ctx.stage_dir("cluster")) in msg
    assert "moa.num_clusters: 12 -> 7" in msg and "moa.pca_dim: 64 -> 9" in msg
    assert "delete" in msg
    # Settings the cluster stage does not read change nothing.
    other = _ctx(tmp_path, "train.max_steps=3", "model.d_model=32", "model.n_heads=4",
                 "moa.adapter_steps=3", "moa.distill_steps=5", "moa.eval_beam=1")
    assert other.reuse("cluster", other.cfg) is not None


def test_changed_data_is_stale(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "features")
    (tmp_path / "prepared" / "manifest.json").write_text('{"version": 1, "other": true}')
    with pytest.raises(ConfigError, match="the prepared data"):
        ctx.reuse("features", ctx.cfg)


def test_rerun_upstream_makes_readers_stale(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "features")
    _finish(ctx, "cluster", reads=("features",))
    made = json.loads((ctx.stage_dir("cluster") / DONE).read_text())["made_from"]
    assert set(made["inputs"]) == {"features"}
    assert ctx.reuse("cluster", ctx.cfg) is not None
    # features rerun (its record rewritten): the clusters were made from the old features.
    (ctx.stage_dir("features") / DONE).unlink()
    _finish(ctx, "features")
    with pytest.raises(ConfigError, match="the output of stage features"):
        ctx.reuse("cluster", ctx.cfg)


def test_backbone_is_shared_by_runs_that_differ_in_moa_settings(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "backbone", backbone_config(ctx))
    # ADPT-like: another adapter router and stage settings over the same backbone.
    adpt = _ctx(tmp_path, "adapters.router=task", "adapters.num_experts=5", "adapters.k=1",
                "moa.adapter_steps=7", "moa.unfreeze_decoder=false", "moa.num_clusters=3")
    assert adpt.reuse("backbone", backbone_config(adpt)) is not None
    # A longer training budget is another backbone.
    longer = _ctx(tmp_path, "train.max_steps=123")
    with pytest.raises(ConfigError, match="train.max_steps"):
        longer.reuse("backbone", backbone_config(longer))
    # So is another pre-injected adapter size.
    wider = _ctx(tmp_path, "adapters.dim=7")
    with pytest.raises(ConfigError, match="adapters.dim: 128 -> 7"):
        wider.reuse("backbone", backbone_config(wider))


def test_records_without_made_from_are_reused_with_a_warning(tmp_path, capsys) -> None:
    ctx = _ctx(tmp_path)
    where = ctx.stage_dir("distill")
    where.mkdir(parents=True)
    (where / DONE).write_text('{"steps": 3}')
    assert ctx.reuse("distill", ctx.cfg) == {"steps": 3}
    assert "reusing it unchecked" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"[1]", b'{"made_from": "x"}', b'{"made_from": {}}',
                                     b'{"made_from": {"inputs": ["cluster"]}}', b"\xff\xfe{}",
                                     b'{"made_from": {"inputs": {}, "config": null}}',
                                     b'{"made_from": {"inputs": {}, "data": 3}}'])
def test_a_broken_stage_record_is_one_line_naming_it(tmp_path, content: bytes) -> None:
    ctx = _ctx(tmp_path)
    where = ctx.stage_dir("distill")
    where.mkdir(parents=True)
    (where / DONE).write_bytes(content)
    with pytest.raises(DataError) as exc:
        ctx.reuse("distill", ctx.cfg)
    assert str(exc.value).startswith(f"{where / DONE}: ") and "delete it" in str(exc.value)


def test_made_from_is_json_and_tracks_reads(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    cfg = dataclasses.replace(ctx.cfg)
    rec = made_from("evaluate", cfg, {})
    assert json.loads(json.dumps(rec)) == rec and rec["inputs"] == {} and rec["data"]


def test_rerun_stale_deletes_the_stage_and_its_readers_follow(tmp_path, capsys) -> None:
    ctx = _ctx(tmp_path)
    _finish(ctx, "features")
    _finish(ctx, "cluster", reads=("features",))
    (ctx.stage_dir("features") / "features.npy").write_bytes(b"old")
    changed = dataclasses.replace(_ctx(tmp_path, "moa.sample_size=3"), rerun_stale=True)
    assert changed.reuse("features", changed.cfg) is None  # stale: deleted, to be run again
    assert [p.name for p in changed.stage_dir("features").iterdir()] == [".lock"]  # held
    assert "deleting it and running the stage again" in capsys.readouterr().out
    _finish(changed, "features")
    # The clusters read the old features: stale through their input, deleted in turn.
    assert changed.reuse("cluster", changed.cfg) is None
    assert [p.name for p in changed.stage_dir("cluster").iterdir()] == [".lock"]


def test_rerun_stale_never_deletes_a_shared_backbone(tmp_path) -> None:
    owner = _ctx(tmp_path)
    _finish(owner, "backbone", backbone_config(owner))
    shared = f"moa.backbone_dir={owner.stage_dir('backbone')}"
    other = dataclasses.replace(
        _ctx(tmp_path, shared, f"moa.workdir={tmp_path / 'other'}", "train.max_steps=9"),
        rerun_stale=True)
    with pytest.raises(ConfigError, match="shared through moa.backbone_dir"):
        other.reuse("backbone", backbone_config(other))
    assert (owner.stage_dir("backbone") / DONE).is_file()


def test_one_stage_run_names_stale_inputs_and_runs(tmp_path, capsys, monkeypatch) -> None:
    """`pipeline moa --stage distill`: the stages before it are looked over, not run; one
    made from something else is a warning line (the stage reads it as it is), a missing one is
    left to the stage's own require(), and a stale one is never deleted, even with
    --rerun-stale."""
    from moe_train.stages import pipeline

    ran: list[str] = []
    monkeypatch.setitem(pipeline.RECIPES["moa"], "distill",
                        lambda ctx: ran.append(ctx.cfg.moa.num_clusters) or {"ok": 1})
    gumbel = ("adapters.router=gumbel", "adapters.num_experts=0")
    ctx = _ctx(tmp_path, *gumbel)
    assert pipeline.recipe_stages(ctx)[:4] == ["backbone", "features", "cluster", "distill"]
    assert pipeline.run_pipeline(ctx, "moa", stage="distill") == {"distill": {"ok": 1}}
    assert "warning" not in capsys.readouterr().out  # nothing finished yet: nothing to name
    _finish(ctx, "backbone", backbone_config(ctx))
    _finish(ctx, "features")
    _finish(ctx, "cluster", reads=("features",))
    pipeline.run_pipeline(ctx, "moa", stage="distill")
    assert "warning" not in capsys.readouterr().out  # all current
    other = dataclasses.replace(_ctx(tmp_path, *gumbel, "moa.num_clusters=6"), rerun_stale=True)
    pipeline.run_pipeline(other, "moa", stage="distill")
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and "stage cluster (" in out and "before distill" in out
    assert "moa.num_clusters: 12 -> 6" in out and out.count("\n") == 1
    assert ran == [12, 12, 6] and (ctx.stage_dir("cluster") / DONE).is_file()


def test_adapter_warmup_is_the_adapter_stages_own(tmp_path) -> None:
    """moa.adapter_warmup_steps sets the adapter stage's warm-up (None: optim.warmup_steps),
    so a backbone schedule can change without changing the adapter stage's; it is part of
    what the adapter stage is made from, not the backbone."""
    from moe_train.stages.adapters import adapters_config

    ctx = _ctx(tmp_path, "optim.warmup_steps=1000", "moa.adapter_lr=2e-3")
    assert adapters_config(ctx).optim.warmup_steps == 1000
    assert adapters_config(ctx).optim.lr == 2e-3
    ctx = _ctx(tmp_path, "optim.warmup_steps=1000", "moa.adapter_warmup_steps=150")
    assert adapters_config(ctx).optim.warmup_steps == 150
    assert ctx.cfg.optim.warmup_steps == 1000  # the backbone's own schedule is untouched
    assert "moa.adapter_warmup_steps" in config_fields("adapters", ctx.cfg)
    assert "moa.adapter_warmup_steps" not in config_fields("backbone", ctx.cfg)
    with pytest.raises(ConfigError, match="moa.adapter_warmup_steps"):
        _ctx(tmp_path, "moa.adapter_warmup_steps=-1")


def test_provenance_names_the_code_the_process_loaded(tmp_path, monkeypatch) -> None:
    """A stage record's commit is the one taken when the process built its context, not
    whatever HEAD is when a long stage finishes; its times are the stage's own."""
    import moe_train.utils.provenance as prov

    ctx = _ctx(tmp_path)
    loaded = ctx.process_provenance["git"]
    monkeypatch.setattr(prov, "git_state", lambda *a, **k: {"commit": "f" * 40, "dirty": False})
    record = _finish(ctx, "features")
    assert record["provenance"]["git"] == loaded
    p = record["provenance"]
    assert p["started_at"] <= p["finished_at"] and p["wall_seconds"] >= 0
    assert "loadavg_1_5_15min_end" in p["machine"]


def test_a_stage_of_another_recipe_in_the_workdir_is_never_taken_nor_deleted(tmp_path) -> None:
    """gad and moa both have an evaluate stage: one recipe's record is not the other's (it was
    reused as current), nor deleted by the other's --rerun-stale; the backbone is shared."""
    gad = dataclasses.replace(_ctx(tmp_path), recipe="gad")
    _finish(gad, "backbone")
    _finish(gad, "evaluate")
    assert "recipe" not in json.loads((gad.stage_dir("backbone") / DONE).read_text())["made_from"]
    moa = dataclasses.replace(_ctx(tmp_path), rerun_stale=True)
    assert moa.reuse("backbone", moa.cfg) is not None  # shared by every recipe
    with pytest.raises(ConfigError, match=r"^stage evaluate: .* belongs to the gad recipe"):
        moa.reuse("evaluate", moa.cfg)
    assert (gad.stage_dir("evaluate") / DONE).is_file()


def test_a_stage_being_run_is_locked_against_a_second_run(tmp_path) -> None:
    """A second run that would train into a stage directory the first still writes (e.g. a
    shared moa.backbone_dir) stops in one line; the lock goes with finish."""
    first, second = _ctx(tmp_path), _ctx(tmp_path)
    assert first.reuse("backbone", first.cfg) is None  # runs: holds the directory
    with pytest.raises(ConfigError, match=r"^stage backbone: .* is being written by another "
                                          r"run"):
        second.reuse("backbone", second.cfg)
    first.finish("backbone", {"value": 1}, first.cfg)
    assert second.reuse("backbone", second.cfg) is not None  # done, and free


def _save_step(ctx: StageContext, ckpt_dir: Path, cfg, attachments: dict | None = None) -> None:
    """Step 2 of `cfg`'s training saved into `ckpt_dir` by a fake DeepSpeed engine."""
    import torch

    from moe_train.train import checkpoint as ckpt

    class Engine:  # what save_checkpoint needs of a DeepSpeed engine
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(module.parameters())

        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)

    ckpt.save_checkpoint(Engine(), ctx.rt, ckpt_dir, 2,
                         {"step": 2, "config": cfg.to_dict(), "world_size": 1},
                         attachments or {}, 2)


def test_an_unfinished_training_stage_with_another_config_is_retrained_with_rerun_stale(
        tmp_path, capsys) -> None:
    """A training stage stopped before it finished (preempted, killed) resumes from its
    checkpoints; with a config that may not change on resume it is one line saying that
    --rerun-stale trains it anew, and --rerun-stale does (the checkpoints go)."""
    from moe_train.train import checkpoint as ckpt

    ctx = _ctx(tmp_path)
    cfg = backbone_config(ctx)
    ckpt_dir = tmp_path / cfg.checkpoint.dir
    _save_step(ctx, ckpt_dir, cfg)
    assert ctx.resume_training("backbone", cfg)  # the same config: it goes on
    changed = backbone_config(_ctx(tmp_path, "optim.lr=0.123"))
    with pytest.raises(CheckpointError, match=r"optim.lr 0.0.* -> 0.123; stage backbone has not "
                                          r"finished: with --rerun-stale it is trained anew "):
        ctx.resume_training("backbone", changed)
    assert ckpt.latest_tag(ckpt_dir, warn=None) == "step_00000002"
    ctx.rerun_stale = True
    assert not ctx.resume_training("backbone", changed) and not ckpt_dir.exists()
    assert "used another config or other data; deleting" in capsys.readouterr().out
    assert not ctx.resume_training("backbone", changed)  # nothing left to resume


def test_an_unfinished_training_stage_on_re_prepared_data_is_retrained_with_rerun_stale(
        tmp_path, capsys) -> None:
    """Training data prepared again with other content (same sizes) under the same
    data.prepared_dir: the unfinished stage is one line naming --rerun-stale, which trains it
    anew, as for a changed config (before, the trainer refused it later, and --rerun-stale
    could not help)."""
    ctx = _ctx(tmp_path)
    cfg = backbone_config(ctx)
    manifest = tmp_path / "prepared" / "manifest.json"
    manifest.write_text(json.dumps({"version": 1, "splits": {"train": {"sha256": "aa"}}}))
    ckpt_dir = tmp_path / cfg.checkpoint.dir
    _save_step(ctx, ckpt_dir, cfg, {"manifest.json": manifest})
    assert ctx.resume_training("backbone", cfg)  # the same data: it goes on
    manifest.write_text(json.dumps({"version": 1, "splits": {"train": {"sha256": "bb"}}}))
    with pytest.raises(CheckpointError, match=r"train sha256 'aa' -> 'bb'; stage backbone has "
                                          r"not finished: with --rerun-stale it is trained anew"):
        ctx.resume_training("backbone", cfg)
    ctx.rerun_stale = True
    assert not ctx.resume_training("backbone", cfg) and not ckpt_dir.exists()
    assert "used another config or other data; deleting" in capsys.readouterr().out
