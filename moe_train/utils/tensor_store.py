"""A named-tensor store written one tensor at a time: safetensors shards plus a JSON index.

Checkpoints of models too large for one process (ZeRO-3, expert parallelism) gather each
parameter, its fp32 master value and Adam moments, one at a time; the writer buffers them up to
`max_bytes` and writes a shard, so neither the gathering ranks nor the writing one ever hold the
whole model. ``{stem}.index.json`` names every tensor's shard and carries small JSON metadata;
``{stem}-00001.safetensors`` ... hold the tensors. It reads back as a lazy `TensorSource`.
Shards are written to temporary names and renamed; the index comes last, so a store without its
index is incomplete (the checkpoint's completeness record covers the files anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from moe_train.errors import CheckpointError
from moe_train.utils.atomic import write_json
from moe_train.utils.safe_load import read_json_object, require_file, save_tensors
from moe_train.utils.tensor_source import TensorSource, safetensors_source

STORE_FORMAT = "moe_train-tensor-store-1"
MAX_SHARD_BYTES = 1 << 30
"""The writer's buffer: what the writing rank holds beyond one gathered parameter."""


def index_path(directory: Path, stem: str) -> Path:
    return Path(directory) / f"{stem}.index.json"


class TensorStoreWriter:
    """Buffers tensors and writes shards of at most about `max_bytes` (a larger tensor gets a
    shard of its own). With `active` False (a rank that does not write) it keeps nothing, so
    callers can run the same collective gathers on every rank. For the same reason a shard
    that cannot be written (a full disk) does not stop the caller's loop: the writer keeps
    nothing more and `close` raises that first error, after every gather has run."""

    def __init__(self, directory: Path, stem: str, active: bool = True,
                 max_bytes: int = MAX_SHARD_BYTES) -> None:
        self.directory, self.stem, self.active, self.max_bytes = Path(directory), stem, active, \
            max_bytes
        self.buffer: dict[str, Tensor] = {}
        self.buffered = 0
        self.weight_map: dict[str, str] = {}
        self.shards = 0
        self.error: Exception | None = None
        """The first shard write that failed; `close` raises it."""

    def add(self, name: str, tensor: Tensor) -> None:
        if not self.active or self.error is not None:
            return
        if name in self.weight_map or name in self.buffer:
            raise ValueError(f"tensor {name} added twice")
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + size > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor.detach().cpu().contiguous()
        self.buffered += size

    def _flush(self) -> None:
        if not self.buffer:
            return
        self.shards += 1
        name = f"{self.stem}-{self.shards:05d}.safetensors"
        try:
            save_tensors(self.directory / name, self.buffer, metadata={"format": STORE_FORMAT})
        except Exception as exc:  # noqa: BLE001  (raised by close, once the loop is done)
            self.error = exc
        self.weight_map.update({k: name for k in self.buffer})
        self.buffer, self.buffered = {}, 0

    def close(self, meta: dict[str, Any] | None = None) -> None:
        """Write the last shard and the index (with `meta`, JSON); the first failed shard
        write is raised here."""
        if not self.active:
            return
        if self.error is None:
            self._flush()
        if self.error is not None:
            raise self.error
        write_json(index_path(self.directory, self.stem),
                   {"format": STORE_FORMAT, "meta": meta or {}, "weight_map": self.weight_map})


def has_store(directory: Path, stem: str) -> bool:
    return index_path(directory, stem).is_file()


def open_store(directory: Path, stem: str) -> tuple[TensorSource, dict[str, Any]]:
    """(lazy tensors, metadata) of a store; a bad index is a one-line CheckpointError."""
    index = index_path(directory, stem)
    obj = read_json_object(index, "a tensor store index")
    weight_map, meta = obj.get("weight_map"), obj.get("meta")
    if obj.get("format") != STORE_FORMAT or not isinstance(weight_map, dict) or \
            not isinstance(meta, dict) or not all(isinstance(v, str) and v
                                                  for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected a {STORE_FORMAT} index (format, meta, "
                              "weight_map)")
    files = sorted(set(weight_map.values()))
    if not files:
        return TensorSource({}, lambda name: None, str(index)), meta
    src = safetensors_source([require_file(Path(directory) / name, f"a shard {index.name} "
                                           "names") for name in files])
    if set(src.shapes) != set(weight_map):
        raise CheckpointError(f"{index}: its shards hold {len(src.shapes)} tensors, the index "
                              f"names {len(weight_map)}; expected the same")
    return src, meta
