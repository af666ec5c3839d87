"""Config checks for DAPO and the KL reward: impossible combinations fail at start, and the
recipes select what their names promise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.errors import ConfigError
from mmrl.sources.prompts import make_kl_controller

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"


def test_dynamic_sampling_needs_groups_that_can_differ() -> None:
    with pytest.raises(ConfigError, match=r"rollout.n=1 never differs.*rollout.n >= 2"):
        load_config(
            QUICKSTART,
            ["algorithm.dynamic_sampling=true", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
        )


def test_overlong_buffer_must_fit_in_the_length_budget() -> None:
    with pytest.raises(ConfigError, match=r"overlong_buffer_len \(9\).*max_new_tokens \(8\)"):
        load_config(QUICKSTART, ["algorithm.overlong_buffer_len=9"])


def test_unknown_kl_controller_is_named() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.kl_ctrl\.type"):
        load_config(QUICKSTART, ["algorithm.kl_ctrl.type=pid"])


def test_kl_in_reward_and_kl_loss_together_warn(caplog) -> None:
    both = load_config(QUICKSTART, ["algorithm.use_kl_in_reward=true"])  # the quickstart keeps its KL loss
    with caplog.at_level(logging.WARNING, logger="mmrl.trainer"):
        ctrl = make_kl_controller(both)
    assert "penalised twice" in caplog.text
    assert ctrl.value == both.algorithm.kl_ctrl.kl_coef
    caplog.clear()
    reward_only = load_config(QUICKSTART, ["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false"])
    with caplog.at_level(logging.WARNING, logger="mmrl.trainer"):
        make_kl_controller(reward_only)
    assert not caplog.text


def test_recipes_select_their_algorithms() -> None:
    dapo = load_config(CONFIGS / "quickstart_dapo.yaml")
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.actor.loss_agg_mode == "token-mean" and not dapo.actor.use_kl_loss
    assert dapo.algorithm.dynamic_sampling and dapo.algorithm.overlong_buffer_len > 0
    drgrpo = load_config(CONFIGS / "quickstart_drgrpo.yaml")
    assert drgrpo.algorithm.adv_estimator == "drgrpo"
    assert drgrpo.actor.loss_agg_mode == "seq-mean-token-sum-norm"
