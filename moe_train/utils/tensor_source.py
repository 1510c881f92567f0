"""Named tensors read one at a time: names and shapes up front, values on demand.

Loading a model of tens of billions of parameters must never hold all its weights at once: a
`TensorSource` knows every tensor's name and shape without reading data (safetensors headers),
and reads a tensor only when asked. Renaming and re-layouts (Hugging Face -> ours) compose as
lazy plans (`TensorSource.from_plan`), so they too read one tensor at a time. Files are read
with safetensors only; a bad file is a one-line `CheckpointError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from torch import Tensor

from moe_train.errors import CheckpointError, MoeTrainError
from moe_train.utils.safe_load import unreadable

Shape = tuple[int, ...]
WHAT = "weights file (name -> tensor)"


@dataclass
class TensorSource:
    """Named tensors of `where`: `shapes` of all, `read(name)` one value (a new tensor)."""

    shapes: dict[str, Shape]
    read: Callable[[str], Tensor]
    where: str

    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str) -> Tensor:
        """The tensor `name`, checked to have its announced shape."""
        if name not in self.shapes:
            raise CheckpointError(f"{self.where}: no tensor {name}")
        value = self.read(name)
        if tuple(value.shape) != self.shapes[name]:
            raise CheckpointError(f"{self.where}: {name} has shape {tuple(value.shape)}; its "
                                  f"header says {self.shapes[name]}")
        return value

    def materialize(self) -> dict[str, Tensor]:
        """All tensors at once (for models small enough to hold whole)."""
        return {name: self.get(name) for name in self.shapes}

    @classmethod
    def from_dict(cls, state: dict[str, Tensor], where: str | Path) -> TensorSource:
        return cls({k: tuple(v.shape) for k, v in state.items()}, state.__getitem__, str(where))

    @classmethod
    def from_plan(cls, plan: dict[str, tuple[Shape, Callable[[], Tensor]]],
                  where: str | Path) -> TensorSource:
        """A source whose tensor `name` is ``plan[name][1]()`` of shape ``plan[name][0]``."""
        return cls({k: tuple(shape) for k, (shape, _) in plan.items()},
                   lambda name: plan[name][1](), str(where))


def safetensors_source(paths: Sequence[Path]) -> TensorSource:
    """The tensors of one or more safetensors files (shards), read lazily; a name in two files
    or an unreadable file is a one-line CheckpointError."""
    from safetensors import safe_open

    home: dict[str, Path] = {}
    shapes: dict[str, Shape] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in home:
                        raise CheckpointError(f"{path}: tensor {key} is also in {home[key]}; "
                                              "expected each tensor in one shard")
                    home[key] = path
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except MoeTrainError:
            raise
        except Exception as exc:  # noqa: BLE001  (SafetensorError, OSError)
            raise unreadable(path, WHAT, exc) from None

    def read(name: str) -> Tensor:
        path = home[name]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise unreadable(path, WHAT, exc) from None

    where = str(paths[0].parent if len(paths) > 1 else paths[0])
    return TensorSource(shapes, read, where)
