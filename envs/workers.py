"""Env workers on Ray: many envs of one task, spread over worker processes, stepped together.

A simulator can crash (a segfault in a renderer) or hang (a deadlocked GL context). Either would
stop a long run if the rollout waited on it. Here every call has a timeout. A worker that dies or
hangs is killed and replaced, and its envs are brought back to where they were by replaying each
episode's seed and actions: the tasks are deterministic under a seed (`tests/test_envs.py`). The
step that failed then completes, and training never sees the fault except in `restarts`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import ray

from mmrl.envs.base import Info, Obs, StepResult
from mmrl.envs.vector import LocalEnvs

log = logging.getLogger("mmrl.envs.workers")


class EnvWorkerError(RuntimeError):
    """An env worker kept failing after `max_restarts` replacements in one call."""


class EnvWorker(LocalEnvs):
    """One process holding `count` envs of a task (a Ray actor)."""

    def pid(self) -> int:
        return os.getpid()

    def get_action_dim(self) -> int:  # a method: Ray actors expose no properties
        return self.action_dim

    def replay(self, seeds: list[int | None], histories: list[list[np.ndarray]]) -> None:
        """Reset each env with its seed and re-apply its episode's actions so far."""
        for env, seed, actions in zip(self.envs, seeds, histories, strict=True):
            if seed is None:
                continue
            env.reset(seed=seed)
            for action in actions:
                env.step(action, render=False)


class EnvPool:
    """`num_envs` envs of `task` over `num_workers` Ray worker processes, reset and stepped as one batch.

    `restarts` counts replaced workers; each replacement is logged with its cause."""

    def __init__(
        self,
        task: str,
        num_envs: int,
        num_workers: int,
        options: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
        max_restarts: int = 3,
        cpus_per_worker: float = 1.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        """`timeout_s` bounds each reset/step call; starting a worker (a process, MuJoCo, an OpenGL
        context) has its own, longer `startup_timeout_s`, so a slow start is never taken for a hang."""
        if num_workers > num_envs:
            raise ValueError(f"num_workers ({num_workers}) must not exceed num_envs ({num_envs})")
        self.task, self.options, self.num_envs = task, dict(options or {}), num_envs
        self.timeout_s, self.max_restarts, self.startup_timeout_s = timeout_s, max_restarts, startup_timeout_s
        self.remote = ray.remote(num_cpus=cpus_per_worker, max_restarts=0)(EnvWorker)
        self.slices = [s.tolist() for s in np.array_split(np.arange(num_envs), num_workers)]
        self.workers = [self._spawn(len(s)) for s in self.slices]
        self._await_start(self.workers)
        self.seeds: list[int | None] = [None] * num_envs
        self.histories: list[list[np.ndarray]] = [[] for _ in range(num_envs)]
        self.restarts = 0

    def _spawn(self, count: int) -> Any:
        return self.remote.remote(self.task, count, self.options)

    def _await_start(self, workers: list[Any]) -> None:
        try:
            ray.get([w.pid.remote() for w in workers], timeout=self.startup_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            for worker in workers:
                ray.kill(worker)
            raise EnvWorkerError(
                f"an env worker for {self.task} did not start within {self.startup_timeout_s:.0f} s ({err!r}); "
                "check that the task builds in a fresh process (`make_env` with these options)"
            ) from err

    @property
    def action_dim(self) -> int:
        return ray.get(self.workers[0].get_action_dim.remote(), timeout=self.timeout_s)

    def pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers], timeout=self.timeout_s)

    def reset(self, seeds: list[int | None]) -> list[tuple[Obs, Info] | None]:
        """A None seed leaves that env idle (a batch smaller than the pool)."""
        self.seeds = list(seeds)
        self.histories = [[] for _ in seeds]
        return self._call("reset", [([seeds[i] for i in s],) for s in self.slices])

    def step(
        self, actions: list[np.ndarray | None], render: list[bool] | None = None
    ) -> list[StepResult | None]:
        """One action per env (None: that env's episode is over and it is not stepped); ``render[i]``
        False skips env i's frame, which then neither renders nor crosses to this process."""
        actions = [None if a is None else np.asarray(a, dtype=np.float32) for a in actions]
        seen = render or [True] * self.num_envs
        results = self._call("step", [([actions[i] for i in s], [seen[i] for i in s]) for s in self.slices])
        for i, action in enumerate(actions):
            if action is not None:
                self.histories[i].append(action)
        return results

    def _call(self, method: str, args: list[tuple[list[Any], ...]]) -> list[Any]:
        """`method` on every worker with its share of `args`; results in env order. A worker that
        dies or exceeds the timeout is replaced, caught up by replay, and asked again."""
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)]
        results: list[Any] = [None] * len(self.workers)
        for rank, ref in enumerate(refs):
            for attempt in range(self.max_restarts + 1):
                try:
                    results[rank] = ray.get(ref, timeout=self.timeout_s)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    if attempt == self.max_restarts:
                        raise EnvWorkerError(
                            f"env worker {rank} ({self.task}, envs {self.slices[rank]}) failed during {method}, "
                            f"{attempt + 1} attempt(s) in a row: {type(err).__name__}. Check the simulator, or "
                            "raise the timeout if its steps are legitimately slow."
                        ) from err
                    ref = self._replace(rank, method, args[rank], err)
        return [item for part in results for item in part]

    def _replace(self, rank: int, method: str, args: tuple[list[Any], ...], err: Exception) -> Any:
        cause = "hung" if isinstance(err, ray.exceptions.GetTimeoutError) else "died"
        log.warning(
            "env worker %d %s during %s; replacing it and replaying its episodes", rank, cause, method
        )
        ray.kill(self.workers[rank])
        envs = self.slices[rank]
        worker = self._spawn(len(envs))
        self._await_start([worker])
        if method == "step":  # back to the state before this step; `reset` starts afresh anyway
            worker.replay.remote([self.seeds[i] for i in envs], [self.histories[i] for i in envs])
        self.workers[rank] = worker
        self.restarts += 1
        return getattr(worker, method).remote(*args)

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
