"""Training on nothing, silently: inputs that once turned every advantage into 0 (or NaN) with no word.

Huge scores keep their ranking (group statistics wide enough not to overflow); reward weights and
config numbers that could only overflow or poison are refused at start; an env reward that is not a
number scores 0 for its step and is counted; the two halves of a paired method are refused apart.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.algorithms import ADVANTAGE_ESTIMATORS, masked_whiten
from mmrl.config import load_config
from mmrl.envs.actions import ActionTokenizer
from mmrl.envs.vector import LocalEnvs
from mmrl.errors import ConfigError
from mmrl.models import load_policy, load_processor
from mmrl.processors import PixelBudget
from mmrl.rewards import RewardManager
from mmrl.rollout import SamplingParams
from mmrl.rollout.hf import HFEngine
from mmrl.vla.episodes import run_episodes
from mmrl.vla.observations import ObservationPrompts

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
SCORES = torch.tensor([[1.0], [0.0], [2.0], [0.0], [3.0], [1.0]])  # two groups of three, one token each
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.ones(6, 1)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "sppo"])
@pytest.mark.parametrize("scale", [1e20, 1e30, 1e36])
def test_huge_scores_keep_their_ranking_instead_of_zero_advantages(name: str, scale: float) -> None:
    # Before: scores of 1e20 and more overflowed float32's squares, σ was inf and GRPO's advantages 0.
    estimator = ADVANTAGE_ESTIMATORS[name]
    small, _ = estimator(SCORES, MASK, GROUPS)
    huge, _ = estimator(SCORES * scale, MASK, GROUPS)
    assert huge.isfinite().all() and huge.dtype == torch.float32 and huge.abs().sum() > 0
    scale_free = name in ("grpo", "reinforce_plus_plus_baseline", "sppo")
    assert torch.allclose(huge if scale_free else huge / scale, small, rtol=1e-5, atol=1e-5)


def test_whitening_huge_values_gives_the_small_ones_answer() -> None:
    values = torch.tensor([[1.0, -2.0, 5.0], [0.5, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    expected = masked_whiten(values, mask)
    assert torch.allclose(masked_whiten(values * 1e25, mask), expected, atol=1e-6)


@pytest.mark.parametrize("weight", [1e30, -1e7, math.inf, math.nan])
def test_a_reward_weight_that_could_overflow_the_total_is_refused_in_one_line(weight: float) -> None:
    with pytest.raises(
        ValueError, match=r"weight of reward 'answer_match' must be a number within ±1e\+06"
    ) as err:
        RewardManager([{"name": "answer_match", "weight": weight}])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config, key, value",
    [
        ("vla_mujoco_reach.yaml", "env.invalid_penalty", ".inf"),
        ("quickstart.yaml", "actor.lr", ".nan"),
        ("quickstart.yaml", "actor.clip_ratio_high", ".inf"),
        ("quickstart.yaml", "rollout.temperature", "-.inf"),
    ],
)
def test_no_config_number_takes_inf_or_nan(config: str, key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a finite number"):
        load_config(CONFIGS / config, [f"{key}={value}"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.adv_estimator=gpg"],
            r"adv_estimator=gpg is one half of a pair: set actor\.policy_loss=gpg",
        ),
        (
            ["actor.policy_loss=sppo"],
            r"policy_loss=sppo is one half of a pair: set algorithm\.adv_estimator=sppo",
        ),
        (
            ["algorithm.adv_estimator=sppo", "actor.policy_loss=gspo"],
            r"adv_estimator=sppo is one half of a pair: set actor\.policy_loss=sppo \(not gspo\)",
        ),
    ],
)
def test_half_of_a_paired_method_is_refused_naming_the_other_half(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, overrides)
    load_config(QUICKSTART, ["algorithm.adv_estimator=gpg", "actor.policy_loss=gpg"])  # the pair itself


class _PoisonedRewards(LocalEnvs):
    """Real reach envs whose second step of each episode returns a reward that is no number."""

    def __init__(self, bad: object, *args: object) -> None:
        super().__init__(*args)
        self.bad, self.calls = bad, 0

    def step(self, actions, render=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        results = super().step(actions, render)
        if self.calls == 2:
            results = [r if r is None else (r[0], self.bad, *r[2:]) for r in results]
        return results


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_an_env_reward_that_is_not_a_number_scores_0_and_is_counted(tiny_model_dir, bad, caplog) -> None:
    model, processor = (
        load_policy(tiny_model_dir, torch.float32, "cpu").eval(),
        load_processor(tiny_model_dir),
    )
    tokenizer = ActionTokenizer(action_dim=2, start_id=0, n_bins=model.config.text_config.vocab_size)
    budget = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)
    envs = _PoisonedRewards(bad, "reach", 2, {"image_size": 56, "max_steps": 4})
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="mmrl.vla"):
        episodes = run_episodes(
            HFEngine(model, processor), envs, ObservationPrompts(processor, budget), tokenizer, [3, 3],
            SamplingParams(temperature=1.0), group_size=2,
        )  # fmt: skip
    assert episodes.bad_rewards == 2 and episodes.metrics("episode")["episode/bad_env_rewards"] == 2
    assert episodes.returns.isfinite().all() and episodes.batch["step_rewards"].isfinite().all()
    assert np.isclose(float(episodes.batch["step_rewards"].sum()), float(episodes.returns.sum()))
    warnings = [r for r in caplog.records if "not a finite number" in r.getMessage()]
    assert len(warnings) == 1, "the first is logged, later ones counted"
    advantages, _ = ADVANTAGE_ESTIMATORS["grpo"](
        episodes.returns[:, None], torch.ones(2, 1), torch.zeros(2, dtype=torch.long)
    )
    assert advantages.isfinite().all()
