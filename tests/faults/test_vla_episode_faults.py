"""An env worker killed mid-episode during a VLA training step: it is replaced, its episodes are
re-collected from where they were (seed + action replay), and the step completes with the same
episodes and the same update as an undisturbed run (real Ray, real MuJoCo, a real tiny Qwen2.5-VL)."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import tiny_vla_config

from mmrl.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _trainer(tmp_path, model_dir, name: str) -> Trainer:
    cfg = tiny_vla_config(
        model_dir,
        tmp_path / name,
        "env.options={image_size: 56, max_steps: 6}",
        "env.num_workers=2",
        "env.timeout_s=20",
        "env.val_episodes=0",
        "trainer.total_steps=1",
    )
    return Trainer(cfg)


def test_a_killed_env_worker_is_replaced_and_the_training_step_completes_unchanged(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    clean = _trainer(tmp_path, tiny_model_dir, "clean")
    clean.step = 1
    expected = clean.train_step()
    clean.source.envs.close()

    trainer = _trainer(tmp_path, tiny_model_dir, "faulty")
    pool, calls = trainer.source.envs, []
    step = pool.step

    def step_and_kill_at_the_third_call(actions, render=None):
        calls.append(1)
        if len(calls) == 3:  # mid-episode: two env steps taken, the episodes still running
            os.kill(pool.pids()[1], signal.SIGKILL)
        return step(actions, render)

    pool.step = step_and_kill_at_the_third_call
    trainer.step = 1
    got = trainer.train_step()
    trainer.source.envs.close()

    assert got["env/restarts"] == 1 and expected["env/restarts"] == 0
    assert got["actor/updates"] == 1
    for key in ("episode/return", "episode/episode_length", "reward/mean", "actor/pg_loss", "actor/entropy"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
