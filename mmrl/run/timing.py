"""Wall time per phase of a training step, reported with throughput and host memory."""

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

from mmrl.run.logger import peak_rss_gb


class PhaseTimer:
    """Seconds per phase (`with timer("rollout"): ...`), added up when a phase repeats, as timing/<phase>."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self, tokens: int, release_heap: bool = False) -> dict[str, float]:
        """The step's timings, throughput and host memory; `release_heap` first hands freed heap pages
        back to the OS (`release_freed_memory`), so that the memory reported is what is held."""
        total = time.perf_counter() - self.start
        out = {f"timing/{k}": v for k, v in self.phases.items()}
        out["timing/step"] = total
        out["throughput/tokens_per_s"] = tokens / total
        out["memory/peak_rss_gb"] = peak_rss_gb()
        if release_heap:
            release_freed_memory()
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


# Steps between two `release_freed_memory` calls: each costs the next step the page faults of re-taking
# its memory (+15% on one VLA update, +3% on its step, 2026-12-03), so it runs on one step in ten.
HEAP_RELEASE_EVERY = 10


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
