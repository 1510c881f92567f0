"""Safe loading: safetensors exports round-trip to identical outputs (tied and shared tensors
included), legacy model.pt exports still load, every broken export is a one-line
CheckpointError naming the file, and the utils/safe_load helpers refuse bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import skops.io as sio
import torch

from moe_train.config import load_config
from moe_train.data.shards import read_manifest
from moe_train.errors import CheckpointError, MoeTrainError
from moe_train.models.build import build_model
from moe_train.train.export import (EXPORT_WEIGHTS, LEGACY_EXPORT_WEIGHTS, export_inference,
                                    load_export_weights, load_for_inference)
from moe_train.utils.safe_load import (load_skops, load_tensors, load_torch, read_json,
                                       read_json_object, save_tensors)
from tests.conftest import cli_env, run_cli

TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2"]
ARCHS = {
    "dense_tied": [],
    "dense_untied": ["model.tie_embeddings=false"],
    # MoE layers with one sentence router shared by the side's layers (shared tensors)
    "moe_sentence": ["moe.num_experts=4", "moe.layers=all", "moe.encoder_router=sentence",
                     "moe.decoder_router=sentence", "moe.k=1"],
    # adapters: one router shared by every decoder slot
    "adapters": ["adapters.num_experts=4", "adapters.router=sentence", "adapters.k=1",
                 "adapters.dim=4"],
}
SHARED = {"moe_sentence", "adapters"}
"""Archs whose state dict names one tensor several times (a router shared by layers)."""


class Foreign:
    """Not a tensor: weights_only loading must refuse a file holding it."""


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def make_export(prepared: Path, out: Path, *extra: str, seed: int = 0):
    """A randomly initialised model of TINY + `extra`, exported to `out`; (model, cfg)."""
    cfg = load_config(None, [*TINY, *extra])
    torch.manual_seed(seed)
    model = build_model(cfg, read_manifest(prepared))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # every tensor differs from its init
    export_inference(out, model.state_dict(), cfg, read_manifest(prepared),
                     prepared / "spm.model")
    return model.eval(), cfg


def logits(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    src_BS = torch.randint(4, 40, (3, 7), generator=gen)
    tgt_BT = torch.randint(4, 40, (3, 5), generator=gen)
    with torch.no_grad():
        return model(src_BS, tgt_BT).logits_BTV


# --------------------------------------------------------------------------- export format
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_round_trip_gives_identical_outputs(tiny_prepared, tmp_path, arch):
    model, cfg = make_export(tiny_prepared, tmp_path / "export", *ARCHS[arch])
    names = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert names == ["config.json", "manifest.json", EXPORT_WEIGHTS, "spm.model"]
    if arch in SHARED:  # several names for one tensor: plain safetensors would refuse these
        ptrs = [t.data_ptr() for t in model.state_dict().values()]
        assert len(set(ptrs)) < len(ptrs)
    inf = load_for_inference(tmp_path / "export")
    assert inf.cfg.to_dict() == cfg.to_dict() and not inf.model.training
    assert torch.equal(logits(inf.model), logits(model))
    for name, t in inf.model.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name
    # shared modules stay shared after loading (one parameter, several names)
    assert inf.model.num_parameters() == model.num_parameters()


def test_legacy_model_pt_export_still_loads(tiny_prepared, tmp_path):
    export = tmp_path / "export"
    model, _ = make_export(tiny_prepared, export, *ARCHS["dense_untied"])
    (export / EXPORT_WEIGHTS).unlink()
    torch.save({k: v.clone() for k, v in model.state_dict().items()},
               export / LEGACY_EXPORT_WEIGHTS)
    inf = load_for_inference(export)
    assert torch.equal(logits(inf.model), logits(model))
    assert set(load_export_weights(export)) == set(model.state_dict())


def _break(export: Path, case: str, other: Path) -> tuple[Path, str]:
    """Damage `export` as `case` says; (file the error must name, text it must contain)."""
    weights = export / EXPORT_WEIGHTS
    if case == "missing config":
        (export / "config.json").unlink()
        return export / "config.json", "missing; expected the exported model config"
    if case == "corrupt config":
        (export / "config.json").write_text('{"model": {"d_model": 16,')
        return export / "config.json", "line 1 column"
    if case == "config not an object":
        (export / "config.json").write_text("[1, 2]")
        return export / "config.json", "holds a JSON list"
    if case == "config not UTF-8":
        (export / "config.json").write_bytes(b"\xff\xfe{}")
        return export / "config.json", "not UTF-8 text"
    if case == "config bad field":
        cfg = json.loads((export / "config.json").read_text())
        cfg["model"]["d_modle"] = 16
        (export / "config.json").write_text(json.dumps(cfg))
        return export / "config.json", "d_modle"
    if case == "missing manifest":
        (export / "manifest.json").unlink()
        return export / "manifest.json", "missing"
    if case == "manifest without vocab_size":
        (export / "manifest.json").write_text("{}")
        return export / "manifest.json", "'vocab_size' is None; expected a non-negative integer"
    if case == "missing weights":
        weights.unlink()
        return weights, f"missing; expected the export's weights ({EXPORT_WEIGHTS}"
    if case == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return weights, "not a readable weights file"
    if case == "garbage weights":
        weights.write_bytes(b"\x00garbage" * 100)
        return weights, "not a readable weights file"
    if case == "empty weights":
        weights.write_bytes(b"")
        return weights, "not a readable weights file"
    if case == "garbage legacy weights":
        weights.unlink()
        (export / LEGACY_EXPORT_WEIGHTS).write_bytes(b"PK\x03\x04 not a zip")
        return export / LEGACY_EXPORT_WEIGHTS, "not a readable weights file"
    if case == "legacy weights with an object":
        weights.unlink()
        torch.save({"w": Foreign()}, export / LEGACY_EXPORT_WEIGHTS)
        return export / LEGACY_EXPORT_WEIGHTS, ("refused by weights-only loading (Unsupported "
                                                f"global: GLOBAL {__name__}.Foreign)")
    if case == "legacy weights not a dict":
        weights.unlink()
        torch.save([torch.zeros(2)], export / LEGACY_EXPORT_WEIGHTS)
        return export / LEGACY_EXPORT_WEIGHTS, "holds a list, not a mapping of tensor names"
    if case == "missing spm":
        (export / "spm.model").unlink()
        return export / "spm.model", "missing; expected the sentencepiece model"
    if case == "corrupt spm":
        (export / "spm.model").write_bytes(b"not a sentencepiece model")
        return export / "spm.model", "not a readable sentencepiece model"
    if case == "other architecture":
        shutil.copyfile(other / EXPORT_WEIGHTS, weights)
        return weights, "weights do not match the model of its config"
    if case == "tensor missing":
        state = load_tensors(weights)
        state.pop(sorted(state)[0])
        save_tensors(weights, state)
        return weights, "1 missing"
    raise AssertionError(case)


BROKEN = ["missing config", "corrupt config", "config not an object", "config not UTF-8",
          "config bad field", "missing manifest", "manifest without vocab_size",
          "missing weights", "truncated weights", "garbage weights", "empty weights",
          "garbage legacy weights", "legacy weights with an object", "legacy weights not a dict",
          "missing spm", "corrupt spm", "other architecture", "tensor missing"]


@pytest.fixture(scope="module")
def exports(tiny_prepared, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    make_export(tiny_prepared, root / "good")
    make_export(tiny_prepared, root / "other", "model.ffn_dim=24", "model.tie_embeddings=false")
    return {"good": root / "good", "other": root / "other"}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_export_is_one_line_checkpoint_error(exports, tmp_path, case):
    export = tmp_path / "export"
    shutil.copytree(exports["good"], export)
    load_for_inference(export)  # intact before the damage
    named, text = _break(export, case, exports["other"])
    with pytest.raises(CheckpointError) as exc:
        load_for_inference(export)
    msg = one_line(exc)
    assert msg.startswith(f"{named}: ") and text in msg, msg


def test_cli_prints_one_line_for_a_corrupt_export(exports, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(exports["good"], export)
    (export / EXPORT_WEIGHTS).write_bytes(b"garbage")
    (tmp_path / "in.txt").write_text("katze hund\n", encoding="utf-8")
    proc = run_cli(["translate", "--checkpoint", str(export), "--input", str(tmp_path / "in.txt")],
                   tmp_path, check=False, env=cli_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {export / EXPORT_WEIGHTS}: not a readable weights file (name -> tensor) "
        "(SafetensorError: "), proc.stderr


# ------------------------------------------------------------------------------- helpers
def test_save_tensors_unshares_views_and_ties(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": base, "tied": base, "row": base[1], "t": base.t(), "ids": torch.arange(3)}
    save_tensors(tmp_path / "w.safetensors", tensors, metadata={"format": "x"})
    back = load_tensors(tmp_path / "w.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left


def test_saved_files_get_the_usual_permissions(tmp_path):
    """safetensors makes its own 0600 file: the written file still gets 0666 minus the umask,
    so an export shared with a team can be read by it."""
    import os

    umask = os.umask(0o022)
    try:
        save_tensors(tmp_path / "w.safetensors", {"w": torch.ones(2)})
    finally:
        os.umask(umask)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o644


def test_load_tensors_pt_and_refusals(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(load_tensors(tmp_path / "ok.pt")["w"], torch.ones(2))
    torch.save({"w": Foreign()}, tmp_path / "obj.pt")
    with pytest.raises(CheckpointError, match=r"obj\.pt: refused by weights-only loading "
                                              r".*Foreign\); expected weights file of tensors"):
        load_tensors(tmp_path / "obj.pt")
    with pytest.raises(CheckpointError, match=r"nope\.safetensors: missing; expected gate"):
        load_tensors(tmp_path / "nope.safetensors", "gate")


def test_load_torch_allows_only_named_globals(tmp_path):
    torch.save({"step": 3, "x": torch.zeros(1)}, tmp_path / "plain.pt")
    assert load_torch(tmp_path / "plain.pt")["step"] == 3
    torch.save(torch.float16, tmp_path / "dtype.pt")  # torch dtypes are allowed by default
    assert load_torch(tmp_path / "dtype.pt") is torch.float16
    torch.save(Foreign(), tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError) as exc:
        load_torch(tmp_path / "foreign.pt", "RNG state")
    assert one_line(exc).startswith(f"{tmp_path / 'foreign.pt'}: refused by weights-only")
    assert isinstance(load_torch(tmp_path / "foreign.pt", safe_globals=[Foreign]), Foreign)


class RunsCode:
    """A pickle that would run a shell command when unpickled."""

    def __reduce__(self):
        import os

        return (os.system, ("true",))


def test_a_file_that_calls_a_blocked_function_is_refused_by_name(tmp_path):
    """A global in a module torch blocks outright (posix.system) has another message than a
    class it merely does not know: both are refused naming the global, and the message never
    passes on torch's advice to retry with weights_only=False."""
    torch.save({"w": RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as exc:
        load_torch(tmp_path / "evil.pt", "the distilled gate's weights")
    message = one_line(exc)
    assert "refused by weights-only loading (unsupported GLOBAL posix.system)" in message
    assert "weights_only" not in message.split("loading", 1)[1]


def test_read_json_errors(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    assert read_json_object(tmp_path / "a.json") == {"x": 1}
    (tmp_path / "bad.json").write_text('{"x": }')
    with pytest.raises(CheckpointError, match=r"bad\.json: line 1 column 7: .*; expected meta"):
        read_json(tmp_path / "bad.json", "meta")
    with pytest.raises(MoeTrainError, match=r"gone\.json: missing; expected meta"):
        read_json(tmp_path / "gone.json", "meta")


def test_load_skops_trusted_list(tmp_path):
    from collections import Counter  # not trusted by skops by default

    sio.dump({"c": Counter("aab")}, tmp_path / "c.skops")
    with pytest.raises(CheckpointError) as exc:
        load_skops(tmp_path / "c.skops", [])
    assert "holds untrusted types collections.Counter" in one_line(exc)
    assert load_skops(tmp_path / "c.skops", ["collections.Counter"])["c"]["a"] == 2


def test_numpy_arrays_are_loaded_without_pickles_and_checked(tmp_path):
    import numpy as np

    from moe_train.utils.safe_load import load_array, load_arrays

    np.save(tmp_path / "f.npy", np.ones((3, 2), np.float32))
    assert load_array(tmp_path / "f.npy", "features", "f", 2, rows=3).shape == (3, 2)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "cut.npy").write_bytes((tmp_path / "f.npy").read_bytes()[:-4])
    np.save(tmp_path / "int.npy", np.ones((3, 2), np.int64))
    for name, says in (("obj.npy", "not a readable features"), ("cut.npy", "not a readable"),
                       ("int.npy", "dtype int64; expected features (2-D, float, 3 rows)")):
        with pytest.raises(CheckpointError) as exc:
            load_array(tmp_path / name, "features", "f", 2, rows=3)
        assert one_line(exc).startswith(str(tmp_path / name)) and says in one_line(exc), name
    with pytest.raises(CheckpointError, match="expected features .*4 rows"):
        load_array(tmp_path / "f.npy", "features", "f", 2, rows=4)
    np.savez(tmp_path / "m.npz", split=np.zeros(3, np.int64), index=np.arange(3))
    with pytest.raises(CheckpointError, match=r"m\.npz: 'domain' is missing; expected ids"):
        load_arrays(tmp_path / "m.npz", "ids", ("split", "index", "domain"), 3)
    assert set(load_arrays(tmp_path / "m.npz", "ids", ("split", "index"), 3)) == {"split",
                                                                                   "index"}
    np.save(tmp_path / "meta.npy", np.arange(3))  # an .npy under the archive's name
    (tmp_path / "meta.npz").write_bytes((tmp_path / "meta.npy").read_bytes())
    with pytest.raises(CheckpointError, match=r"meta\.npz: a single array, not an \.npz archive"):
        load_arrays(tmp_path / "meta.npz", "ids", ("split",), 3)


def test_load_torch_maps_a_zip_file_and_reads_a_legacy_one_whole(tmp_path) -> None:
    """mmap (DeepSpeed's model states, whose optimizer part a reader of the weights skips):
    the same values; a file in torch's legacy format cannot be mapped and is read whole."""
    state = {"module": {"w": torch.arange(6.0)}, "optimizer": {"m": torch.ones(3)}}
    torch.save(state, tmp_path / "new.pt")
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("new.pt", "old.pt"):
        got = load_torch(tmp_path / name, "model states", mmap=True)
        assert torch.equal(got["module"]["w"], state["module"]["w"]), name


@pytest.mark.parametrize("failure", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 68719476736 bytes. Error code 12"),
])
def test_running_out_of_memory_is_the_machines_error_not_a_bad_file(tmp_path, monkeypatch,
                                                                   capsys, failure):
    """A file too large for the free memory is reported as that (status 1), not as a bad file
    (status 2: the user would delete a good checkpoint); the safetensors, torch, numpy and
    lazy (Hugging Face shard) readers alike."""
    import numpy as np
    import safetensors.torch

    from moe_train.cli import main
    from moe_train.errors import OutOfMemory
    from moe_train.utils import tensor_source
    from moe_train.utils.safe_load import load_array, save_tensors

    def fail(*args, **kwargs):
        raise failure

    st, pt, npy = tmp_path / "w.safetensors", tmp_path / "w.pt", tmp_path / "a.npy"
    save_tensors(st, {"w": torch.ones(2)})
    torch.save({"w": torch.ones(2)}, pt)
    np.save(npy, np.ones(3))
    monkeypatch.setattr(safetensors.torch, "load_file", fail)
    monkeypatch.setattr(torch, "load", fail)
    monkeypatch.setattr(np, "load", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    for load in (lambda: load_tensors(st), lambda: load_tensors(pt),
                 lambda: load_array(npy, "features", "f", 1)):
        with pytest.raises(OutOfMemory, match="out of memory reading it as"):
            load()
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", fail)
    with pytest.raises(OutOfMemory, match=str(st)):
        tensor_source.safetensors_source([st])
    # a bad file stays bad input
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not a readable"):
        load_tensors(bad)
    # the CLI: one line, status 1
    monkeypatch.setattr(torch, "load", fail)
    monkeypatch.setattr(safetensors.torch, "load_file", fail)
    export = tmp_path / "export"
    export.mkdir()
    save_tensors(export / "model.safetensors", {"w": torch.ones(2)})
    monkeypatch.setattr("moe_train.commands.cmd_params", lambda args: load_tensors(
        export / "model.safetensors") and 0)
    assert main(["params", "--checkpoint", str(export)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {export / 'model.safetensors'}: out of "
                                               "memory reading it as weights file"), err
