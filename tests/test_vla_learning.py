"""The VLA recipe learns on CPU: a tiny random-init Qwen2.5-VL is behaviour-cloned from a noisy expert
(`mmrl sft`), then episode GRPO raises its success on the reach task over fixed evaluation seeds that
training never meets (configs/vla_mujoco_reach.yaml, at the size `learning_runs.RUNS["vla"]` gives)."""

from __future__ import annotations

import pytest
from learning_runs import REPO, RUNS, train, validations

from mmrl.config import load_config
from mmrl.models import build_tiny

pytestmark = pytest.mark.slow


def test_sft_then_episode_grpo_raises_reach_success(tmp_path) -> None:
    run = RUNS["vla"]
    cfg = load_config(REPO / run.config)
    assert cfg.env.val_episodes >= 50 and cfg.rollout.val.temperature == cfg.rollout.temperature
    records = train("vla", tmp_path, build_tiny(tmp_path / "tiny-model", seed=0))
    val = validations(records, run.metric)
    (first_step, before), (last_step, after) = val[0], val[-1]
    print(f"reach success over {cfg.env.val_episodes} seeds: {before:.2f} after SFT -> {after:.2f} after RL")
    assert (first_step, last_step) == (0, run.steps)
    assert after - before >= run.min_gain, val
    assert (tmp_path / "run" / "media" / f"step_{last_step:06d}.gif").exists()
