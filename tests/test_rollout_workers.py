"""Two rollout workers (`rollout.workers=2`): real Ray actors with the HF engine on the tiny model,
fed one prompt group at a time. On-policy (`rollout.max_staleness=0`) they train exactly the synchronous
loop's batches and losses; one update ahead they log their staleness, queue, idle time and weight sync,
and a run stopped in the middle resumes without training a prompt twice."""

from __future__ import annotations

import pytest
from helpers import OVERLAPPED, train_quickstart

from mmrl.cli import main
from mmrl.data.synthetic import generate
from mmrl.run.logger import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

TWO_STEPS = ("trainer.total_steps=2", "trainer.save_every=0")


def test_two_on_policy_workers_train_the_synchronous_loops_batches_and_losses(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    generate(tmp_path / "data", task="color", n_train=16, n_val=0, seed=0, image_size=56)
    # A reward that tells every answer apart, so every group has advantages and each update moves the
    # policy: a worker one version behind would sample step 2 differently.
    (tmp_path / "reward.py").write_text("def length(sample):\n    return len(sample.response) / 10\n")
    both = (f'reward.functions=[{{name: "{tmp_path / "reward.py"}:length"}}]', *TWO_STEPS)
    # The synchronous loop sampling each group alone with its own seed, as the workers do.
    data = tmp_path / "data"
    sync = train_quickstart(tiny_model_dir, data, tmp_path / "sync", "rollout.group_seeds=true", *both)
    workers = train_quickstart(tiny_model_dir, data, tmp_path / "workers", "rollout.workers=2", *both)

    assert sync[1]["actor/kl_loss"] > 1e-3, "step 1's update should have moved the policy"
    assert [r["data/rows"] for r in workers] == [r["data/rows"] for r in sync]
    losses = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
    for key in ("reward/mean", "response_length/mean", *losses):
        assert [r[key] for r in workers] == pytest.approx([r[key] for r in sync], abs=1e-5), key
    assert [r["rollout/staleness_max"] for r in workers] == [0, 0]
    assert all(r["rollout/stale_groups"] == 0 for r in workers)


def test_two_workers_one_update_ahead_log_sane_metrics_and_resume_without_repeating_a_prompt(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    generate(tmp_path / "data", task="color", n_train=16, n_val=0, seed=0, image_size=56)
    run = tmp_path / "run"
    train_quickstart(
        tiny_model_dir, tmp_path / "data", run, *OVERLAPPED, "rollout.workers=2", "trainer.total_steps=2"
    )
    assert main(["train", str(run / "config.yaml"), "trainer.total_steps=3", "--resume"]) == 0
    records = read_metrics(run / "metrics.jsonl")

    assert [r["step"] for r in records] == [1, 2, 3]
    rows = [row for r in records for row in r["data/rows"]]
    assert len(rows) == 12 and len(set(rows)) == 12, "12 of epoch 0's 16 prompts, none twice"
    assert records[0]["rollout/staleness_max"] == 0  # the first groups wait for no update
    for r in records:
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 1
        assert r["rollout/queue_groups"] >= 0 and r["rollout/stale_groups"] >= 0
        assert 0 <= r["timing/trainer_idle"] <= r["timing/step"]
        assert 0 < r["timing/weight_sync"] < r["timing/step"]
        assert r["rollout/worker_restarts"] == 0
