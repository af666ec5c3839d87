"""Env workers that die or hang mid-episode are replaced, replayed to where they were, and the step
completes with exactly the results an undisturbed pool gives (real Ray, real MuJoCo rendering)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from mmrl.envs.workers import EnvPool, EnvWorkerError

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
SEEDS = [3, 4, 5, 6]
ACTION_DIMS = {"reach": 2, "metaworld/reach-v3": 4}


def _actions(step: int, dim: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.uniform(-1, 1, dim).astype(np.float32) for _ in SEEDS]


def _episode(pool: EnvPool, steps: int, fault_at: int | None = None, fault=None) -> list:
    """Reset, then `steps` steps; `fault(pool)` is injected just before step `fault_at`."""
    frames = [obs["image"] for obs, _ in pool.reset(SEEDS)]
    for step in range(steps):
        if step == fault_at:
            fault(pool)
        frames += [result[0]["image"] for result in pool.step(_actions(step, ACTION_DIMS[pool.task]))]
    return frames


def _kill(pool: EnvPool) -> None:
    os.kill(pool.pids()[1], signal.SIGKILL)


def _freeze(pool: EnvPool) -> None:
    os.kill(pool.pids()[0], signal.SIGSTOP)  # alive but never answers: a hang


@pytest.mark.parametrize(
    ("task", "fault"),
    [("reach", _kill), ("reach", _freeze), ("metaworld/reach-v3", _kill)],
    ids=["killed", "hung", "metaworld-killed"],
)
def test_a_dead_or_hung_env_worker_is_replaced_and_the_step_completes_exactly(local_ray, task, fault) -> None:
    clean = EnvPool(task, num_envs=4, num_workers=2, timeout_s=20)
    expected = _episode(clean, steps=4)
    clean.close()

    pool = EnvPool(task, num_envs=4, num_workers=2, timeout_s=5)
    got = _episode(pool, steps=4, fault_at=2, fault=fault)
    assert pool.restarts == 1
    pool.close()
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), "replay changed the episode"


def test_a_worker_that_keeps_failing_stops_with_a_clear_error(local_ray) -> None:
    pool = EnvPool("reach", num_envs=2, num_workers=1, timeout_s=5, max_restarts=0)
    pool.reset([1, 2])
    os.kill(pool.pids()[0], signal.SIGKILL)
    with pytest.raises(
        EnvWorkerError, match=r"env worker 0 \(reach, envs \[0, 1\]\) failed during step, 1 attempt"
    ):
        pool.step(_actions(0, 2)[:2])
    pool.close()
