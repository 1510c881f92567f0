"""Checkpoint averaging (`moe-train average`): the export holds the exact mean of the inputs'
weights and loads for translation; inputs that are not one model, or a bad command line, are
one-line refusals (status 2) that leave nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_train.cli import main
from moe_train.config import load_config
from moe_train.data.shards import read_manifest
from moe_train.errors import CheckpointError
from moe_train.models.build import build_model
from moe_train.train.average import AVERAGE_REPORT, AveragedInput, average_weights
from moe_train.train.export import export_inference, load_export_weights, load_for_inference

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
        "model.decoder_layers=1", "moe.num_experts=4", "moe.layers=all", "moe.k=2"]


def make_export(prepared: Path, out: Path, seed: int, *extra: str) -> dict[str, torch.Tensor]:
    """A tiny MoE model with random weights exported to `out`; its state dict."""
    cfg = load_config(None, [*TINY, *extra])
    torch.manual_seed(seed)
    model = build_model(cfg, read_manifest(prepared))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    export_inference(out, model.state_dict(), cfg, read_manifest(prepared),
                     prepared / "spm.model")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def refused(args: list[str], capsys) -> str:
    """The one error line of a command that must exit 2."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def exports(tiny_prepared, tmp_path_factory) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("average")
    paths = [root / f"e{i}" for i in range(3)]
    return paths, [make_export(tiny_prepared, p, seed=i) for i, p in enumerate(paths)]


