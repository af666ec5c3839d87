"""Off-policy correction between the sampling engine and the trainer's old policy, by hand: the four
corrections' weights and metrics, and the weight reaching each token's policy gradient."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms import ROLLOUT_CORRECTIONS, get_rollout_correction
from mmrl.config import load_config
from mmrl.errors import ConfigError

# ρ = π_old/π_rollout per token: row 0 has three tokens, row 1 two and a pad whose ratio must not count.
RATIOS = [[0.6, 1.5, 3.0], [1.2, 0.4, 150.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _logps() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.full((2, 3), -1.0)
    return rollout + torch.tensor(RATIOS).log(), rollout


@pytest.mark.parametrize(
    ("name", "cap", "weights", "capped"),
    [
        ("tis", 2.0, [[0.6, 1.5, 2.0], [1.2, 0.4, 0.0]], 1 / 5),  # only ρ = 3 is truncated
        ("mis", 2.0, [[0.6, 1.5, 0.0], [1.2, 0.0, 0.0]], 2 / 5),  # 3 > 2 and 0.4 < 1/2 are dropped
        # sequence ratios: 0.6 · 1.5 · 3 = 2.7 and 1.2 · 0.4 = 0.48 (the pad's 150 left out)
        ("seq_tis", 2.0, [[2.0, 2.0, 2.0], [0.48, 0.48, 0.0]], 3 / 5),
        ("seq_mis", 2.5, [[0.0, 0.0, 0.0], [0.48, 0.48, 0.0]], 3 / 5),  # band [0.4, 2.5]: row 0 out
    ],
)
def test_corrections_by_hand(name: str, cap: float, weights: list[list[float]], capped: float) -> None:
    old, rollout = _logps()
    old.requires_grad_(True)
    got, metrics = get_rollout_correction(name)(old, rollout, MASK, cap=cap)
    assert not got.requires_grad
    torch.testing.assert_close(got, torch.tensor(weights), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(metrics["mean"]), sum(map(sum, weights)) / 5, rel_tol=1e-5)
    assert math.isclose(float(metrics["capped_frac"]), capped, rel_tol=1e-6)
    ratio_max = 3.0 if not name.startswith("seq") else 2.7
    assert math.isclose(float(metrics["ratio_max"]), ratio_max, rel_tol=1e-5)


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
def test_equal_policies_give_weight_one_and_extreme_ratios_stay_finite(name: str) -> None:
    old, _ = _logps()
    weights, metrics = get_rollout_correction(name)(old, old.clone(), MASK, cap=2.0)
    assert torch.equal(weights, MASK) and float(metrics["capped_frac"]) == 0.0
    far = old + torch.tensor([[1e4, 0.0, 0.0], [-1e4, 0.0, 0.0]])  # one token each way, far off
    weights, _ = get_rollout_correction(name)(far, old, MASK, cap=2.0)
    assert torch.isfinite(weights).all() and float(weights.max()) <= 2.0


def test_the_config_names_a_correction_and_episodes_refuse_it(tmp_path) -> None:
    quickstart = "configs/quickstart.yaml"
    assert load_config(quickstart, ["actor.rollout_correction=seq_tis"]).actor.rollout_correction == "seq_tis"
    with pytest.raises(ConfigError, match=r"actor\.rollout_correction='tiss' is not registered.*seq_tis"):
        load_config(quickstart, ["actor.rollout_correction=tiss"])
    with pytest.raises(ConfigError, match=r"rollout_correction_cap"):
        load_config(quickstart, ["actor.rollout_correction=tis", "actor.rollout_correction_cap=1.0"])
    with pytest.raises(ConfigError, match=r"episodes keep no sampling log-probs"):
        load_config("configs/vla_mujoco_reach.yaml", ["actor.rollout_correction=tis"])
