"""What a resumed run may change in its config, and the record of every config a run has used.

A resume promises the run that was never stopped: the same data in the same order, from the state the
checkpoint holds. Options that decide which rows are drawn and how (data, batch size, group size, seed)
or what the checkpoint's state is (model, warm-up, estimator, env) cannot change without breaking that,
so a change to them is refused. The rest only steer the steps still to come (learning rate, length,
logging, save and validation cadence, loss settings) and are applied. `config.yaml` holds the config
in use; `config_history/from_step_N.yaml` keeps the one each part of the run started with.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from mmrl.config import Config, dump_config, load_config
from mmrl.errors import CheckpointError, ConfigError
from mmrl.run import checkpoint as ckpt

FIXED = ("model", "data", "rollout.n", "trainer.seed", "warmup", "algorithm.adv_estimator", "env")
# Within FIXED, these touch neither the training data nor the checkpoint's state.
FREE = (
    "model.gradient_checkpointing",
    "data.val_files",
    "data.val_batch_size",
    "data.max_val_samples",
    "env.val_episodes",
    "env.val_seed",
    "env.media_episodes",
    "env.num_workers",
    "env.timeout_s",
    "env.max_restarts",
)
HISTORY = "config_history"
CONFIG = "config.yaml"
log = logging.getLogger("mmrl.run.resume")


def check_resume(run_dir: Path, cfg: Config, newest: Path | None) -> tuple[int, str]:
    """The step a resume from checkpoint `newest` starts at (0 without one) and a note naming the
    changes applied.

    The config to compare with is the one that wrote the checkpoint (its own `config.yaml`), else the
    run's record (`config.yaml`, then `config_history/`). Raises ConfigError for a change that breaks the
    resume's exactness, listing each with how to go on; when no record can be read, since then no change
    can be checked; and for a `trainer.total_steps` the run has already passed."""
    if newest is None:
        return 0, ""
    step = int(newest.name.removeprefix("step_"))
    before = _recorded_config(run_dir, newest)
    changes = _changes(_flat(before.model_dump(mode="json")), _flat(cfg.model_dump(mode="json")))
    fixed = {key: change for key, change in changes.items() if _fixed(key)}
    if fixed:
        raise ConfigError(
            f"--resume: {_listed(fixed)} differ from the config {run_dir} was trained with; a resumed run "
            "would no longer see the same data in the same order from the checkpoint's state. "
            "Set them back to continue this run, or start a new run with another trainer.output_dir."
        )
    if cfg.trainer.total_steps < step:
        raise ConfigError(
            f"--resume: trainer.total_steps={cfg.trainer.total_steps} is below step {step}, where the "
            f"newest checkpoint of {run_dir} already is. Pass a trainer.total_steps above {step} to train "
            f"on, or use the checkpoint as it is ({newest})."
        )
    return step, f"--resume: applying {_listed(changes)}" if changes else ""


def _recorded_config(run_dir: Path, checkpoint: Path) -> Config:
    """The first readable of the checkpoint's own config, the run's `config.yaml` and its history
    (newest first); a record written by an mmrl whose options differ is passed over, and logged."""
    history = sorted((run_dir / HISTORY).glob("from_step_*.yaml"), reverse=True)
    records = [checkpoint / CONFIG, run_dir / CONFIG, *history]
    for record in records:
        if not record.is_file():
            continue
        try:
            return load_config(record)
        except ConfigError as err:
            log.warning("--resume: %s cannot be read to compare with (%s)", record, err)
    raise ConfigError(
        f"--resume: no readable record of the config {run_dir} was trained with "
        f"({', '.join(str(r) for r in records[:2])} and {run_dir / HISTORY} are missing or unreadable), so "
        "nothing this resume changes could be checked. Restore the run's config.yaml, or start a new run "
        "with another trainer.output_dir."
    )


def record_config(run_dir: Path, cfg: Config, step: int) -> None:
    """Write the config this part of the run uses, as `config.yaml` and in the history."""
    text = dump_config(cfg)
    (run_dir / HISTORY).mkdir(parents=True, exist_ok=True)
    (run_dir / HISTORY / f"from_step_{step:08d}.yaml").write_text(text)
    (run_dir / CONFIG).write_text(text)


def _fixed(key: str) -> bool:
    return any(_under(key, rule) for rule in FIXED) and not any(_under(key, rule) for rule in FREE)


def _under(key: str, rule: str) -> bool:
    return key == rule or key.startswith(rule + ".")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values; lists (reward functions, files) are compared whole."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else key))
    return flat


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        key: (old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    }


def _listed(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def resumable_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest whole checkpoint of the run in `run_dir` (checksums verified), after removing writes
    torn by a crash, and a note for each newer one passed over as damaged.

    A run whose checkpoints are all damaged cannot resume, and starting it afresh would delete them as
    it saves: that is refused (CheckpointError), with nothing changed."""
    root = run_dir / "checkpoints"
    ckpt.remove_torn_writes(root)
    damaged: list[tuple[Path, str]] = []
    folders = sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []
    for folder in folders:
        wrong = ckpt.damage(folder)
        if wrong is None:
            return folder, [f"--resume: passing over {f}, which is damaged: {why}" for f, why in damaged]
        log.warning("--resume: passing over %s, which is damaged: %s", folder, wrong)
        damaged.append((folder, wrong))
    if folders:
        newest, why = damaged[0]
        raise CheckpointError(
            f"--resume: none of the {len(folders)} checkpoints in {root} is whole (the newest, {newest.name}: {why}); nothing "
            "was changed. Repair them or move them aside to start afresh here, or start a new run with another "
            "trainer.output_dir."
        )
    return None, []


def refuse_to_overwrite(run_dir: Path) -> None:
    """A fresh run must not mix its metrics and checkpoints with an earlier run's."""
    leftovers = [p for p in (run_dir / "metrics.jsonl", run_dir / "checkpoints") if p.exists()]
    if leftovers:
        raise FileExistsError(
            f"{run_dir} already holds an earlier run ({', '.join(p.name for p in leftovers)}). "
            "Pass --resume to continue it, or set trainer.output_dir / trainer.experiment_name to a new folder."
        )


def truncate_metrics(path: Path, last_step: int | None) -> int:
    """Drop metrics.jsonl records after `last_step` (every record for None); returns how many.

    A run killed after its last checkpoint has logged steps that the resumed run does again;
    kept, they would appear twice. A line torn by the kill goes too. The file is replaced
    atomically, so dying here loses nothing."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            step = None
        if step is not None and last_step is not None and step <= last_step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            fh.writelines(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return dropped
