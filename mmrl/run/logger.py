"""Where metrics go: metrics.jsonl (the source of truth), TensorBoard, the console and a plot."""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import math
import resource
from pathlib import Path
from typing import Any

from rich.console import Console

from mmrl.errors import ConfigError, RunStopped

# Hosted trackers, used when listed in `trainer.loggers`; each is an optional install.
TRACKERS = ("wandb", "swanlab")
# What a write fails with when the disk, or the user's quota on it, is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class MetricsLogger:
    """Appends one JSON object per step to metrics.jsonl and, if asked, TensorBoard, wandb or swanlab. A
    resumed run first drops what the interrupted run logged after its checkpoint (`resume_at`), so no
    step appears twice; the trackers continue the same run (its id is kept in the run folder)."""

    def __init__(
        self,
        run_dir: Path,
        backends: list[str],
        console: Console | None = None,
        name: str = "mmrl",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.backends = set(backends)
        self.console = console or Console()
        self.jsonl = run_dir / "metrics.jsonl"
        self.writer = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.trackers = [
            _start_tracker(kind, run_dir, name, config or {}) for kind in TRACKERS if kind in self.backends
        ]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if "jsonl" in self.backends:
            self._append(step, json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.trackers:
            scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            for tracker in self.trackers:
                tracker.log(scalars, step=step)

    def _append(self, step: int, line: str) -> None:
        """One line of metrics.jsonl. A full disk stops the run here, before the step's checkpoint: a
        checkpoint whose step is missing from the log would leave a hole that a resume cannot fill."""
        try:
            with self.jsonl.open("a") as fh:
                fh.write(line)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise RunStopped(
                f"step {step}: could not write {self.jsonl}: no space left on the device. The checkpoints in "
                f"{self.run_dir / 'checkpoints'} are intact; free some space, then run the same command with "
                "--resume (the steps after the newest checkpoint are redone)"
            ) from None

    def resume_at(self, step: int) -> None:
        """Continue after checkpoint `step`: TensorBoard discards the interrupted run's later events.
        (metrics.jsonl is trimmed by the trainer before this.)"""
        if self.writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=step + 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish()


def _start_tracker(kind: str, run_dir: Path, name: str, config: dict[str, Any]) -> Any:
    """Open (or, after a resume, reopen) the run in wandb or swanlab; the module is the tracker."""
    try:
        module = importlib.import_module(kind)
    except ImportError:
        raise ConfigError(
            f"trainer.loggers includes {kind}, which is not installed: pip install {kind} (then log in, or run "
            f"offline), or remove {kind} from trainer.loggers"
        ) from None
    id_file = run_dir / f"{kind}_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else None
    if kind == "wandb":
        run = module.init(
            project="mmrl", name=name, dir=str(run_dir), config=config, id=run_id, resume="allow"
        )
    else:
        run = module.init(
            project="mmrl",
            experiment_name=name,
            logdir=str(run_dir / "swanlab"),
            config=config,
            id=run_id,
            resume="allow",
        )
    new_id = getattr(run, "id", None)
    if new_id and not run_id:
        id_file.write_text(str(new_id))
    return module


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def peak_rss_gb() -> float:
    """This process's peak resident set size in GiB.

    Reads VmHWM, the high-water mark of this process's own address space. `ru_maxrss` is not
    used: Linux carries it across fork+exec, so a child started by a parent that had already
    imported torch would report at least the parent's peak.
    """
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list of records; a resumed run's repeated steps keep the newest."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def plot_reward_curve(metrics_path: Path, out: Path, title: str = "") -> Path:
    """reward_curve.png: training reward per step and validation accuracy where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    train = [(r["step"], r["reward/mean"]) for r in records if isinstance(r.get("reward/mean"), (int, float))]
    val = [(r["step"], r["val/accuracy"]) for r in records if isinstance(r.get("val/accuracy"), (int, float))]
    if train:
        ax.plot(*zip(*train, strict=True), label="train reward (mean)", color="#1f77b4", alpha=0.8)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation accuracy", color="#d62728")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
