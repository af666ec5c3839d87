"""Atomic checkpoints that resume exactly.

A checkpoint is written into a temporary folder, every file is fsynced, a manifest with
each file's size and SHA-256 goes in last, and only then is the folder renamed to `step_NNNNNNNN`. A
folder without a manifest that matches its files' sizes is torn (the process died mid-write) and is
ignored, so the newest complete checkpoint always wins. Before a resume loads one, its checksums are
verified too (`damage`): bytes changed in place, which keep a file's size, are found there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.errors import CheckpointError, ConfigError
from mmrl.models import action_head_of, load_head_weights, save_model
from mmrl.models.action_head import ATTRIBUTE

log = logging.getLogger("mmrl.run.checkpoint")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp_step_"  # + step + writer pid: a checkpoint being written, or torn by a crash


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values, so a checkpoint loads with `weights_only=True`."""
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state(state: tuple[Any, ...]) -> dict[str, Any]:
    """numpy's legacy RNG state (a tuple holding a uint32 array) as a tensor and plain values."""
    name, keys, pos, has_gauss, cached_gaussian = state
    return {
        "name": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def rng_devices() -> list[int]:
    """The CUDA devices whose RNG `torch.random.fork_rng` must fork too (none on a CPU)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
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
    _check_plain(state, "trainer state")
    tmp.mkdir()
    try:
        write_model(tmp)
        with (tmp / "trainer_state.pt").open("wb") as fh:  # a file object keeps a disk error's errno
            torch.save(state, fh)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        sums = {name: file_sha256(tmp / name) for name in files}
        _fsync_tree(tmp)
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files, "sha256": sums}))
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


_PLAIN = (torch.Tensor, torch.dtype, torch.device, str, bytes, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Refuse, at save time and naming its key, a value `load_state_file` could not read back: only
    tensors and plain data (dicts, lists and tuples of str, bytes, numbers, None) load with `weights_only=True`."""
    if type(value) in (dict, OrderedDict):  # not subclasses (a Counter): they would not load
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple, torch.Size):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__name__}; a checkpoint holds "
            "tensors and plain data only (convert it to those)"
        )


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None when every file it lists is whole: present, of
    its recorded size and (for checkpoints that record them) its recorded SHA-256. Reads every file."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files, sums = manifest["files"], manifest.get("sha256", {})
        assert isinstance(files, dict) and isinstance(sums, dict)
    except (OSError, ValueError, KeyError, AssertionError):
        return f"its {MANIFEST} is missing or unreadable"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, not the {size} written"
        if name in sums and file_sha256(path) != sums[name]:
            return f"{name} has changed since it was written (its SHA-256 differs)"
    return None


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
    head = action_head_of(model)  # a continuous-action policy's head: saved beside the backbone
    if head is not None:
        load_head_weights(head, source)
        missing = [k for k in missing if not k.startswith(f"{ATTRIBUTE}.")]
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()


def load_trainer_state(folder: Path) -> dict[str, Any]:
    return load_state_file(folder / "trainer_state.pt")


def load_state_file(path: Path) -> Any:
    """A checkpoint's state file (trainer state, a schedule), read with `weights_only=True`.

    Tensors and plain data only: unpickling anything else can run code, and a run folder may come
    from someone else. A file that holds other objects (checkpoints of mmrl before 2026-12 pickled
    numpy's RNG state) is refused in one line saying how to convert it, if its source is trusted."""
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete; resume from another"
        ) from None
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = found.group(1) if found else "objects that are not tensors or plain data"
        raise ConfigError(
            f"{path} holds {what}, which mmrl does not load because unpickling it can run code (it was "
            "written by an older mmrl, or not by mmrl). If you trust where the folder came from, convert it "
            f"once with `python -m mmrl.run.checkpoint {path.parent}` and resume again; else start a fresh run"
        ) from None
    except Exception as err:  # a damaged file: torch names the zip reader's failure, not the file
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint's state ({type(err).__name__} from torch.load): it is damaged; "
            "move its checkpoint aside to resume from an earlier one, or start a fresh run"
        ) from None


def convert_trusted(folder: Path) -> None:
    """Rewrite an older checkpoint's trainer state in the form `load_state_file` reads: loads it with
    `weights_only=False`, so only for a folder whose source is trusted (`python -m mmrl.run.checkpoint`)."""
    path = folder / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    numpy = state.get("rng", {}).get("numpy")
    if isinstance(numpy, tuple):
        state["rng"]["numpy"] = _numpy_state(numpy)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][path.name] = path.stat().st_size
    manifest.setdefault("sha256", {})[path.name] = file_sha256(path)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    load_state_file(path)  # anything else unsafe left is named here


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        convert_trusted(Path(name))
        print(f"{name}: trainer state converted; `mmrl train CONFIG --resume` loads it now")


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
