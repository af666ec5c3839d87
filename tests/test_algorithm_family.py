"""DAPO's group filter and overlong shaping, the KL reward penalty and its controllers,
and `concat` of rollout batches, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    informative_groups,
    kl_reward_penalty,
    overlong_penalty,
)
from mmrl.data.batch import Batch, concat


def test_informative_groups_drops_all_equal_groups_and_singletons() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    group = torch.tensor([7, 7, 7, 3, 3, 3, 5, 5, 9])  # ids need not be dense or sorted
    kept = informative_groups(scores, group)
    assert kept.tolist() == [False, False, False, True, True, True, False, False, False]


def test_informative_groups_tolerance() -> None:
    scores = torch.tensor([0.1, 0.1 + 1e-7, 0.0, 0.3])
    group = torch.tensor([0, 0, 1, 1])
    assert informative_groups(scores, group).tolist() == [True, True, True, True]
    assert informative_groups(scores, group, atol=1e-6).tolist() == [False, False, True, True]


def test_overlong_penalty_is_zero_then_linear_then_capped() -> None:
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -(L - 6)/4 * factor, -factor at 10.
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    penalty = overlong_penalty(lengths, max_len=10, buffer_len=4, factor=0.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_overlong_penalty_rejects_a_buffer_longer_than_the_budget() -> None:
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5, factor=1.0)


def test_kl_reward_penalty_is_minus_beta_k1_on_valid_tokens() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, float("-inf")]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    reward, kl = kl_reward_penalty(old, ref, mask, "k1", kl_coef=0.1)
    # k1 = old − ref: row 0 → [0.5, −1, 0], row 1 → [1, 0, (padding)]
    torch.testing.assert_close(reward, torch.tensor([[-0.05, 0.1, 0.0], [-0.1, 0.0, 0.0]]))
    # batch KL = mean over rows of per-row token means: ((0.5 − 1 + 0)/3 + (1 + 0)/2) / 2
    assert kl == pytest.approx((-0.5 / 3 + 0.5) / 2)


def test_fixed_kl_controller_never_moves() -> None:
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=256)
    assert ctrl.value == 0.05


def test_adaptive_kl_controller_follows_ziegler_update() -> None:
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=0.2, horizon=1000)
    ctrl.update(current_kl=0.25, n_steps=100)  # error 0.25/0.2 − 1 = 0.25, clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctrl.update(current_kl=0.19, n_steps=100)  # error −0.05, inside the clip
    assert ctrl.value == pytest.approx(0.1 * 1.02 * (1 - 0.05 * 0.1))
    ctrl.update(current_kl=0.0, n_steps=500)  # error −1, clipped to −0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.995 * (1 - 0.2 * 0.5))
    assert math.isfinite(ctrl.value)


def test_concat_shifts_prompt_index_and_pads_token_columns() -> None:
    a = Batch(
        tensors={
            "prompt_index": torch.tensor([0, 0, 1, 1]),
            "response_mask": torch.ones(4, 2, dtype=torch.long),
            "scores": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        },
        lists={"response_text": ["a", "b", "c", "d"]},
        prompts=["p0", "p1"],
    )
    b = Batch(
        tensors={
            "prompt_index": torch.tensor([1, 1]),
            "response_mask": torch.ones(2, 3, dtype=torch.long),
            "scores": torch.tensor([0.0, 1.0]),
        },
        lists={"response_text": ["e", "f"]},
        prompts=["q0", "q1"],
    )
    merged = concat([a.select([0, 1]), b])
    assert merged.prompts == ["p0", "p1", "q0", "q1"]
    assert merged["prompt_index"].tolist() == [0, 0, 3, 3]
    assert [merged.prompts[i] for i in merged["prompt_index"].tolist()] == ["p0", "p0", "q1", "q1"]
    assert merged["response_mask"].tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert merged["response_text"] == ["a", "b", "e", "f"]
    assert merged["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
