"""The VLA recipe learns on CPU: a tiny random-init Qwen2.5-VL is behaviour-cloned from a noisy expert
(`mmrl sft`), then episode GRPO raises its success on the reach task over fixed evaluation seeds that
training never meets, by at least 20 points (configs/vla_mujoco_reach.yaml, as shipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.models import build_tiny
from mmrl.vla.sft import run_sft
from mmrl.vla.trainer import EpisodeTrainer

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "vla_mujoco_reach.yaml"


def test_sft_then_episode_grpo_raises_reach_success_by_20_points(tmp_path) -> None:
    cfg = load_config(
        CONFIG,
        [
            f"model.path={tmp_path / 'sft-model'}",
            f"sft.base_model={build_tiny(tmp_path / 'tiny-model', seed=0)}",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.loggers=[jsonl]",
            "trainer.progress=false",
            "trainer.save_every=0",
            "trainer.val_every=20",  # before and after RL only
        ],
    )
    assert cfg.env.val_episodes >= 50 and cfg.rollout.val.temperature == cfg.rollout.temperature
    run_sft(cfg)
    EpisodeTrainer(cfg).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validations = [(r["step"], r["val/success"]) for r in records if "val/success" in r]
    (first_step, before), (last_step, after) = validations[0], validations[-1]
    print(f"reach success over {cfg.env.val_episodes} seeds: {before:.2f} after SFT -> {after:.2f} after RL")
    assert first_step == 0 and last_step == cfg.trainer.total_steps
    assert after - before >= 0.20, validations
    assert (tmp_path / "run" / "media" / f"step_{last_step:06d}.gif").exists()
