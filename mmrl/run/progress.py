"""Training progress for a person watching: a rich bar on a terminal, plain lines in a log.

While stdout is not a terminal (a job log, `nohup`, `docker logs`) rich draws nothing until the run
ends, so there each step and each validation is one plain line instead.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# What a plain step line shows when the step has it: metric, label, format.
STEP_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:.4f}"),
    ("actor/kl_loss", "kl", "{:.4f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "length", "{:.1f}"),
)


class TrainingProgress:
    """Shows steps `done + 1 .. total` as they finish; `enabled=False` shows nothing."""

    def __init__(self, console: Console, total: int, done: int, enabled: bool) -> None:
        self.console = console
        self.total = total
        self.first = done  # steps before this process started (a resume) do not count towards the ETA
        self.plain = enabled and not (console.is_terminal or console.is_jupyter)
        self.bar = _bar(console) if enabled and not self.plain else None
        self.task = None
        self.started = self.last = time.monotonic()

    def __enter__(self) -> TrainingProgress:
        self.started = self.last = time.monotonic()
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("training", total=self.total, completed=self.first, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """After each step (its validation included, when it had one)."""
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=_bar_info(metrics))
        elif self.plain:
            self.validated(step, metrics)
            self._line(self._step_line(step, metrics))

    def validated(self, step: int, metrics: dict[str, Any]) -> None:
        """A line for a validation; on a terminal the bar shows its accuracy instead."""
        if self.plain and "val/accuracy" in metrics:
            line = f"validation at step {step}: accuracy {_number(metrics['val/accuracy'], '{:.3f}')}"
            if "val/mean" in metrics:
                line += f"  reward {_number(metrics['val/mean'], '{:.3f}')}"
            self._line(line)

    def _step_line(self, step: int, metrics: dict[str, Any]) -> str:
        now = time.monotonic()
        took, self.last = now - self.last, now
        per_step = (now - self.started) / max(1, step - self.first)
        fields = [
            f"{label} {_number(metrics[key], fmt)}" for key, label, fmt in STEP_FIELDS if key in metrics
        ]
        eta = timedelta(seconds=round(per_step * (self.total - step)))
        return f"step {step}/{self.total}  {'  '.join(fields)}  {took:.1f} s/step  ETA {eta}"

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def _bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def _bar_info(metrics: dict[str, Any]) -> str:
    text = f"reward {metrics.get('reward/mean', float('nan')):.3f}"
    if "val/accuracy" in metrics:
        text += f"  val acc {metrics['val/accuracy']:.3f}"
    return text


def _number(value: Any, fmt: str) -> str:
    """A metric as the line shows it; a NaN or a non-number is printed as it is."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, (int, float)) and math.isfinite(value):
        return fmt.format(value)
    return str(value)
