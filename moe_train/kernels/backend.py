"""Which implementation of a dispatch op runs: the torch reference or the Triton kernel.

Every op in `moe_train.kernels` takes ``backend="auto" | "torch" | "triton"``. "auto" picks
Triton only for CUDA tensors when Triton imports; "torch" is the reference and the CPU path;
"triton" forces the kernels (tests run them on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
from torch import Tensor

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package imports (it is an optional dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: Tensor, backend: str) -> bool:
    """Resolve `backend` for an op whose main input is `tensor`: True means the Triton path."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' was asked for but triton is not installed")
        if tensor.dtype == torch.float64:  # the kernels compute in fp32 at most
            raise ValueError("backend='triton' takes fp32, bf16 and fp16 tensors, not float64; "
                             "use backend='torch'")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' runs on CUDA tensors, got one on "
                             f"{tensor.device} (TRITON_INTERPRET=1 set before triton is "
                             "imported interprets the kernels on CPU); use backend='torch'")
        return True
    if backend != "auto":
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    return tensor.is_cuda and tensor.dtype != torch.float64 and triton_available()
