"""Wall time per phase of a training step, reported with throughput, host memory and, on a GPU, the most
GPU memory each phase held."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mmrl.run.logger import peak_rss_gb


class PhaseTimer:
    """Seconds per phase (`with timer("rollout"): ...`), added up when a phase repeats, as timing/<phase>;
    where this process computes on a GPU, the phase's peak of allocated GPU memory as
    memory/gpu_peak_gib/<phase> (what `mmrl plan` predicts, minus the CUDA context)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.gpu_peaks: dict[str, float] = {}
        self.depth = 0  # a phase inside another keeps the outer one's peak (no reset)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        if gpu and not self.depth:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0
        if gpu:
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.gpu_peaks[phase] = max(self.gpu_peaks.get(phase, 0.0), peak)

    def metrics(self, tokens: int, heap: HeapRelease | None = None) -> dict[str, float]:
        """The step's timings, throughput and host memory; with `heap`, freed heap pages first go back to
        the OS when enough have piled up (`HeapRelease`), so that the memory reported is what is held."""
        total = time.perf_counter() - self.start
        out = {f"timing/{k}": v for k, v in self.phases.items()}
        out.update({f"memory/gpu_peak_gib/{k}": v for k, v in self.gpu_peaks.items()})
        out["timing/step"] = total
        out["throughput/tokens_per_s"] = tokens / total
        out["memory/peak_rss_gb"] = peak_rss_gb()
        if heap is not None:
            out["memory/heap_released"] = float(heap.after_step())
        if (rss := current_rss_gb()) is not None:
            out["memory/rss_gb"] = rss
        return out


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (its `malloc_trim`), else None."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    return None


class HeapRelease:
    """Hands freed heap pages back to the OS (`release_freed_memory`) after any step that leaves the
    resident size `HEAP_SLACK` past what the last release left.

    A step frees tensors of sizes that change with its batch, and glibc keeps the freed pages for reuse;
    between releases they pile up, in a heap that fragments a little more with each new mix of sizes.
    Released every 10th step, a VLA run's trainer held a flat 1.17-1.23 GiB after each release over 300
    steps, yet the tops in between rose 1.95 -> 2.28 GiB (`bench/soak.py`, docs/benchmarks.md). Each
    release costs the next step the page faults of taking its memory back (+15% on one VLA update), so it
    runs only when the pile is worth it: the peak stays within the slack of what is held."""

    def __init__(self, slack: float = 0.2, floor_gb: float = 0.25) -> None:
        self.slack, self.floor_gb = slack, floor_gb
        self.held: float | None = None

    def after_step(self) -> bool:
        """Release if the pile is past the slack (always after the first step); whether it did."""
        rss = current_rss_gb()
        if rss is None or (
            self.held is not None and rss <= self.held + max(self.floor_gb, self.slack * self.held)
        ):
            return False
        release_freed_memory()
        self.held = current_rss_gb()
        return True


def release_freed_memory() -> None:
    """Hand the heap pages freed during training back to the OS (glibc's `malloc_trim`). A step frees
    tensors of sizes that change with its batch, and glibc keeps the freed pages for reuse, so without
    this the resident size drifts up with each new mix of sizes though nothing is held (`bench/soak.py`:
    a VLA run's trainer 1.70 -> 2.11 GiB over steps 30-300; trimmed after every step, 1.01-1.07 GiB)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def current_rss_gb() -> float | None:
    """This process's resident set size now, in GiB (None without /proc). The peak cannot show a
    slow leak once an early step has set it; the current size grows with one."""
    with contextlib.suppress(OSError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    return None
