"""Standalone inference checkpoints: weights, config, sentencepiece model; no DeepSpeed needed.

An export directory holds ``model.safetensors`` (fp32 weights), ``config.json``,
``manifest.json`` (the prepared data's vocabulary facts) and ``spm.model``; no file in it can
run code when read. Exports written before safetensors hold ``model.pt`` instead, still read (with
``torch.load(weights_only=True)``).

`load_for_inference` accepts an export directory, a training checkpoint directory (follows
`latest`) or one step directory of it. A broken export (missing or corrupt file, weights of
another architecture) is a one-line CheckpointError naming the file and what was expected.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from moe_train.config.loader import config_from_dict
from moe_train.config.schema import ExperimentConfig
from moe_train.data.hf_tokenizer import HFTokenizer
from moe_train.data.prepare import open_tokenizer
from moe_train.data.vocab import Vocab
from moe_train.errors import CheckpointError, MoeTrainError
from moe_train.models.build import build_model, shape_model, skip_init
from moe_train.train.checkpoint import consolidated_state_dict, latest_tag, read_meta, verify_files
from moe_train.train.init_from import check_shapes, model_shapes
from moe_train.utils.atomic import atomic_dir
from moe_train.utils.safe_load import load_tensors, read_json_object, require_file, save_tensors
from moe_train.utils.tensor_source import TensorSource, safetensors_source
from moe_train.utils.tensor_store import TensorStoreWriter, index_path, open_store

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_MANIFEST = "manifest.json"
"""The data manifest every export holds (vocabulary, languages, domains, corpora)."""
LEGACY_EXPORT_WEIGHTS = "model.pt"
"""Weights file of exports written before safetensors (read with weights_only)."""
EXPORT_FORMAT = "moe_train-export-1"
EXPORT_STORE = "model"
"""The tensor store of a streamed export (`export_streamed`)."""


@dataclass
class InferenceModel:
    """Everything translation needs."""

    model: torch.nn.Module
    vocab: Vocab | HFTokenizer
    cfg: ExperimentConfig
    manifest: dict[str, Any]
    source: Path


def export_inference(out_dir: str | Path, state_dict: dict[str, torch.Tensor],
                     cfg: ExperimentConfig, manifest: dict[str, Any],
                     tokenizer: Path | Sequence[Path],
                     extra_json: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write model.safetensors (fp32 weights), config.json, manifest.json, the tokenizer
    file(s) (spm.model, or a Hugging Face tokenizer.json + tokenizer_config.json) and any
    `extra_json` files ({file name: JSON object}) atomically."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        weights = {k: v.detach().float() if v.is_floating_point() else v.detach()
                   for k, v in state_dict.items()}
        save_tensors(tmp / EXPORT_WEIGHTS, weights, metadata={"format": EXPORT_FORMAT})
        _write_export_files(tmp, cfg, manifest, tokenizer, extra_json)
    return out_dir


def export_streamed(out_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor | None]],
                    cfg: ExperimentConfig, manifest: dict[str, Any],
                    tokenizer: Path | Sequence[Path], active: bool = True,
                    extra_json: dict[str, dict[str, Any]] | None = None) -> Path | None:
    """An export written tensor by tensor, for models no process holds whole: the weights as
    the tensor store ``model`` (model.index.json + 1 GiB safetensors shards, fp32), the rest
    (`extra_json` too) as `export_inference`. Iterating `tensors` may be collective (ZeRO-3
    gathers): every rank iterates it to the end; only the `active` one writes."""
    if not active:
        for _ in tensors:
            pass
        return None
    out_dir = Path(out_dir)
    remaining = iter(tensors)
    try:
        with atomic_dir(out_dir, overwrite=True) as tmp:
            writer = TensorStoreWriter(tmp, EXPORT_STORE)
            for name, t in remaining:
                writer.add(name, t.float() if t.is_floating_point() else t)
            writer.close({"format": EXPORT_FORMAT})
            _write_export_files(tmp, cfg, manifest, tokenizer, extra_json)
    except Exception:
        # a failed write (a full disk): the other ranks are still in the gathers, so take
        # part in them to the end, then fail (their agreement after the export says why)
        for _ in remaining:
            pass
        raise
    return out_dir


def _write_export_files(tmp: Path, cfg: ExperimentConfig, manifest: dict[str, Any],
                        tokenizer: Path | Sequence[Path],
                        extra_json: dict[str, dict[str, Any]] | None = None) -> None:
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for path in [tokenizer] if isinstance(tokenizer, Path) else tokenizer:
        shutil.copyfile(path, tmp / Path(path).name)
    for name, obj in (extra_json or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def export_weights_file(export_dir: str | Path) -> Path:
    """The weights of an export: model.safetensors, the index of a streamed export's tensor
    store (model.index.json), else a legacy model.pt."""
    export_dir = Path(export_dir)
    for path in (export_dir / EXPORT_WEIGHTS, index_path(export_dir, EXPORT_STORE),
                 export_dir / LEGACY_EXPORT_WEIGHTS):
        if path.is_file():
            return path
    raise CheckpointError(f"{export_dir / EXPORT_WEIGHTS}: missing; expected the export's weights "
                          f"({EXPORT_WEIGHTS}, {EXPORT_STORE}.index.json of a streamed export, "
                          f"or {LEGACY_EXPORT_WEIGHTS} of older exports)")


def export_source(export_dir: str | Path) -> TensorSource:
    """The weights of an export, read one tensor at a time where the format allows."""
    path = export_weights_file(export_dir)
    if path.name == EXPORT_WEIGHTS:
        return safetensors_source([path])
    if path == index_path(Path(export_dir), EXPORT_STORE):
        return open_store(Path(export_dir), EXPORT_STORE)[0]
    return TensorSource.from_dict(load_tensors(path, "weights file (name -> tensor)"), path)


def load_export_weights(export_dir: str | Path) -> dict[str, torch.Tensor]:
    """{name: tensor} of an export directory (safetensors, a tensor store, or legacy model.pt
    weights_only)."""
    return export_source(export_dir).materialize()


def _resolve(path: Path) -> tuple[str, Path]:
    if any((path / name).is_file()
           for name in (EXPORT_WEIGHTS, LEGACY_EXPORT_WEIGHTS, "config.json")):
        return "export", path
    if (path / "meta.json").is_file():  # a step named directly: checked as `latest` would be
        why = verify_files(path)
        if why is not None:
            raise CheckpointError(f"{path}: not a complete checkpoint ({why}); expected a step "
                                  "whose save finished")
        return "step", path
    if path.is_dir():
        tag = latest_tag(path)
        if tag is not None:
            return "step", path / tag
    if not path.exists():
        raise CheckpointError(f"{path}: not found; expected an export or checkpoint directory")
    raise CheckpointError(f"{path}: not an export directory ({EXPORT_WEIGHTS} + config.json), "
                          "a checkpoint directory (latest) or a step directory (meta.json)")


def _export_parts(where: Path) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(config dict, manifest, weights file) of an export, each file checked before use."""
    cfg_dict = read_json_object(where / "config.json", "the exported model config (JSON object)")
    manifest = read_json_object(where / "manifest.json", "the export's data manifest (JSON)")
    return cfg_dict, manifest, export_weights_file(where)


