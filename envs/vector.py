"""Several envs of one task in this process, behind the same batched interface as `EnvPool`.

The rollout loop needs only `reset(seeds)`, `step(actions)`, `action_dim`, `restarts` and `close()`;
on a laptop this saves starting Ray and a worker process per env group, which costs more than a
whole tiny-model episode batch.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from mmrl.envs.base import Info, Obs, StepResult
from mmrl.envs.registry import make_env


class VectorEnv(Protocol):
    """What the episode loop drives: `LocalEnvs` here, or `mmrl.envs.workers.EnvPool` on Ray."""

    restarts: int
    num_envs: int

    @property
    def action_dim(self) -> int: ...

    def reset(self, seeds: list[int | None]) -> list[tuple[Obs, Info] | None]: ...

    def step(
        self, actions: list[np.ndarray | None], render: list[bool] | None = None
    ) -> list[StepResult | None]: ...

    def close(self) -> None: ...


class LocalEnvs:
    """`num_envs` envs of `task`, stepped one after the other in this process."""

    restarts = 0  # nothing to restart: a crash here is the trainer's own

    def __init__(self, task: str, num_envs: int, options: dict[str, Any] | None = None) -> None:
        self.envs = [make_env(task, **(options or {})) for _ in range(num_envs)]
        self.num_envs = num_envs

    @property
    def action_dim(self) -> int:
        return self.envs[0].action_dim

    def reset(self, seeds: list[int | None]) -> list[tuple[Obs, Info] | None]:
        """A None seed leaves that env idle (a batch smaller than the pool)."""
        return [None if s is None else env.reset(seed=s) for env, s in zip(self.envs, seeds, strict=True)]

    def step(
        self, actions: list[np.ndarray | None], render: list[bool] | None = None
    ) -> list[StepResult | None]:
        """One action per env (None: not stepped); ``render[i]`` False skips env i's frame (`Env.step`)."""
        seen = render or [True] * len(self.envs)
        return [
            None if a is None else env.step(a, render=r)
            for env, a, r in zip(self.envs, actions, seen, strict=True)
        ]

    def close(self) -> None:
        for env in self.envs:
            env.close()