def test_the_export_holds_the_exact_mean_and_loads(exports, tmp_path, capsys):
    paths, states = exports
    out = tmp_path / "avg"
    assert main(["average", *map(str, paths), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["count"] == 3 and [i["path"] for i in report["inputs"]] == list(map(str, paths))
    got = load_export_weights(out)
    assert got.keys() == states[0].keys()
    for name, value in got.items():
        mean = sum(s[name].double() for s in states) / 3
        assert value.dtype == torch.float32
        assert torch.equal(value, mean.float()), name  # float64 sum, one division
        assert not torch.equal(value, states[2][name])
    inf = load_for_inference(out)
    assert all(torch.equal(p, got[k]) for k, p in inf.model.state_dict().items())
    assert json.loads((out / AVERAGE_REPORT).read_text())["count"] == 3
    # an earlier average may be replaced by the next one, in place
    assert main(["average", str(paths[0]), str(paths[1]), "--out", str(out)]) == 0
    assert json.loads((out / AVERAGE_REPORT).read_text())["count"] == 2


def test_a_checkpoint_averaged_with_its_copy_is_itself_bit_for_bit(exports, tmp_path, capsys):
    paths, states = exports
    copy = tmp_path / "copy"
    shutil.copytree(paths[0], copy)
    assert main(["average", str(paths[0]), str(copy), "--out", str(tmp_path / "avg")]) == 0
    got = load_export_weights(tmp_path / "avg")
    assert all(torch.equal(got[k], v) for k, v in states[0].items())
    # done, but said: two paths to one checkpoint (an export and its step) count twice
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {copy} holds the same weights as {paths[0]} (an export and the step "
                   "it was written from?); the average counts them twice"], err
    report = json.loads((tmp_path / "avg" / AVERAGE_REPORT).read_text())
    assert report["identical_inputs"] == [[str(copy), str(paths[0])]]
    assert main(["average", str(paths[0]), str(paths[1]), "--out", str(tmp_path / "avg2")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "identical_inputs" not in json.loads((tmp_path / "avg2" / AVERAGE_REPORT).read_text())


def test_other_architecture_vocabulary_or_tokenizer_is_refused(exports, tiny_prepared, tmp_path,
                                                               capsys):
    paths, _ = exports
    wide = tmp_path / "wide"
    make_export(tiny_prepared, wide, 0, "moe.num_experts=8")
    err = refused(["average", str(paths[0]), str(wide), "--out", str(tmp_path / "a")], capsys)
    assert f"{wide}: not the same model" in err and "moe.num_experts 4 vs 8" in err
    k1 = tmp_path / "k1"
    make_export(tiny_prepared, k1, 0, "moe.k=1")  # same shapes, other routing
    err = refused(["average", str(paths[0]), str(k1), "--out", str(tmp_path / "a")], capsys)
    assert "moe.k 2 vs 1" in err
    spm = tmp_path / "spm"
    shutil.copytree(paths[1], spm)
    (spm / "spm.model").write_bytes((spm / "spm.model").read_bytes() + b"\0")
    err = refused(["average", str(paths[0]), str(spm), "--out", str(tmp_path / "a")], capsys)
    assert "tokenizer file spm.model" in err
    vocab = tmp_path / "vocab"
    shutil.copytree(paths[1], vocab)
    manifest = json.loads((vocab / "manifest.json").read_text())
    manifest["domains"] = list(reversed(manifest["domains"]))
    (vocab / "manifest.json").write_text(json.dumps(manifest))
    err = refused(["average", str(paths[0]), str(vocab), "--out", str(tmp_path / "a")], capsys)
    assert "manifest domains" in err
    special = tmp_path / "special"  # converted models: the special ids --to-hf writes back
    shutil.copytree(paths[1], special)
    manifest = json.loads((special / "manifest.json").read_text())
    manifest["hf_special_ids"] = {"eos_token_id": [2, 7]}
    (special / "manifest.json").write_text(json.dumps(manifest))
    err = refused(["average", str(paths[0]), str(special), "--out", str(tmp_path / "a")], capsys)
    assert "manifest hf_special_ids None vs {'eos_token_id': [2, 7]}" in err, err
    assert not (tmp_path / "a").exists()


def test_bad_command_lines_are_one_line_refusals(exports, tmp_path, capsys):
    paths, _ = exports
    out = str(tmp_path / "a")
    assert "expected at least 2" in refused(["average", str(paths[0]), "--out", out], capsys)
    err = refused(["average", str(paths[0]), str(paths[0]) + "/", "--out", out], capsys)
    assert "the same checkpoint" in err
    err = refused(["average", str(paths[0]), str(paths[1]), "--last", "2", "--out", out], capsys)
    assert "expected one checkpoint directory" in err
    err = refused(["average", str(paths[0]), "--last", "2", "--out", out], capsys)
    assert "holds 0 complete step directories" in err
    err = refused(["average", str(paths[0]), str(paths[1]), "--out", str(paths[1])], capsys)
    assert "is or contains the input" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = refused(["average", str(paths[0]), str(paths[1]), "--out", str(tmp_path / "mine")],
                  capsys)
    assert "holds no average.json" in err and (tmp_path / "mine" / "notes.txt").is_file()
    err = refused(["average", str(paths[0]), str(tmp_path / "nowhere"), "--out", out], capsys)
    assert "nowhere: not found" in err
    assert not Path(out).exists()


class FakeInput(AveragedInput):
    """An input whose weights are given (no files)."""

    def __init__(self, name: str, state: dict[str, torch.Tensor]) -> None:
        self.path, self.state = Path(name), state

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.state)


def test_non_float_tensors_must_agree_and_are_kept():
    table = torch.tensor([0, 2, 1])
    a = FakeInput("a", {"w": torch.tensor([1.0, 2.0]), "table": table})
    b = FakeInput("b", {"w": torch.tensor([2.0, 5.0]), "table": table.clone()})
    got = average_weights([a, b])
    assert torch.equal(got["w"], torch.tensor([1.5, 3.5])) and torch.equal(got["table"], table)
    c = FakeInput("c", {"w": torch.tensor([2.0, 5.0]), "table": torch.tensor([0, 1, 2])})
    with pytest.raises(CheckpointError, match="c: table .*differs from a's"):
        average_weights([a, c])
    d = FakeInput("d", {"w": torch.tensor([2.0, 5.0, 1.0]), "table": table})
    with pytest.raises(CheckpointError, match=r"d: w is torch.float32 \(3,\), a has"):
        average_weights([a, d])
    e = FakeInput("e", {"w": torch.tensor([2.0, 5.0])})
    with pytest.raises(CheckpointError, match="1 missing, 0 extra: table"):
        average_weights([a, e])


def test_a_zero3_model_is_averaged_into_a_sharded_export(tiny_prepared, tmp_path):
    """A ZeRO-3 run exports its weights as a tensor store; so does the average of it."""
    paths = [tmp_path / "z0", tmp_path / "z1"]
    states = [make_export(tiny_prepared, p, i, "optim.zero_stage=3") for i, p in enumerate(paths)]
    out = tmp_path / "avg"
    assert main(["average", *map(str, paths), "--out", str(out)]) == 0
    assert (out / "model.index.json").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / AVERAGE_REPORT).read_text())["count"] == 2
    got = load_for_inference(out).model.state_dict()
    assert all(torch.equal(v, ((states[0][k].double() + states[1][k].double()) / 2).float())
               for k, v in got.items())


def test_inputs_without_tokenizer_files_give_an_export_without_them(exports, tmp_path):
    """A model converted from a Hugging Face directory that had no tokenizer carries none."""
    paths, _ = exports
    bare = [tmp_path / "b0", tmp_path / "b1"]
    for src, dst in zip(paths, bare):
        shutil.copytree(src, dst)
        (dst / "spm.model").unlink()
    assert main(["average", *map(str, bare), "--out", str(tmp_path / "avg")]) == 0
    assert not (tmp_path / "avg" / "spm.model").exists()
    assert load_export_weights(tmp_path / "avg").keys() == load_export_weights(paths[0]).keys()


def test_a_tokenizer_only_one_input_has_is_refused_in_either_order(exports, tmp_path, capsys):
    paths, _ = exports
    bare = tmp_path / "bare"
    shutil.copytree(paths[0], bare)
    (bare / "spm.model").unlink()
    for pair in ((bare, paths[1]), (paths[1], bare)):
        err = refused(["average", *map(str, pair), "--out", str(tmp_path / "a")], capsys)
        assert "not the same model" in err and "tokenizer file spm.model" in err, err
    assert not (tmp_path / "a").exists()


def test_average_json_times_the_whole_command(exports, tmp_path, monkeypatch, capsys):
    """started_at is taken when the command starts, not when the report is written."""
    import time

    import moe_train.train.average as average

    paths, _ = exports
    real = average.average_weights
    monkeypatch.setattr(average, "average_weights",
                        lambda inputs, same=None: (time.sleep(1.5), real(inputs, same))[1])
    assert main(["average", str(paths[0]), str(paths[1]), "--out", str(tmp_path / "a")]) == 0
    prov = json.loads((tmp_path / "a" / AVERAGE_REPORT).read_text())["provenance"]
    assert prov["wall_seconds"] >= 1 and prov["started_at"] != prov["finished_at"]


def test_extracted_sub_networks_must_keep_the_same_experts(tiny_prepared, tmp_path, capsys):
    """Two extractions of one task may keep other experts (a learned gate changes during
    training): slot 0 of one is then another expert than slot 0 of the other. Refused, with
    the way out; the same experts average."""
    task = ["moe.k=1", "moe.encoder_router=task", "moe.decoder_router=task",
            "moe.encoder_task_source=tgt_lang", "moe.decoder_task_source=tgt_lang"]
    kept = {}
    for name, seed in (("a", 0), ("b", 1)):
        make_export(tiny_prepared, tmp_path / name, seed, *task)
        assert main(["extract", "--checkpoint", str(tmp_path / name), "--task", "de",
                     "--out", str(tmp_path / f"{name}_de")]) == 0
        kept[name] = json.loads((tmp_path / f"{name}_de" / "extract.json").read_text())[
            "experts_kept"]
    assert kept["a"] != kept["b"]  # these seeds' gates keep other experts
    capsys.readouterr()
    err = refused(["average", str(tmp_path / "a_de"), str(tmp_path / "b_de"), "--out",
                   str(tmp_path / "avg")], capsys)
    assert "experts kept in" in err and "average the full checkpoints, then extract" in err
    shutil.copytree(tmp_path / "a_de", tmp_path / "a_de2")
    assert main(["average", str(tmp_path / "a_de"), str(tmp_path / "a_de2"), "--out",
                 str(tmp_path / "avg")]) == 0
    assert "holds the same weights" in capsys.readouterr().err  # a copy: said, not refused
    err = refused(["average", str(tmp_path / "a"), str(tmp_path / "a_de"), "--out",
                   str(tmp_path / "avg2")], capsys)
    assert "not the same model" in err


def test_one_input_s_weights_are_held_at_a_time():
    """Beside the float64 sum: the first input's tensors are gone before the second loads."""
    import weakref

    alive: dict[int, list] = {}
    seen = []

    class Tracked(FakeInput):
        def weights(self):
            seen.append({i: sum(r() is not None for r in refs) for i, refs in alive.items()})
            state = {"w": torch.full((4,), float(len(alive)))}
            alive[len(alive)] = [weakref.ref(v) for v in state.values()]
            return state

    got = average_weights([Tracked("a", {}), Tracked("b", {}), Tracked("c", {})])
    assert seen == [{}, {0: 0}, {0: 0, 1: 0}] and torch.equal(got["w"], torch.ones(4))
