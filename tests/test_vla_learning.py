"""The VLA recipe learns on CPU (configs/vla_mujoco_reach.yaml, at the size `learning_runs.RUNS["vla"]`
gives): a tiny random-init Qwen2.5-VL, which cannot act at all, is behaviour-cloned from a noisy expert
(`mmrl sft`), then trained with episode GRPO, and succeeds on fixed evaluation seeds that training never
meets.

Measured spread (bench/learning_spread.py, 2026-11-24, 2-core Xeon, one thread; docs/benchmarks.md):
success sampled at T=1 over the 100 evaluation seeds, untrained -> after SFT -> after 20 RL steps, was
0.00 -> 0.06 -> 0.13, 0.00 -> 0.08 -> 0.07 and 0.00 -> 0.05 -> 0.12 for seeds 1-3. Earlier machines gave
0.06 -> 0.29 and 0.06 -> 0.22 for seed 1. So the recipe reliably learns from nothing (the least final
success 0.07, the untrained policy 0.00 with thousands of malformed actions), but what the 20 RL steps
add on top of the clone lies within the spread (-0.01 to +0.23): the test asserts the first, and only that
RL keeps what was cloned. Making RL's own gain robust on this task is the VLA-benchmarks issue's work.
"""

from __future__ import annotations

import pytest
from learning_runs import REPO, RUNS, train, validations

from mmrl.config import load_config
from mmrl.evaluate.episodes import evaluate_episodes
from mmrl.models import build_tiny

pytestmark = pytest.mark.slow

MIN_SUCCESS = 0.04  # the least final success seen was 0.07; margin 0.03, four successes in 100 from none


def test_sft_then_episode_grpo_takes_reach_success_from_none(tmp_path) -> None:
    run = RUNS["vla"]
    tiny = build_tiny(tmp_path / "tiny-model", seed=0)
    records = train("vla", tmp_path, tiny)
    cfg = load_config(REPO / run.config, [f"model.path={tmp_path / 'sft-model'}"])
    assert cfg.env.val_episodes >= 50 and cfg.rollout.val.temperature == cfg.rollout.temperature
    # 20 episodes: the random-init policy emits malformed actions almost always and never succeeded.
    untrained = evaluate_episodes(cfg, tiny, episodes=20, out=tmp_path / "untrained.json").metrics[
        "eval/success"
    ]
    (first_step, cloned), (last_step, trained) = validations(records, run.metric)
    print(f"reach success: untrained {untrained:.2f}, after SFT {cloned:.2f}, after RL {trained:.2f}")
    assert (first_step, last_step) == (0, run.steps)
    assert untrained == 0.0, "the random-init policy should not reach the ball"
    assert trained >= MIN_SUCCESS, f"success {untrained} -> {cloned} (SFT) -> {trained} (RL)"
    assert trained - cloned >= run.min_gain, f"RL lost what was cloned: {cloned} -> {trained}"
    assert (tmp_path / "run" / "media" / f"step_{last_step:06d}.gif").exists()
