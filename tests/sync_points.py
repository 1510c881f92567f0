"""Count the points where code run on a GPU would make the host wait for the device.

On CPU nothing waits, but the same calls are there: reading a tensor's value (`.item()`,
`int()`, `float()`, `bool()`), ops whose output size depends on values (nonzero,
masked_select, boolean-mask indexing, unique, bincount, repeat_interleave without
output_size) and copies to the host (`.tolist()`, `.cpu()`, `.numpy()`). `SyncPoints` records
each, attributed to the innermost moe_train frame, so tests can bound them per step.
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_train

_PACKAGE = os.path.dirname(os.path.abspath(moe_train.__file__)) + os.sep
_aten = torch.ops.aten
_SYNC_OPS = {
    _aten._local_scalar_dense.default: "item",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
}
_INDEX_OPS = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
              _aten._index_put_impl_.default)
_HOST_COPIES = ("tolist", "numpy", "cpu")


def _caller() -> str:
    """`moe_train/path.py:line` of the innermost moe_train frame, else `<outside>`."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(_PACKAGE):
            return f"moe_train/{frame.filename[len(_PACKAGE):]}:{frame.lineno}"
    return "<outside>"


class SyncPoints(TorchDispatchMode):
    """``with SyncPoints() as s: ...``; then `s.counts` maps (where, kind) to a count and
    `s.total(outside=False)` sums those in moe_train."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._saved: dict[str, object] = {}

    def _hit(self, kind: str) -> None:
        self.counts[(_caller(), kind)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self._hit(_SYNC_OPS[func])
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._hit("repeat_interleave")
        elif func in _INDEX_OPS and any(i is not None and i.dtype == torch.bool
                                        for i in args[1]):
            self._hit("bool-mask index")
        return func(*args, **kwargs)

    def __enter__(self) -> SyncPoints:
        for name in _HOST_COPIES:  # not dispatched: patched for the block's duration
            original = self._saved[name] = getattr(torch.Tensor, name)

            def copy(tensor, *a, _name=name, _original=original, **k):
                self._hit(_name)  # from the device, on a GPU
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, name, copy)
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def total(self, outside: bool = False) -> int:
        return sum(n for (where, _), n in self.counts.items()
                   if outside or where != "<outside>")

    def where(self) -> list[str]:
        """One line per place, for assertion messages."""
        return [f"{n} x {kind} at {where}" for (where, kind), n in sorted(self.counts.items())]
