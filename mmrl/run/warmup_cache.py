"""Warm-ups kept for the next run that would train the same one (`warmup.cache_dir`).

A warm-up is a pure function of the starting weights, the training rows, the warm-up settings and the
seed, so a second run with the same ones (another algorithm on one recipe, a re-run after changing a
learning rate) can start from the first one's output instead of training it again. The key hashes
everything the warm-up reads: the config sections it depends on, and the contents of the model folder
and the training files (by size and modification time for files over `HASHED_BYTES`, which would take
longer to hash than to miss). A hit is linked (or copied) into the run's folder, so every run folder
still holds the weights it started from and resumes without the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from mmrl.config import Config

HASHED_BYTES = 256 * 2**20
LOSSES = "warmup_losses.json"
_NOT_READ_BY_WARMUP = {"train_files", "val_files", "val_batch_size", "max_val_samples", "train_batch_size"}


def warmup_key(cfg: Config) -> str:
    """A digest of what the warm-up's output depends on; the algorithm, rewards and rollout are not."""
    reads = {
        "model": cfg.model.model_dump(mode="json", exclude={"path"}),
        # the RL steps' batch and what validation reads do not reach the warm-up
        "data": cfg.data.model_dump(mode="json", exclude=_NOT_READ_BY_WARMUP),
        "agent": cfg.agent.model_dump(mode="json") if cfg.agent else None,
        "warmup": cfg.warmup.model_dump(mode="json", exclude={"cache_dir"}),
        "seed": cfg.trainer.seed,
        "device": str(cfg.trainer.torch_device()),
    }
    digest = hashlib.sha256(json.dumps(reads, sort_keys=True).encode())
    for root in [cfg.model.path, *cfg.data.train_files]:
        _add_files(digest, Path(root))
    return digest.hexdigest()[:24]


def _add_files(digest: Any, root: Path) -> None:
    """Every file under `root` (or `root` itself) into `digest`: its relative name and its contents."""
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root) if root.is_dir() else path.name}:{stat.st_size}".encode())
        if stat.st_size > HASHED_BYTES:
            digest.update(str(stat.st_mtime_ns).encode())
            continue
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(2**20), b""):
                digest.update(block)


def restore(cache_dir: str | Path, key: str, target: Path) -> list[float] | None:
    """The cached warm-up `key` linked into `target`, and its losses; None on a miss."""
    entry = Path(cache_dir) / key
    if not (entry / LOSSES).exists():  # written last: an entry without it was never finished
        return None
    shutil.copytree(entry, target, copy_function=_link_or_copy, dirs_exist_ok=True)
    return json.loads((entry / LOSSES).read_text())


def store(cache_dir: str | Path, key: str, model_folder: Path, losses: list[float]) -> None:
    """`model_folder` into the cache as `key`, whole or not at all: a finished entry is renamed into
    place, so a run that dies mid-copy, or another one storing the same key, leaves no torn entry."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{key}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(model_folder, partial, copy_function=_link_or_copy)
    (partial / LOSSES).write_text(json.dumps(losses))
    try:
        partial.rename(cache / key)
    except OSError:  # another run stored the same warm-up first
        shutil.rmtree(partial, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file system allows one (no second copy of the weights), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
