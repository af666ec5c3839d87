"""Config checks for DAPO and the KL reward: impossible combinations fail at start, and the
recipes select what their names promise."""

from __future__ import annotations

import logging
from functools import reduce
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


# ---------------------------------------------------------------- the algorithms of issue 52
# Each new name as a config selects it, with its keys (README's algorithm table).
CITED = {
    "cispo": ["actor.policy_loss=cispo", "actor.clip_ratio_low=10", "actor.clip_ratio_high=0.3"],
    "sapo": ["actor.policy_loss=sapo", "actor.tau_pos=1.0", "actor.tau_neg=1.05"],
    "gmpo": ["actor.policy_loss=gmpo", "actor.clip_ratio_low=0.4", "actor.clip_ratio_high=0.4"],
    "gpg": ["algorithm.adv_estimator=gpg", "actor.policy_loss=gpg"],
    "opo": ["algorithm.adv_estimator=opo"],
    "kl_cov": ["actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0.002", "actor.kl_cov_coef=1.0"],
    "clip_cov": [
        "actor.policy_loss=clip_cov",
        "actor.clip_cov_ratio=0.002",
        "actor.clip_cov_lb=1",
        "actor.clip_cov_ub=5",
    ],
    "pf_ppo": ["algorithm.policy_filtration=best_worst", "rollout.n=4"],
    "sppo": ["algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", "algorithm.sppo_eta=2.0"],
}


@pytest.mark.parametrize("name", sorted(CITED))
def test_cited_algorithms_are_selected_by_the_config(name: str) -> None:
    from mmrl.algorithms import get_advantage_estimator, get_policy_filter, get_policy_loss

    cfg = load_config(QUICKSTART, CITED[name])
    for key, value in (override.split("=") for override in CITED[name]):
        actual = reduce(getattr, key.split("."), cfg)
        assert actual == (value if isinstance(actual, str) else type(actual)(value)), key
    get_advantage_estimator(cfg.algorithm.adv_estimator)
    get_policy_loss(cfg.actor.policy_loss)
    if cfg.algorithm.policy_filtration:
        get_policy_filter(cfg.algorithm.policy_filtration)


@pytest.mark.parametrize(
    "loss, paper",
    [
        ("sapo", {"loss_agg_mode": "seq-mean-token-mean"}),
        ("gmpo", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}),
    ],
)
def test_choosing_a_method_applies_its_papers_values_where_the_config_sets_none(loss, paper, capsys) -> None:
    """SAPO averages per sequence and GMPO clips at 0.4 in log space in their papers: chosen alone, they
    train so, and `mmrl config show` says what was filled in; a key the user set keeps the user's value."""
    cfg = load_config(QUICKSTART, [f"actor.policy_loss={loss}"])
    assert {key: getattr(cfg.actor, key) for key in paper} == paper
    assert cfg.paper_defaults == [f"actor.{key}={value} ({loss})" for key, value in paper.items()]
    key = next(iter(paper))
    mine = "token-mean" if key == "loss_agg_mode" else 0.3
    kept = load_config(QUICKSTART, [f"actor.policy_loss={loss}", f"actor.{key}={mine}"])
    assert getattr(kept.actor, key) == mine and all(key not in line for line in kept.paper_defaults)
    assert load_config(QUICKSTART).paper_defaults == []  # GRPO's recipe: nothing filled in
    from mmrl.cli import main

    assert main(["config", "show", str(QUICKSTART), f"actor.policy_loss={loss}"]) == 0
    shown = capsys.readouterr().out
    assert f"# paper default, as the config leaves it unset: actor.{key}={paper[key]} ({loss})" in shown


def test_loss_settings_reach_every_policy_loss() -> None:
    options = load_config(QUICKSTART, ["actor.tau_neg=2", "actor.clip_cov_ub=7"]).actor.policy_loss_options()
    assert options["tau_neg"] == 2.0 and options["clip_cov_ub"] == 7.0 and options["clip_ratio_high"] == 0.28
    assert {
        "tau_pos",
        "kl_cov_ratio",
        "kl_cov_coef",
        "clip_cov_ratio",
        "clip_cov_lb",
        "clip_ratio_c",
    } <= options.keys()
    assert load_config(QUICKSTART, ["algorithm.sppo_eta=3"]).algorithm.estimator_options()["eta"] == 3.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.tau_pos=0"], r"actor\.tau_pos"),
        (["actor.tau_neg=-1"], r"actor\.tau_neg"),
        (["actor.kl_cov_ratio=0"], r"actor\.kl_cov_ratio"),
        (["actor.kl_cov_ratio=1.5"], r"actor\.kl_cov_ratio"),
        (["actor.kl_cov_coef=-1"], r"actor\.kl_cov_coef"),
        (["actor.clip_cov_ratio=0"], r"actor\.clip_cov_ratio"),
        (
            ["actor.clip_cov_lb=5", "actor.clip_cov_ub=1"],
            r"clip_cov_lb \(5\.0\) must be below actor\.clip_cov_ub",
        ),
        (["algorithm.sppo_eta=0"], r"algorithm\.sppo_eta"),
        (
            ["algorithm.policy_filtration=max_min"],
            r"policy_filtration='max_min' is not registered.*best_worst",
        ),
        (
            [
                "algorithm.policy_filtration=best_worst",
                "rollout.n=1",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ],
            r"rollout\.n=1 leaves nothing to choose",
        ),
        (["algorithm.policy_filtration=best_of_n"], r"best_of_n keeps 1 response.*grpo compares.*best_worst"),
        (
            ["algorithm.adv_estimator=opo", "actor.ppo_epochs=2"],
            r"opo trains exactly on-policy.*actor\.ppo_epochs=1",
        ),
        (["algorithm.adv_estimator=opo", "actor.mini_batch_size=16"], r"actor\.mini_batch_size=32"),
        (["algorithm.adv_estimator=sppo", "rollout.n=1"], r"sppo compares responses within a group"),
        (["algorithm.adv_estimator=gpg", "rollout.n=1"], r"gpg compares responses within a group"),
    ],
)
def test_cited_algorithms_refuse_bad_settings_naming_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, overrides)


def test_best_of_n_runs_with_an_estimator_without_groups() -> None:
    cfg = load_config(
        QUICKSTART, ["algorithm.policy_filtration=best_of_n", "algorithm.adv_estimator=reinforce_plus_plus"]
    )
    from mmrl.training.actor import responses_per_prompt, update_plan

    assert responses_per_prompt(cfg) == 1
    assert update_plan(cfg).rows == 32  # 32 prompts a mini-batch, one response each
    best_worst = load_config(QUICKSTART, ["algorithm.policy_filtration=best_worst"])
    assert update_plan(best_worst).rows == 32 * 2


def test_a_users_estimator_needs_nothing(tmp_path: Path) -> None:
    # a user's file is not imported while the config is read, and no group is asked of it
    load_config(QUICKSTART, [f"algorithm.adv_estimator={tmp_path / 'mine.py'}:fn", "rollout.n=1"])