def _check_manifest(manifest: dict[str, Any], source: Path) -> None:
    """The manifest fields translation reads have the types `prepare` writes (one line naming
    the field otherwise, not a KeyError deep in decoding)."""
    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{source}: field {key!r} is {_short(manifest.get(key))}; "
                               f"expected {expected}")

    for key in ("vocab_size", "pad_id"):
        value = manifest.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(key, "a non-negative integer")
    if manifest["pad_id"] >= manifest["vocab_size"]:
        raise bad("pad_id", f"an id below vocab_size ({manifest['vocab_size']})")
    names: dict[str, list[str]] = {}
    for key in ("langs", "domains"):
        value = manifest.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "a list of names")
        names[key] = value
    corpora = manifest.get("corpora", [])
    if not isinstance(corpora, list):
        raise bad("corpora", "a list of corpus entries")
    for c in corpora:
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in (
                "src_lang", "tgt_lang", "domain")):
            raise bad("corpora", "entries with src_lang, tgt_lang and domain names")
        if c["src_lang"] not in names["langs"] or c["tgt_lang"] not in names["langs"]:
            raise bad("langs", f"every corpus language ({c['src_lang']}, {c['tgt_lang']})")
        if c["domain"] not in names["domains"]:
            raise bad("domains", f"every corpus domain ({c['domain']})")
    spm = manifest.get("spm_model", "spm.model")
    if not isinstance(spm, str) or not spm or Path(spm).name != spm:
        raise bad("spm_model", "a file name beside manifest.json")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Same names and shapes as the model built from the config (on any device, the meta one
    included), and floating-point values where the model has them (an integer or boolean
    tensor would be cast silently into nonsense weights); else one line naming them."""
    check_shapes(model_shapes(model), {k: tuple(v.shape) for k, v in state.items()}, source)
    own = model.state_dict(keep_vars=True)
    cast = [f"{k} {v.dtype}" for k, v in state.items()
            if own[k].is_floating_point() and not v.is_floating_point()]
    if cast:
        raise CheckpointError(f"{source}: {len(cast)} weights are not floating-point "
                              f"({', '.join(cast[:3])}); expected the float weights of an export")


def checkpoint_dir(path: str | Path) -> Path:
    """The export or step directory a checkpoint path stands for (nothing is read)."""
    return _resolve(Path(path))[1]


def read_parts(path: str | Path) -> tuple[str, Path, ExperimentConfig, dict[str, Any], Path]:
    """(kind, directory, config, manifest, weights file or step dir) of a checkpoint path, every
    file checked before use; no weights are read."""
    kind, where = _resolve(Path(path))
    if kind == "export":
        cfg_dict, manifest, weights = _export_parts(where)
        cfg_file = where / "config.json"
    else:
        meta = read_meta(where)
        cfg_dict, weights = meta["config"], where
        manifest = read_json_object(where / "manifest.json", "the checkpoint's data manifest")
        cfg_file = where / "meta.json"
    _check_manifest(manifest, where / "manifest.json")
    try:
        cfg = config_from_dict(cfg_dict)
    except MoeTrainError as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from None
    return kind, where, cfg, manifest, weights


def read_config(path: str | Path) -> tuple[ExperimentConfig, dict[str, Any]]:
    """(config, data manifest) of an export or checkpoint directory, without its weights."""
    _, _, cfg, manifest, _ = read_parts(path)
    return cfg, manifest


def load_for_inference(path: str | Path, device: torch.device | str = "cpu") -> InferenceModel:
    """Load a model for translation, in eval mode, on `device`."""
    kind, where, cfg, manifest, weights = read_parts(path)
    vocab = _load_vocab(where, manifest)
    if len(vocab) > manifest["vocab_size"]:
        raise CheckpointError(f"{where}: its tokenizer has {len(vocab)} entries but the model "
                              f"{manifest['vocab_size']} (manifest vocab_size); expected the "
                              "tokenizer it was trained with")
    state = load_export_weights(where) if kind == "export" else consolidated_state_dict(where)
    check_weights(shape_model(cfg, manifest), state, weights)  # before any memory is given
    with skip_init():  # every parameter is loaded next
        model = build_model(cfg, manifest)
    model.load_state_dict(state, strict=True)
    model.to(device).eval()
    return InferenceModel(model=model, vocab=vocab, cfg=cfg, manifest=manifest, source=where)


def _load_vocab(where: Path, manifest: dict[str, Any]) -> Vocab | HFTokenizer:
    """The tokenizer of an export or checkpoint (`open_tokenizer`: its sentencepiece model, or
    the Hugging Face tokenizer files its manifest names); a bad file is a one-line
    CheckpointError."""
    spm = where / manifest.get("spm_model", "spm.model")
    if manifest.get("tokenizer") != HFTokenizer.kind:
        require_file(spm, "the sentencepiece model of the data")
    try:
        return open_tokenizer(where, manifest)
    except CheckpointError:
        raise
    except MoeTrainError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001  (sentencepiece raises RuntimeError / OSError)
        text = str(exc).strip()
        raise CheckpointError(f"{spm}: not a readable sentencepiece model ({type(exc).__name__}: "
                              f"{text.splitlines()[0] if text else 'no message'})") from None
