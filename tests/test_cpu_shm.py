"""vLLM's CPU tensor-parallel shared memory: what a killed engine leaves goes, what a live one maps stays."""

from __future__ import annotations

import mmap
import sys
import uuid

import pytest

from mmrl.rollout import cpu_shm

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX shared memory under /dev/shm")


def test_stale_segments_are_removed_mapped_ones_kept_and_released_once_mapped() -> None:
    group = f"test-{uuid.uuid4().hex[:8]}-tp:0-[0-1]-cpushm"
    live, stale = (cpu_shm.SHM / f"{group}_{rank}" for rank in (0, 1))
    for path in (live, stale):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    with live.open("r+b") as file, mmap.mmap(file.fileno(), mmap.PAGESIZE):  # a live engine's mapping
        try:
            assert cpu_shm.mapped_segments() == {live}
            cpu_shm.clear_stale()
            assert live.exists(), "a segment a running process maps was removed"
            assert not stale.exists(), "the segment no process maps was left behind"
            cpu_shm.release_names()
            assert not live.exists(), "a mapped segment kept its name after startup"
        finally:
            for path in (live, stale):
                path.unlink(missing_ok=True)
