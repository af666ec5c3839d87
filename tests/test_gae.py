"""GAE and PPO's clipped value loss against values worked out by hand from the formulas."""

from __future__ import annotations

import statistics

import pytest
import torch

from mmrl.algorithms import clipped_value_loss, gae, get_advantage_estimator

# Row 0: three tokens, reward 1 on the last; row 1: two tokens, reward -1, then padding whose
# junk rewards and values must not leak in.
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 5.0]])
VALUES = torch.tensor([[0.5, 0.6, 0.8], [0.2, -0.4, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_gae_matches_the_recursion_by_hand() -> None:
    # γ = 0.9, λ = 0.5, so γλ = 0.45; V after the last valid token is 0.
    # row 0: δ2 = 1 − 0.8 = 0.2;  δ1 = 0.9·0.8 − 0.6 = 0.12;  δ0 = 0.9·0.6 − 0.5 = 0.04
    #        Â2 = 0.2;  Â1 = 0.12 + 0.45·0.2 = 0.21;  Â0 = 0.04 + 0.45·0.21 = 0.1345
    # row 1: δ1 = −1 + 0.4 = −0.6;  δ0 = 0.9·(−0.4) − 0.2 = −0.56
    #        Â1 = −0.6;  Â0 = −0.56 + 0.45·(−0.6) = −0.83
    raw = [0.1345, 0.21, 0.2, -0.83, -0.6]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    whitened = [(a - mean) / (std + 1e-6) for a in raw]
    advantages, returns = gae(REWARDS, MASK, torch.arange(2), values=VALUES, gamma=0.9, lam=0.5)
    expected_adv = torch.tensor([whitened[:3], [*whitened[3:], 0.0]])
    torch.testing.assert_close(advantages, expected_adv, rtol=0, atol=1e-5)
    # R = Â + V on valid tokens, 0 on padding.
    expected_returns = torch.tensor([[0.6345, 0.81, 1.0], [-0.63, -1.0, 0.0]])
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-6)


def test_gae_with_lambda_one_is_return_minus_value() -> None:
    _, returns = gae(REWARDS, MASK, torch.arange(2), values=VALUES, gamma=1.0, lam=1.0)
    # λ = γ = 1: Â_t = (Σ rewards from t) − V_t, so R_t is the undiscounted return-to-go.
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    _, returns = gae(REWARDS, MASK, torch.arange(2), values=VALUES, gamma=1.0, lam=0.0)
    # λ = 0: Â_t = δ_t, so R_t = r_t + V_{t+1} (the TD target).
    torch.testing.assert_close(returns, torch.tensor([[0.6, 0.8, 1.0], [-0.4, -1.0, 0.0]]))


def test_gae_needs_values_of_the_right_shape() -> None:
    with pytest.raises(ValueError, match="values"):
        gae(REWARDS, MASK, torch.arange(2))
    with pytest.raises(ValueError, match="shape"):
        gae(REWARDS, MASK, torch.arange(2), values=VALUES[:, :2])
    assert get_advantage_estimator("gae") is gae


def test_gae_of_a_batch_of_one_token_is_zero_not_nan() -> None:
    advantages, returns = gae(torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1), values=torch.zeros(1, 1))
    assert advantages.item() == 0.0  # nothing to compare against after whitening
    assert returns.item() == 1.0


def test_clipped_value_loss_by_hand_and_its_gradient() -> None:
    # token 0: V moved 1.0 from V_old = 0, clipped to 0.5: (0.5 − 2)² = 2.25 > (1 − 2)² = 1, so the
    #          clipped error wins and no gradient flows;
    # token 1: V moved 0.1 (inside ε): both errors are (2 − 0)² = 4;
    # token 2: padding with junk.
    values = torch.tensor([[1.0, 2.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 1.9, -50.0]])
    returns = torch.tensor([[2.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0) / 2)
    assert metrics["vf_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dV of ½·(V − R)²/2 at token 1 is (2 − 0)/2 = 1; the clipped token and the padding get 0.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0, 0.0]]))


def test_clipped_value_loss_clips_on_both_sides() -> None:
    values = torch.tensor([[-1.0]], requires_grad=True)  # moved −1 from 0, towards R = −3
    loss, metrics = clipped_value_loss(values, torch.zeros(1, 1), torch.full((1, 1), -3.0), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.5 * 2.5**2)  # the clipped prediction −0.5 is 2.5 away
    assert metrics["vf_clip_frac"].item() == 1.0
