"""The rollout worker of an overlapped run (`rollout.max_staleness`) killed between two steps: it is
replaced with the newest weights, the batches it owed are generated again, and the run ends normally
(a real Ray actor, SIGKILLed)."""

from __future__ import annotations

import os
import signal

import pytest
import ray
from helpers import overlapped_config

from mmrl.run.logger import read_metrics
from mmrl.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_a_killed_rollout_worker_is_replaced_and_its_batches_generated_again(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    cfg = overlapped_config(tiny_model_dir, tmp_path, "trainer.total_steps=3", "trainer.save_every=0")
    trainer = Trainer(cfg)
    log, killed = trainer.logger.log, []

    def log_then_kill_the_worker_after_step_1(step: int, metrics: dict) -> None:
        log(step, metrics)
        if step == 1:  # step 2's batch is in flight, or done and step 3's about to be sent
            pid = ray.get(trainer.engine.workers[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    trainer.logger.log = log_then_kill_the_worker_after_step_1
    trainer.fit()

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert killed and [r["step"] for r in records] == [1, 2, 3]
    assert [r["actor/updates"] for r in records] == [1, 1, 1]
    assert records[0]["rollout/worker_restarts"] == 0 and records[-1]["rollout/worker_restarts"] == 1
