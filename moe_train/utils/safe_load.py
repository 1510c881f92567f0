"""Loading what the project wrote without running code from it, and saving it that way.

Weights: safetensors (preferred) or ``torch.load(weights_only=True)`` for ``.pt`` files.
scikit-learn models: skops, with an explicit list of trusted types beyond skops' defaults and the
stored scikit-learn version checked. JSON: read with a one-line error. Every bad file (missing,
truncated, garbage, of the wrong kind) is a one-line `CheckpointError` naming the file and what was
expected, never a traceback. Nothing here can run code stored in a file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from moe_train.errors import CheckpointError, MoeTrainError, OutOfMemory, is_out_of_memory
from moe_train.utils.atomic import atomic_path

log = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no message"


def unreadable(path: Path, what: str, exc: BaseException,
                error: type[MoeTrainError] = CheckpointError) -> Exception:
    """The one-line error for `path` failing to load: the machine's when it ran out of memory
    (status 1), else `error` saying the file is not a readable `what` (status 2)."""
    if is_out_of_memory(exc):
        return OutOfMemory(f"{path}: out of memory reading it as {what} "
                           f"({type(exc).__name__}: {_first_line(exc)})")
    return error(f"{path}: not a readable {what} ({type(exc).__name__}: {_first_line(exc)})")


def require_file(path: str | os.PathLike, what: str,
                 error: type[MoeTrainError] = CheckpointError) -> Path:
    """`path` as a Path; a missing file is a one-line error naming it and `what` it should be."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: missing; expected {what}")
    return path


# ------------------------------------------------------------------------------------- JSON
def read_json(path: str | os.PathLike, what: str = "JSON file",
              error: type[MoeTrainError] = CheckpointError) -> Any:
    """Parsed JSON of `path`; missing, non-UTF-8 or malformed files are one-line `error`s."""
    path = require_file(path, what, error)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}); expected {what}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: line {exc.lineno} column {exc.colno}: {exc.msg}; "
                    f"expected {what}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply to read; expected {what}") from None
    except OSError as exc:
        raise unreadable(path, what, exc, error) from None


def read_json_object(path: str | os.PathLike, what: str = "JSON object",
                     error: type[MoeTrainError] = CheckpointError) -> dict[str, Any]:
    """`read_json` that also requires a top-level JSON object."""
    obj = read_json(path, what, error)
    if not isinstance(obj, dict):
        raise error(f"{path}: holds a JSON {type(obj).__name__}; expected {what} (an object)")
    return obj


# ---------------------------------------------------------------------------------- tensors
def load_torch(path: str | os.PathLike, what: str = "torch file",
               safe_globals: Iterable[Any] = (), mmap: bool = False,
               map_location: Any = "cpu") -> Any:
    """``torch.load(path, map_location=map_location, weights_only=True)``, with `safe_globals`
    (extra classes/functions the file may reference) allowed; bad files are one-line
    CheckpointErrors.
    `mmap`: tensors are mapped from the file and read when used (what a caller takes of a
    large file, e.g. the weights beside the optimizer state, is all it reads; a file in
    torch's legacy format, which cannot be mapped, is read whole)."""
    path = require_file(path, what)
    if mmap:
        import zipfile

        mmap = zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001  (torch.load raises many types on bad data)
        if is_out_of_memory(exc):
            raise unreadable(path, what, exc) from None
        text = str(exc)
        refused = re.search(r"(Unsupported global: GLOBAL \S+|unsupported GLOBAL \S+)", text)
        if refused:  # a class or function reference: the file wants to run code
            raise CheckpointError(f"{path}: refused by weights-only loading ({refused.group(1)});"
                                  f" expected {what} of tensors and plain values") from None
        unpickler = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
        if unpickler:  # not a pickle stream torch wrote (garbage, truncated)
            raise CheckpointError(f"{path}: not a readable {what} ({unpickler.group(1).strip()})"
                                  ) from None
        if "Weights only load failed" in text:  # never pass on its advice to unpickle
            raise CheckpointError(f"{path}: refused by weights-only loading; expected {what} "
                                  "of tensors and plain values") from None
        raise unreadable(path, what, exc) from None


