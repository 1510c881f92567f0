"""Timing and memory helpers shared by the benchmarks: device sync, interleaved step timing,
one step's peak memory, the top ops of a profiled step."""

from __future__ import annotations

import gc
import re
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

Step = Callable[[], dict[str, Any]]
"""One benchmarked step: runs once and returns what it wants reported."""


def sync(device: str) -> None:
    """Wait for queued GPU work, so that a timer stops after it (a no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(steps: dict[str, Step], device: str, warmup: int, reps: int
                     ) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Milliseconds of each step over `reps` rounds that run every step once (order rotated
    each round, so drift hits all alike), after `warmup` runs; and what each step reported,
    with its median minor page faults (fresh pages the kernel had to map and zero)."""
    info = {}
    for name, fn in steps.items():
        for _ in range(warmup):
            info[name] = fn()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(device)
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for name in names:
        info[name]["minor_faults_per_step"] = int(statistics.median(faults[name]))
    return times, info


def _proc_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])


def measure_peak(step: Step, device: str) -> dict[str, int]:
    """Bytes one step (after a warm-up step) adds at its peak above what is resident before it
    (weights and inputs), and the bytes of the gradients it leaves behind. Gradient storage
    kept for reuse between steps (our `Experts.grad_buffers`) is let go before the step, so
    the step allocates its gradients like every other implementation."""
    step()
    leaves = getattr(step, "leaves", [])
    for t in leaves:
        t.grad = None
    step.release()  # type: ignore[attr-defined]
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _proc_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        step()
        peak = (_proc_kib("VmHWM") - before) * 1024
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves
                     if t.grad is not None)
    return {"peak_bytes": peak, "grad_bytes": grad_bytes,
            "peak_minus_grad_bytes": peak - grad_bytes}


def profile_top_ops(step: Step, device: str, top: int = 12) -> list[dict[str, Any]]:
    """The ops of one step with the most self time (CPU; device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    with profile(activities=acts) as prof:
        step()
        sync(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3)}
            for e in rows]
