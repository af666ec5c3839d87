"""One training step of each algorithm of issue 52 through the CLI, on the tiny model: the names the config
selects reach the loss and the filter, and their metrics come out (their values: tests/test_algorithms_cited.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import FAST

from mmrl.cli import main
from mmrl.data.synthetic import generate
from mmrl.run.logger import read_metrics

# One step of the trainer test's run; two epochs, so that the second optimizer step sees π_θ ≠ π_old
# (ratios other than 1), except where the algorithm takes one step a batch.
STEP = [*FAST, "trainer.total_steps=1", "data.min_pixels=3136", "data.max_pixels=3136"]
TWO_EPOCHS = ["actor.ppo_epochs=2"]

# name: (overrides, what its step's metrics must show)
RUNS: dict[str, tuple[list[str], Callable[[dict], bool]]] = {
    "cispo": (["actor.policy_loss=cispo", *TWO_EPOCHS], lambda m: "actor/clip_frac" in m),
    "sapo": (
        ["actor.policy_loss=sapo", "actor.loss_agg_mode=seq-mean-token-mean", *TWO_EPOCHS],
        lambda m: m["actor/clip_frac"] == 0,
    ),
    "gmpo": (
        ["actor.policy_loss=gmpo", "actor.clip_ratio_low=0.4", "actor.clip_ratio_high=0.4", *TWO_EPOCHS],
        lambda m: "actor/clip_frac" in m,
    ),
    "gpg": (
        ["algorithm.adv_estimator=gpg", "actor.policy_loss=gpg", "actor.use_kl_loss=false"],
        lambda m: True,
    ),
    # exactly on-policy: one optimizer step, so no π_old pass, and π_θ = π_old at it
    "opo": (
        ["algorithm.adv_estimator=opo", "actor.use_kl_loss=false", "actor.entropy_coef=0"],
        lambda m: m["actor/updates"] == 1 and "timing/old_logprobs" not in m and m["actor/approx_kl"] == 0,
    ),
    "kl_cov": (
        ["actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0.01", *TWO_EPOCHS],
        lambda m: m["actor/kl_cov_frac"] > 0,
    ),
    # a band that takes every token PPO did not clip: some are cut
    "clip_cov": (
        ["actor.policy_loss=clip_cov", "actor.clip_cov_lb=-100", *TWO_EPOCHS],
        lambda m: m["actor/clip_cov_frac"] > 0,
    ),
    # the best and the worst of each prompt's 4 responses, 4 prompts
    "pf_ppo": (
        ["algorithm.policy_filtration=best_worst", "rollout.n=4"],
        lambda m: m["policy_filtration/kept_rows"] == 8,
    ),
    "sppo": (
        ["algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", *TWO_EPOCHS],
        lambda m: m["actor/pg_loss"] >= 0,  # a squared error
    ),
}


@pytest.fixture(scope="module")
def colour_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("colour")
    generate(root, task="color", n_train=8, n_val=0, seed=0, image_size=56)
    return root / "train.jsonl"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_one_training_step(name: str, tmp_path: Path, tiny_model_dir: Path, colour_rows: Path) -> None:
    overrides, shows = RUNS[name]
    code = main(
        [
            "train",
            "configs/quickstart.yaml",
            f"model.path={tiny_model_dir}",
            f"data.train_files={colour_rows}",
            "data.val_files=[]",
            f"trainer.output_dir={tmp_path / 'run'}",
            *STEP,
            *overrides,
        ]
    )
    assert code == 0
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert math.isfinite(record["actor/pg_loss"]) and shows(record), record
    if TWO_EPOCHS[0] in overrides:  # the second optimizer step saw the policy move
        assert record["actor/approx_kl"] != 0
