"""Atomic checkpoints that resume exactly.

A checkpoint is written into a temporary folder, every file is fsynced, a manifest with
each file's size goes in last, and only then is the folder renamed to `step_NNNNNNNN`. A
folder without a manifest that matches its files is torn (the process died mid-write) and is
ignored, so the newest complete checkpoint always wins.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.models import save_model

log = logging.getLogger("mmrl.run.checkpoint")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp_step_"  # + step + writer pid: a checkpoint being written, or torn by a crash


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_devices() -> list[int]:
    """The CUDA devices whose RNG `torch.random.fork_rng` must fork too (none on a CPU)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hf_writer(model: Any, processor: Any) -> Callable[[Path], None]:
    """A checkpoint's `model/` folder as transformers writes it (under LoRA: the adapter, in peft's format)."""

    def write(folder: Path) -> None:
        save_model(model, processor, folder / "model")

    return write


def save_checkpoint(
    root: Path, step: int, write_model: Callable[[Path], Any], state: dict[str, Any], keep: int
) -> Path:
    """Write `root/step_NNNNNNNN` atomically: the model (as `write_model` lays it out in the folder:
    `hf_writer`, or the FSDP workers' shards) plus optimizer/trainer state.

    If writing fails (a full disk, Ctrl-C), the temporary folder is removed before the error goes
    on: it would hold a checkpoint's worth of space and be of no use to anyone. A disk error that
    a writer wrapped in its own exception type is raised as the `OSError` it is."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{TMP_PREFIX}{step:08d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_model(tmp)
        with (tmp / "trainer_state.pt").open("wb") as fh:  # a file object keeps a disk error's errno
            torch.save(state, fh)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        _fsync_tree(tmp)
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}))
        _fsync_tree(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error(err)
        if cause is None or cause is err:
            raise
        raise OSError(cause.errno, cause.strerror, cause.filename or str(tmp)) from err
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_tree(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _os_error(err: BaseException) -> OSError | None:
    """The OS error behind a failed write. torch.save reports a full disk as a RuntimeError whose
    context is the OSError; safetensors as a SafetensorError that only names `os error 28`."""
    link: BaseException | None = err
    while link is not None:
        if isinstance(link, OSError):
            return link
        link = link.__cause__ or link.__context__
    found = re.search(r"os error (\d+)", str(err))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


def is_complete(folder: Path) -> bool:
    """True when the manifest exists and every file it lists has its recorded size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; torn ones are logged and passed over."""
    found = []
    for folder in sorted(root.glob("step_*")):
        if is_complete(folder):
            found.append(folder)
        else:
            log.warning("ignoring torn checkpoint %s (no valid manifest)", folder)
    return found


def remove_torn_writes(root: Path) -> list[Path]:
    """Delete temporary folders left by a process killed mid-save, returning them.

    Only safe when no other process saves into `root`, as when a run is resumed: each holds up to
    a whole checkpoint of disk that nothing would otherwise reclaim."""
    torn = sorted(root.glob(f"{TMP_PREFIX}*")) if root.exists() else []
    for folder in torn:
        log.warning("removing %s, a checkpoint whose writer died before finishing it", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return torn


def latest_checkpoint(root: Path) -> Path | None:
    complete = list_checkpoints(root) if root.exists() else []
    return complete[-1] if complete else None


def load_model_weights(model: Any, folder: Path) -> None:
    """Load `folder/model` weights into `model` in place (the optimizer keeps its parameters).

    The folder is read back with `from_pretrained`, the inverse of the `save_pretrained` that
    wrote it: transformers renames keys on save (Qwen2.5-VL's `model.language_model.*` is
    stored as `model.*`, `model.visual.*` as `visual.*`), so the raw safetensors keys do not
    match `model.state_dict()`. Loading touches no global RNG state.
    """
    source = folder / "model"
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"checkpoint {folder} has no model folder (model/config.json missing)")
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        saved, info = type(model).from_pretrained(source, dtype=dtype, output_loading_info=True)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    absent = set(info.get("missing_keys", ())) - tied
    unfit = [*info.get("unexpected_keys", ()), *info.get("mismatched_keys", ())]
    if absent or unfit:
        raise RuntimeError(
            f"checkpoint {folder} does not fit the model: missing {sorted(absent)}, unexpected {unfit}"
        )
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    del saved
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()


def load_trainer_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "trainer_state.pt", weights_only=False)


def what_is_kept(root: Path, save_every: int) -> str:
    """What a run stopped by a fault leaves to go on from, and how: its newest complete checkpoint and
    `--resume`, or, when none was written, that the run starts over (`--resume` does so in its folder)."""
    newest = latest_checkpoint(root)
    if newest is not None:
        return f"Checkpoints up to {newest.name} are intact in {root}; fix the cause and run again with --resume."
    why = (
        "trainer.save_every is 0"
        if not save_every
        else f"the first save, at step {save_every}, was not reached"
    )
    return (
        f"No checkpoint was written ({why}), so this run starts over: fix the cause and run again with "
        "--resume, which starts afresh in the same folder."
    )


def save_failure(root: Path, step: int, err: OSError) -> str:
    """What went wrong writing a checkpoint, what is still safe, and what to do."""
    cause = "no space left on the device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    newest = latest_checkpoint(root)
    intact = f"the newest complete one, {newest.name}, is intact" if newest else "there is no earlier one"
    return (
        f"step {step}: could not write a checkpoint to {root}: {cause} ({err.filename or err}). "
        f"The partial write was removed; {intact}. Saving needs room for one checkpoint more than "
        "trainer.keep_checkpoints; free space there, then run again with --resume."
    )
