"""Reusable storage for the weight gradients of stacked experts (CPU path).

A backward of the grouped GEMM returns dW_EDF, a whole E x D x F tensor (128 MiB at E=128,
D=256, F=1024, fp32). Allocated afresh every step, glibc maps such a block with mmap and the
kernel faults in and zeroes every page of it: ~33k page faults per weight per step.
`GradBuffers` keeps that storage alive between steps and hands it out again, under one rule:

    a buffer is written only while nothing but this object references its storage.

The backward writes the gradient into such a free buffer and returns a new tensor over the same
storage. Autograd then does what it does with any returned gradient, so hooks on the parameter
(DeepSpeed's ZeRO gradient hooks) run as usual:
- `param.grad` is None: autograd adopts the tensor as `.grad` (no copy). The storage is now
  referenced by `.grad` too, hence not free: while the gradient lives (optimizer step, a kept
  reference, `zero_grad(set_to_none=False)`) it is never overwritten. Once `.grad` is set to
  None the storage is free again and the next backward reuses it: no page faults.
- `param.grad` exists (gradient accumulation): autograd adds the returned tensor into it and
  drops it; its storage is free again for the next step. When `.grad` is itself one of these
  buffers, the other one (`max_per_name` = 2) takes the new gradient.
When no buffer is free (more than `max_per_name` alive), a fresh tensor is returned and not
kept. The storage reference count comes from torch's `_storage_Use_Count`; without it nothing
is ever reused (always a fresh tensor, the plain behaviour).

Shape legend: E experts, D input dim, F output dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_is_free(buf: Tensor) -> bool:
    """True when `buf` is the only tensor on its storage (the storage object made to ask adds
    one reference of its own)."""
    return _use_count is not None and _use_count(buf.untyped_storage()._cdata) == 2


class GradBuffers:
    """Gradient buffers of one module, by name (e.g. "w1_EDF"): `take(name, shape, like)`."""

    def __init__(self, max_per_name: int = 2) -> None:
        self.max_per_name = max_per_name
        self._bufs: dict[str, list[Tensor]] = {}

    def take(self, name: str, shape: Sequence[int], like: Tensor) -> Tensor:
        """An uninitialised contiguous tensor of `shape` with `like`'s dtype and device, on
        storage nobody else holds; the caller fills it and hands it to autograd as a gradient."""
        shape = torch.Size(shape)
        bufs = [b for b in self._bufs.get(name, ())
                if b.shape == shape and b.dtype == like.dtype and b.device == like.device]
        for buf in bufs:
            if _storage_is_free(buf):
                return buf.detach()  # a new tensor (autograd may adopt it) on the same storage
        fresh = torch.empty(shape, dtype=like.dtype, device=like.device)
        if _use_count is not None and len(bufs) < self.max_per_name:
            self._bufs[name] = bufs + [fresh]
            return fresh.detach()
        return fresh

    def clear(self) -> None:
        """Forget every buffer (gradients that still use one keep it alive)."""
        self._bufs.clear()

    def nbytes(self) -> int:
        """Bytes held (including storage that is currently some parameter's `.grad`)."""
        return sum(b.numel() * b.element_size() for bufs in self._bufs.values() for b in bufs)

    def __deepcopy__(self, memo: dict) -> GradBuffers:
        return GradBuffers(self.max_per_name)  # a copied module starts without buffers

    def __getstate__(self) -> dict:
        return {"max_per_name": self.max_per_name, "_bufs": {}}
