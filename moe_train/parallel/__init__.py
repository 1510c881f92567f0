"""The only package that touches torch.distributed and DeepSpeed process groups."""

from moe_train.parallel.runtime import ParallelRuntime, init_runtime, shutdown

__all__ = ["ParallelRuntime", "init_runtime", "shutdown"]
