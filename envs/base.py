"""The environment interface every simulator speaks to the VLA rollout loop.

The loop only needs a rendered frame, an instruction and a success flag, so the interface is the
gymnasium ``reset``/``step`` pair with those three things fixed in the observation and ``info``.
Keeping it this small is what lets external simulators (LIBERO, ManiSkill) plug in as thin adapters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, ClassVar, TypedDict

import numpy as np

__all__ = ["NO_FRAME", "Env", "Info", "Obs", "StepResult"]


class Obs(TypedDict):
    """What the policy sees: an RGB frame, the task in words, and the robot's own state (proprioception)."""

    image: np.ndarray  # H x W x 3, uint8
    instruction: str
    state: np.ndarray  # 1-D float32; each task documents its layout


Info = dict[str, Any]  # always holds "success": bool; tasks add their own diagnostics
StepResult = tuple[Obs, float, bool, bool, Info]  # obs, reward, terminated, truncated, info

# The image of a step taken with ``render=False``: empty, so a frame nobody meant to look at fails loudly.
NO_FRAME = np.zeros((0, 0, 3), np.uint8)


class Env(ABC):
    """A seeded, episodic task whose actions are vectors in [-1, 1]^action_dim.

    Actions are normalised so one action tokenizer (256 bins over [-1, 1]) serves every task; each
    task maps them onto its own physical units.
    """

    action_dim: int
    max_steps: int
    # Moves a language policy names by a word, and the action each stands for; a task that has them can
    # be played turn by turn in a conversation (`agent.game`), not only through action tokens.
    words: ClassVar[dict[str, np.ndarray]] = {}
    # A family's tasks by name (``metaworld/<task>``), checked before any env is built; empty: not listed.
    task_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[Obs, Info]:
        """Start an episode; the same seed must give the same initial frame and state."""

    @abstractmethod
    def step(self, action: np.ndarray, *, render: bool = True) -> StepResult:
        """Apply one action; ``info["success"]`` says whether the task is done right.

        ``render=False`` is for steps whose frame no one sees (inside an action chunk): the observation's
        image is then ``NO_FRAME`` and rendering, most of a simulated step's cost, is skipped."""

    def _checked_action(self, action: np.ndarray, done: bool) -> np.ndarray:
        """``action`` as float64 clipped to [-1, 1], or the error a caller needs: stepping an ended
        episode, a wrong shape, a non-finite value. Tasks call it first thing in ``step``."""
        if done:
            raise RuntimeError("the episode has ended (or never started): call reset() before step()")
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (self.action_dim,):
            raise ValueError(f"action must have shape ({self.action_dim},), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"action must be finite, got {a}")
        return np.clip(a, -1.0, 1.0)

    def _outcome(
        self,
        success: bool,
        failure: str | None,
        distance: float,
        last_distance: float,
        shaping: float,
        steps: int,
    ) -> tuple[float, bool, bool, Info]:
        """Reward, terminated, truncated and info of a step, as the built-in tasks score it: 1 on the step
        that succeeds plus ``shaping`` times the decrease in distance to the goal; success or a failure
        reason ends the episode, ``max_steps`` truncates it."""
        reward = float(success) + shaping * (last_distance - distance)
        terminated = success or failure is not None
        truncated = not terminated and steps >= self.max_steps
        info: Info = {"success": success, "distance": float(distance)}
        if failure is not None:
            info["failure"] = failure
        return reward, terminated, truncated, info

    def close(self) -> None:
        """Release renderers, processes or sockets; a no-op unless the simulator holds any."""
        return None

    def __enter__(self) -> Env:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
