"""Ways to damage a copy of a trained checkpoint for test_bad_inputs' cases: each takes the
checkpoint directory, breaks one file in place and returns extra placeholder values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path


def step_dir(ckpt: Path) -> Path:
    """The step directory `latest` names."""
    return ckpt / (ckpt / "latest").read_text().strip()


def dangling_latest(ckpt: Path) -> dict:
    """`latest` names a step that does not exist, and no complete step is left to fall back to
    (with one left, resume falls back with a warning: test_checkpoint_lifecycle.py)."""
    shutil.rmtree(step_dir(ckpt))
    (ckpt / "latest").write_text("step_00000099\n")
    return {}


def garbage_latest(ckpt: Path) -> dict:
    shutil.rmtree(step_dir(ckpt))
    (ckpt / "latest").write_bytes(b"\x00\xff\xfe garbage \n\n../../etc\n")
    return {}


def corrupt_meta(ckpt: Path) -> dict:
    _rewrite(step_dir(ckpt), "meta.json", lambda path: path.write_text('{"step": 2, "config": {'))
    return {}


def torn_model_states(ckpt: Path) -> dict:
    """A step whose model states file lost its tail after complete.json was written (a copy cut
    short): named directly, it must be refused like a torn step behind `latest`."""
    path = step_dir(ckpt) / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[:100])
    return {}


def _rewrite(step: Path, name: str, write) -> None:
    """Replace a file of a complete step and list its new size, so the step still verifies."""
    write(step / name)
    complete = json.loads((step / "complete.json").read_text())
    complete["files"][name] = (step / name).stat().st_size
    (step / "complete.json").write_text(json.dumps(complete))


def empty_rng_states(ckpt: Path) -> dict:
    import torch

    _rewrite(step_dir(ckpt), "rng_rank0.pt", lambda path: torch.save({}, path))
    return {}


def tensor_rng_states(ckpt: Path) -> dict:
    """A tensor where the dict of generator states belongs (an IndexError inside)."""
    import torch

    _rewrite(step_dir(ckpt), "rng_rank0.pt", lambda path: torch.save(torch.zeros(3), path))
    return {}


def _edit_meta(ckpt: Path, edit: Callable[[dict], None]) -> dict:
    def write(path: Path) -> None:
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))

    _rewrite(step_dir(ckpt), "meta.json", write)
    return {}


def text_world_size(ckpt: Path) -> dict:
    return _edit_meta(ckpt, lambda meta: meta.update(world_size="x"))


def text_step(ckpt: Path) -> dict:
    return _edit_meta(ckpt, lambda meta: meta.update(step="2"))


def no_data_state(ckpt: Path) -> dict:
    return _edit_meta(ckpt, lambda meta: meta.pop("data_state"))


def list_early_stop(ckpt: Path) -> dict:
    return _edit_meta(ckpt, lambda meta: meta.update(early_stop=[1]))


def listed_files_not_a_mapping(ckpt: Path) -> dict:
    """complete.json's `files` a list: the step does not verify (no older one to fall back to)."""
    step = step_dir(ckpt)
    complete = json.loads((step / "complete.json").read_text())
    complete["files"] = sorted(complete["files"])
    (step / "complete.json").write_text(json.dumps(complete))
    return {}


class _RunsCode:
    """Pickled as a call of os.getpid: harmless, but code a weights-only load must refuse."""

    def __reduce__(self):
        import os

        return (os.getpid, ())


def pickled_code_in_model_states(ckpt: Path) -> dict:
    """DeepSpeed's model states file holding a call: DeepSpeed's own loader unpickles it."""
    import torch

    def write(path: Path) -> None:
        states = torch.load(path, weights_only=True)
        states["extra"] = _RunsCode()
        torch.save(states, path)

    _rewrite(step_dir(ckpt), "mp_rank_00_model_states.pt", write)
    return {}


def corrupt_weights(ckpt: Path) -> dict:
    """Truncate the export's weights file (model.safetensors, or model.pt of older exports)."""
    weights = next(p for p in (ckpt / "export" / n for n in ("model.safetensors", "model.pt"))
                   if p.is_file())
    weights.write_bytes(weights.read_bytes()[:100])
    return {"weights": str(weights)}


def no_export_config(ckpt: Path) -> dict:
    (ckpt / "export" / "config.json").unlink()
    return {}


def corrupt_export_manifest(ckpt: Path) -> dict:
    (ckpt / "export" / "manifest.json").write_text("[1, 2")
    return {}


def manifest_without_langs(ckpt: Path) -> dict:
    path = ckpt / "export" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["langs"]
    path.write_text(json.dumps(manifest))
    return {}


def huge_vocab_size(ckpt: Path) -> dict:
    """A manifest vocabulary of 10**12: refused by the weights' shapes before any memory."""
    path = ckpt / "export" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["vocab_size"] = 10**12
    path.write_text(json.dumps(manifest))
    return {}


def pad_id_past_vocab(ckpt: Path) -> dict:
    path = ckpt / "export" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["pad_id"] = manifest["vocab_size"]
    path.write_text(json.dumps(manifest))
    return {}


def integer_weights(ckpt: Path) -> dict:
    """One weight stored as int64: loading would cast it into nonsense silently."""
    from safetensors.torch import load_file, save_file

    path = ckpt / "export" / "model.safetensors"
    state = load_file(path)
    name = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
    state[name] = state[name].long()
    save_file(state, path)
    return {"name": name}


def smaller_vocab_size(ckpt: Path) -> dict:
    """An export whose sentencepiece model is larger than its model's vocabulary (the tokenizer
    of another preparation): translating would index past the embeddings."""
    path = ckpt / "export" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["vocab_size"] = 10
    path.write_text(json.dumps(manifest))
    return {}


def tiny_positions(ckpt: Path) -> dict:
    """An export claiming fewer positions than the test split's sentences need."""
    path = ckpt / "export" / "config.json"
    config = json.loads(path.read_text())
    config["model"]["max_positions"] = 8
    path.write_text(json.dumps(config))
    return {}
