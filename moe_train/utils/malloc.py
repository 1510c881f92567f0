"""CPU allocator tuning: keep glibc from mapping and zeroing large blocks afresh every step.

torch's CPU tensors come from glibc malloc. By default glibc serves every block of 32 MiB or
more (less before its dynamic threshold has grown) with its own mmap and unmaps it on free, and
it returns the free top of its heap to the OS once that exceeds twice the mmap threshold. A
training step allocates and frees the same large blocks (activations, gradients) every time, so
each step the kernel maps those pages again and zeroes them: tens of thousands of minor page
faults per step, a third of a CPU MoE layer's time at 128 experts
(benchmarks/results/moe_layer_cpu.json, `minor_faults_per_step`).

`tune_cpu_allocator` raises the mmap threshold (blocks below it come from the heap and are
reused after a free) and the trim threshold (up to that much free heap is kept for the next
step), once, at start-up. `moe_train.parallel.runtime.init_runtime` calls it on CPU. It does
nothing where the C library is not glibc, and leaves glibc alone where the process was started
with glibc's own malloc settings (`MALLOC_*_` variables or `glibc.malloc` tunables): an
explicit setting by whoever launched the job wins.

Cost: up to `trim_threshold` bytes of freed memory stay with the process instead of going back
to the OS, and blocks below `mmap_threshold` can fragment the heap; neither matters for a
training loop that allocates the same sizes every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from typing import Any

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3

MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from the heap (glibc's default: 128 KiB rising to 32 MiB)."""
TRIM_THRESHOLD = 1 << 30
"""Free heap kept before trimming (glibc's default: twice the dynamic mmap threshold)."""
TOP_PAD = 64 << 20
"""Extra heap requested each time the heap grows (glibc's default: 128 KiB)."""

_GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                     "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")


def _glibc() -> Any | None:
    """The process's C library when it is glibc with `mallopt`, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def malloc_set_by_environment() -> bool:
    """True when the process was started with glibc's own malloc settings."""
    return any(name in os.environ for name in _GLIBC_MALLOC_ENV) \
        or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def tune_cpu_allocator() -> dict[str, Any]:
    """Apply the mallopt settings above (idempotent); returns what was done, for logs and
    benchmark records: ``{"allocator": ..., "applied": bool, ...settings}``."""
    libc = _glibc()
    if libc is None:
        return {"allocator": "not glibc", "applied": False}
    if malloc_set_by_environment():
        return {"allocator": "glibc, settings from the environment kept", "applied": False}
    settings = {"M_MMAP_THRESHOLD": MMAP_THRESHOLD, "M_TRIM_THRESHOLD": TRIM_THRESHOLD,
                "M_TOP_PAD": TOP_PAD}
    params = {"M_MMAP_THRESHOLD": M_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD,
              "M_TOP_PAD": M_TOP_PAD}
    failed = [name for name, value in settings.items() if libc.mallopt(params[name], value) != 1]
    return {"allocator": "glibc, tuned by moe_train.utils.malloc", "applied": not failed,
            **settings, **({"failed": failed} if failed else {})}


def release_free_heap() -> bool:
    """Give the free pages of glibc's heap back to the OS (`malloc_trim(0)`), also those
    between live blocks; whether anything was released (False where the C library is not
    glibc). For one-off phases that free much in a pattern the heap cannot reuse, such as
    building a model partition by partition."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None and hasattr(libc, "malloc_trim") \
        else False