def load_tensors(path: str | os.PathLike, what: str = "weights file") -> dict[str, torch.Tensor]:
    """Flat {name: tensor} on CPU from a ``.safetensors`` file (safetensors) or any other file
    (``torch.load`` with weights_only). Bad files are one-line CheckpointErrors naming `path`."""
    path = require_file(path, what)
    if path.suffix == SAFETENSORS_SUFFIX:
        from safetensors.torch import load_file

        try:
            state = load_file(path, device="cpu")
        except Exception as exc:  # noqa: BLE001  (SafetensorError, OSError, ...)
            raise unreadable(path, what, exc) from None
    else:
        state = load_torch(path, what)
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a mapping of tensor "
                              f"names to tensors; expected {what}")
    return state


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU contiguous tensors, none sharing memory with another: safetensors refuses shared or
    partial storage (tied / shared modules appear under several names in a state dict)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and \
            storage.nbytes() == t.numel() * t.element_size()
        if not whole or storage.data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` as safetensors to `path` atomically. Tensors that share memory (tied
    weights) are stored as separate copies; loading them back into a module ties them again."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(_unshared(tensors), str(tmp), metadata=dict(metadata or {}))


# ---------------------------------------------------------------------------------- numpy
def load_array(path: str | os.PathLike, what: str, kind: str, ndim: int,
               rows: int | None = None, error: type[MoeTrainError] = CheckpointError
               ) -> Any:
    """A ``.npy`` array never unpickled, with `ndim` dimensions, `rows` rows when given and
    values of numpy kind `kind` ("f" float, "i" integer: "i" also takes unsigned); anything
    else is one `error` line naming `path`."""
    import numpy as np

    path = require_file(path, what, error)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error) as exc:
        raise unreadable(path, what, exc, error) from None
    kinds = "iu" if kind == "i" else kind
    if not isinstance(array, np.ndarray) or array.ndim != ndim or array.dtype.kind not in kinds \
            or (rows is not None and len(array) != rows):
        shape = getattr(array, "shape", None)
        dtype = getattr(array, "dtype", None)
        raise error(f"{path}: an array of shape {shape} and dtype {dtype}; expected {what} "
                    f"({ndim}-D, {'float' if kind == 'f' else 'integer'}"
                    + (f", {rows} rows)" if rows is not None else ")"))
    return array


def load_arrays(path: str | os.PathLike, what: str, keys: Iterable[str], rows: int,
                error: type[MoeTrainError] = CheckpointError) -> dict[str, Any]:
    """The 1-D integer arrays `keys` of a ``.npz`` file, each of `rows` entries, never
    unpickled; anything else is one `error` line naming `path`."""
    import numpy as np

    path = require_file(path, what, error)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a plain .npy array
            raise error(f"{path}: a single array, not an .npz archive; expected {what}")
        with loaded as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error) as exc:
        raise unreadable(path, what, exc, error) from None
    for key in keys:
        a = arrays.get(key)
        if a is None or a.ndim != 1 or a.dtype.kind not in "iu" or len(a) != rows:
            raise error(f"{path}: {key!r} is {'missing' if a is None else f'{a.dtype} {a.shape}'}"
                        f"; expected {what} with {rows} integers under {key!r}")
    return arrays


# ---------------------------------------------------------------------------- scikit-learn
def dump_skops(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` (dicts, numpy arrays, scikit-learn estimators) with skops, atomically."""
    import skops.io as sio

    with atomic_path(path) as tmp:
        sio.dump(obj, tmp)


def load_skops(path: str | os.PathLike, trusted: Iterable[str], what: str = "skops file") -> Any:
    """Load a skops file, refusing it (CheckpointError) when it holds any type that is neither
    trusted by skops by default (builtins, numpy, scikit-learn estimators) nor in `trusted`
    (full type paths such as ``"collections.OrderedDict"``). No object is built before the check."""
    import skops.io as sio

    path = require_file(path, what)
    trusted = sorted(trusted)
    try:
        untrusted = sio.get_untrusted_types(file=path)
    except Exception as exc:  # noqa: BLE001  (BadZipFile, KeyError, JSON errors, ...)
        raise unreadable(path, what, exc) from None
    refused = sorted(set(untrusted) - set(trusted))
    if refused:
        raise CheckpointError(f"{path}: holds untrusted types {', '.join(refused)}; expected "
                              f"{what} with only skops' default types"
                              + (f" and {', '.join(trusted)}" if trusted else "")
                              + " (refusing to load it)")
    try:
        return sio.load(path, trusted=trusted)
    except Exception as exc:  # noqa: BLE001
        raise unreadable(path, what, exc) from None


def check_sklearn_version(path: str | os.PathLike, saved: Any) -> None:
    """Compare the scikit-learn version stored with a model to the installed one.

    Another major.minor version is a CheckpointError naming both (estimator internals change
    between minor releases: predictions may silently differ); another patch release is logged as
    a warning and accepted (patch releases keep fitted-model attributes).
    """
    import sklearn

    current = sklearn.__version__
    if not isinstance(saved, str):
        raise CheckpointError(f"{path}: no scikit-learn version stored (found {saved!r}); "
                              "expected a file written by this project")
    if saved == current:
        return
    if saved.split(".")[:2] != current.split(".")[:2]:
        raise CheckpointError(f"{path}: written with scikit-learn {saved}, but {current} is "
                              f"installed; install scikit-learn {saved} or re-create the file")
    log.warning("%s: written with scikit-learn %s, loading with %s (same minor release)",
                path, saved, current)
