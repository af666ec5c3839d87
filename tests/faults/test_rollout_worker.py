"""The rollout worker of an overlapped run (`rollout.max_staleness`) killed between two steps: it is
replaced with the newest weights, the batches it owed are generated again, and the run ends normally
(a real Ray actor, SIGKILLed)."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from mmrl.config import load_config
from mmrl.logger import read_metrics
from mmrl.synthetic import generate
from mmrl.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_a_killed_rollout_worker_is_replaced_and_its_batches_generated_again(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    generate(tmp_path / "data", task="color", n_train=16, n_val=0, seed=0, image_size=56)
    cfg = load_config(
        "configs/quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={tmp_path / 'run'}",
            "data.train_batch_size=4",
            "actor.mini_batch_size=4",
            "rollout.n=2",
            "warmup.steps=0",
            "trainer.total_steps=3",
            "trainer.save_every=0",
            "trainer.progress=false",
            "rollout.max_staleness=1",
            "actor.rollout_correction=tis",
        ],
    )
    trainer = Trainer(cfg)
    log, killed = trainer.logger.log, []

    def log_then_kill_the_worker_after_step_1(step: int, metrics: dict) -> None:
        log(step, metrics)
        if step == 1:  # step 2's batch is in flight, or done and step 3's about to be sent
            pid = ray.get(trainer.engine.worker.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    trainer.logger.log = log_then_kill_the_worker_after_step_1
    trainer.fit()

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert killed and [r["step"] for r in records] == [1, 2, 3]
    assert [r["actor/updates"] for r in records] == [1, 1, 1]
    assert records[0]["rollout/worker_restarts"] == 0 and records[-1]["rollout/worker_restarts"] == 1
