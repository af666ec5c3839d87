"""The shared memory of vLLM's CPU tensor-parallel engine, kept from outliving the engine.

On the CPU, the ranks of a tensor-parallel group exchange activations through POSIX shared memory,
one segment per rank, named after the group (`...-cpushm_<rank>` under /dev/shm). Under the external
launcher the name is the same in every run, and vLLM unlinks it only when the engine is destroyed, which
never happens when Ray kills a worker. The next engine on that machine then fails at startup with
"create shm in SHMManager failed. errno: 17" (the name exists). So the engine's ranks clear segments
no live process maps before they start, and unlink their own names once every rank has mapped every
segment (vLLM's startup ends with that barrier): the memory lives on until the last rank exits, and no
name is left behind however the process ends.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("mmrl.rollout.vllm")

SHM = Path("/dev/shm")
PATTERN = "*-cpushm_*"


def mapped_segments(pid: str = "self") -> set[Path]:
    """The tensor-parallel segments process `pid` maps (none if it is gone or not ours to read)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    paths = (line.split(maxsplit=5)[-1] for line in maps.splitlines() if "-cpushm_" in line)
    return {Path(path) for path in paths if path.startswith(str(SHM))}


def clear_stale() -> None:
    """Unlink segments that a killed engine left behind: those no running process maps."""
    stale = set(SHM.glob(PATTERN))
    if not stale:
        return
    for pid in Path("/proc").iterdir():
        if pid.name.isdigit():
            stale -= mapped_segments(pid.name)
    for path in sorted(stale):
        try:
            path.unlink(missing_ok=True)
        except OSError as err:  # another user's: their processes' maps are not ours to read
            log.warning(
                "could not remove %s (%s); if vLLM then fails with 'errno: 17', no second CPU tensor-parallel "
                "engine can start on this machine until its owner's engine stops or the file is removed",
                path,
                err.strerror,
            )
        else:
            log.info("removed %s, shared memory a killed vLLM CPU engine left behind", path)


def release_names() -> None:
    """Unlink this process's segments once the engine has started: every rank already maps them."""
    for path in mapped_segments():
        path.unlink(missing_ok=True)
