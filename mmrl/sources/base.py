"""Rollout sources: where a training step's scored trajectories come from.

The trainer's loop is the same for every kind of run; what differs is its source. Single-turn prompts
(`mmrl.sources.prompts.PromptSource`) and simulator episodes (`mmrl.sources.episodes.EpisodeSource`) each
generate through the loop's engine, score, and say how their trajectories turn into advantages, which
rows an optimizer step takes, how they are validated and what of theirs a checkpoint keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmrl.data.batch import Batch
from mmrl.errors import ConfigError
from mmrl.rollout.base import RolloutEngine
from mmrl.run.timing import PhaseTimer
from mmrl.training.optim import UpdatePlan


@dataclass
class StepContext:
    """What a source is handed by the loop for one call: the engine to generate with, the step, the
    timer of the step's phases, and `guard(what)`, a context in which an engine failure stops the run
    naming the step and what it was doing."""

    engine: RolloutEngine
    step: int
    timer: PhaseTimer
    guard: Callable[[str], AbstractContextManager[None]]


class RolloutSource:
    """One kind of run's trajectories, as the training loop consumes them. A source implements
    `rollouts`, `advantages` and `update_plan`; the rest have defaults for a source without held-out
    data, warm-up or state of its own."""

    validates: bool = False  # whether `validate` has anything to measure

    def rollouts(self, ctx: StepContext) -> tuple[Batch, dict[str, Any]]:
        """The step's scored trajectories (`scores` set) and their metrics."""
        raise NotImplementedError

    def advantages(
        self, batch: Batch, metrics: dict[str, Any], ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages and returns [rows, response tokens] from the scored batch."""
        raise NotImplementedError

    def update_plan(self, batch: Batch) -> UpdatePlan:
        """How the batch's rows become optimizer steps (π_old is scored when there is more than one)."""
        raise NotImplementedError

    def metrics(self, batch: Batch) -> dict[str, Any]:
        """Where the source stands after the step's rollouts (data cursor, skips, env restarts)."""
        return {}

    def validate(self, ctx: StepContext) -> dict[str, Any]:
        """Held-out metrics (`val/accuracy` among them), with the gallery or media they write."""
        return {}

    def warmup(self, model: Any, tokenizer: Any, seed: int) -> list[float]:
        """The format warm-up (`warmup.steps`) on the source's own prompts; its losses."""
        raise ConfigError(f"{type(self).__name__} has no format warm-up; set warmup.steps=0")

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to resume exactly (small, JSON-able values)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state()`."""

    def save_files(self, model_folder: Path) -> None:
        """Files a checkpoint's model folder needs besides the weights (an action tokenizer)."""

    def close(self) -> None:
        """Stop the source's workers (prefetching, rewards, simulators)."""
