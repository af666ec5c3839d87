"""mmrl.algorithms against values worked out by hand from each paper's formula."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from algorithm_cases import GROUPS, MASK, PAD, REWARDS, SCORES, close, per_token, ppo_batch
from torch import Tensor

from mmrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    drgrpo,
    dual_clip,
    entropy_from_logits,
    get_advantage_estimator,
    get_policy_loss,
    gigpo,
    grpo,
    gspo,
    kl_penalty,
    load_from_file,
    logprobs_from_logits,
    masked_mean,
    ppo_clip,
    register_advantage_estimator,
    register_policy_loss,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)


def test_grpo_unbiased_std_by_hand() -> None:
    # group 7: mean 0.5, centred ±0.5, unbiased std = sqrt(4 · 0.25 / 3) = 0.5773503
    # → ±0.5 / 0.5773503 = ±0.8660254 (the biased std 0.5 would give ±1).
    # group of one and all-equal group → 0.
    adv, returns = grpo(REWARDS, MASK, GROUPS, eps=0.0, norm_adv_by_std=True)
    a = 0.8660254
    close(adv, per_token([a, 0.0, -a, 0.0, -a, 0.0, a]))
    close(returns, per_token(SCORES))


def test_grpo_eps_and_no_std() -> None:
    # eps adds to the std: 0.5 / (0.5773503 + 0.1) = 0.5 / 0.6773503 = 0.7381705
    adv, _ = grpo(REWARDS, MASK, GROUPS, eps=0.1)
    close(adv[0, 0], 0.7381705)
    adv, _ = grpo(REWARDS, MASK, GROUPS, norm_adv_by_std=False)
    close(adv, per_token([0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5]))


def test_grpo_all_equal_group_is_exactly_zero_even_without_eps() -> None:
    # In float32 (0.9 + 0.9 + 0.9) / 3 ≠ 0.9: a naive mean leaves ±1 ulp, which / (std + 0) inflates to ±O(1).
    rewards = torch.tensor([[0.9], [0.9], [0.9]])
    adv, _ = grpo(rewards, torch.ones(3, 1), torch.zeros(3, dtype=torch.long), eps=0.0)
    assert torch.equal(adv, torch.zeros(3, 1))


def test_drgrpo_by_hand() -> None:
    # group 7 mean 0.5 → ±0.5, no std division; norm_adv_by_std from the trainer is ignored.
    adv, returns = drgrpo(REWARDS, MASK, GROUPS, norm_adv_by_std=True, eps=1e-6)
    close(adv, per_token([0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5]))
    close(returns, per_token(SCORES))


def test_rloo_by_hand() -> None:
    # row 0: 1 − (0 + 0 + 1)/3 = 2/3 ;  row 2: 0 − (1 + 0 + 1)/3 = −2/3
    # group of one → 0 ;  all-equal group: 2 − 2/1 = 0
    adv, _ = rloo(REWARDS, MASK, GROUPS)
    third = 2.0 / 3.0
    close(adv, per_token([third, 0.0, -third, 0.0, -third, 0.0, third]))


def test_reinforce_plus_plus_by_hand() -> None:
    # γ = 0.5. row 0 rewards [0, 0, 1] → G = [0.25, 0.5, 1]; row 1 [0, −1 | pad] → G = [−0.5, −1 | 0]
    # valid G: mean = 0.25/5 = 0.05; Σ(G − mean)² = 0.04 + 0.2025 + 0.9025 + 0.3025 + 1.1025 = 2.55
    # unbiased var = 2.55/4 = 0.6375, std = 0.7984360 → A = (G − 0.05) / 0.7984360
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = reinforce_plus_plus(rewards, mask, torch.tensor([0, 0]), gamma=0.5, eps=0.0)
    close(returns, [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    close(adv, [[0.2504897, 0.5636019, 1.1898262], [-0.6888467, -1.3150710, 0.0]])


def test_reinforce_plus_plus_skips_masked_tokens_in_the_middle() -> None:
    # γ = 0.5, rewards [1, (masked 7), 2]: G_2 = 2, G_0 = 1 + 0.5 · 2 = 2 (no discount for the gap)
    rewards = torch.tensor([[1.0, 7.0, 2.0]])
    _, returns = reinforce_plus_plus(rewards, torch.tensor([[1, 0, 1]]), torch.tensor([0]), gamma=0.5)
    close(returns, [[2.0, 0.0, 2.0]])


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # centred scores per row: [0.5, 0, −0.5, 0, −0.5, 0, 0.5] over [3, 2, 1, 2, 2, 3, 3] tokens
    # tokens: six of 0.5, three of −0.5, seven of 0 → mean = (3 − 1.5)/16 = 0.09375
    # Σ dev² = 6·0.40625² + 3·0.59375² + 7·0.09375² = 0.990234 + 1.057617 + 0.061523 = 2.109375
    # unbiased var = 2.109375/15 = 0.140625 → std = 0.375
    # A: 0.40625/0.375 = 1.0833333, −0.59375/0.375 = −1.5833333, −0.09375/0.375 = −0.25
    adv, returns = reinforce_plus_plus_baseline(REWARDS, MASK, GROUPS, eps=0.0)
    hi, lo, mid = 1.0833333, -1.5833333, -0.25
    close(adv, per_token([hi, mid, lo, mid, lo, mid, hi]))
    close(returns, per_token(SCORES))


def test_remax_by_hand() -> None:
    # scores 1 and 0.5, greedy baselines 0.25 and 0.5 → 0.75 and 0
    rewards = torch.tensor([[0.0, 1.0], [0.5, PAD]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, returns = remax(rewards, mask, torch.tensor([0, 1]), baseline_scores=torch.tensor([0.25, 0.5]))
    close(adv, [[0.75, 0.75], [0.0, 0.0]])
    close(returns, [[1.0, 1.0], [0.5, 0.0]])
    with pytest.raises(ValueError, match="baseline_scores"):
        remax(rewards, mask, torch.tensor([0, 1]))


def test_gigpo_by_hand() -> None:
    # Group 0, γ = 0.5, one decision a row, its step reward on its last token:
    #   episode 10: states A, B; rewards 0, 1 -> R = 1, to-go 0.5, 1
    #   episode 11: states A, C, B; rewards 0, 0, 0 -> R = 0, to-go 0, 0, 0
    # Group 1 (episode 12, one decision) meets state "A" (id 0) too, but only its own group counts.
    # Centred only: A^E = +-0.5; step groups A: (0.5, 0) -> +-0.25, B: (1, 0) -> +-0.5, C alone -> 0.
    rewards = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, PAD], [0.0, 0.0], [0.0, 0.0], [3.0, PAD]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    groups, episodes = torch.tensor([0, 0, 0, 0, 0, 1]), torch.tensor([10, 10, 11, 11, 11, 12])
    anchors = torch.tensor([0, 1, 0, 2, 1, 0])
    kwargs = {"episode_index": episodes, "anchor_index": anchors, "gamma": 0.5, "norm_adv_by_std": False}
    adv, to_go = gigpo(rewards, mask, groups, step_weight=0.5, **kwargs)
    per_row = [0.5 + 0.125, 0.5 + 0.25, -0.5 - 0.125, -0.5, -0.5 - 0.25, 0.0]
    close(adv, [[v * m for m in row] for v, row in zip(per_row, mask.tolist(), strict=True)])
    close(to_go[:, 0], [0.5, 1.0, 0.0, 0.0, 0.0, 3.0])
    # With std (unbiased, n - 1 = 1): every pair of two values normalises to +-1/sqrt(2).
    adv, _ = gigpo(rewards, mask, groups, **{**kwargs, "norm_adv_by_std": True})
    h = 0.5**0.5
    close(adv[:, 0], [2 * h, 2 * h, -2 * h, -h, -2 * h, 0.0], atol=1e-4)
    with pytest.raises(ValueError, match="anchor_index"):
        gigpo(rewards, mask, groups, episode_index=episodes)


COMMON_KWARGS = {"eps": 1e-6, "norm_adv_by_std": True, "gamma": 1.0, "unused_option": "x"}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_masks_padding_and_takes_common_kwargs(name: str) -> None:
    fn = get_advantage_estimator(name)
    kwargs = {
        **COMMON_KWARGS,
        "baseline_scores": torch.linspace(0, 1, 7),
        "values": 0.1 * REWARDS.cos(),
        "process_rewards": 0.1 * REWARDS.sin(),
        "episode_index": torch.arange(7),
        "anchor_index": torch.zeros(7, dtype=torch.long),
    }
    adv, returns = fn(REWARDS, MASK, GROUPS, **kwargs)
    assert adv.shape == returns.shape == MASK.shape
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert (adv[MASK == 0] == 0).all() and (returns[MASK == 0] == 0).all()
    assert adv.abs().sum() > 0
    # Other junk on the padding changes nothing; a bool mask works like a float one.
    adv2, returns2 = fn(torch.where(MASK.bool(), REWARDS, -1e4), MASK.bool(), GROUPS, **kwargs)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(returns2, returns)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_give_zero_to_singletons_and_equal_groups(name: str) -> None:
    adv, _ = ADVANTAGE_ESTIMATORS[name](REWARDS, MASK, GROUPS, eps=1e-6)
    singleton_and_equal = [1, 3, 5]
    if name == "reinforce_plus_plus_baseline":  # batch whitening shifts every token by the same mean
        assert torch.unique(adv[singleton_and_equal][MASK[singleton_and_equal].bool()]).numel() == 1
    else:
        assert (adv[singleton_and_equal] == 0).all()


# ---------------------------------------------------------------- policy losses
def test_ppo_clip_asymmetric_by_hand() -> None:
    # ε_low = 0.2, ε_high = 0.3 → range [0.8, 1.3]; L = max(−Aρ, −A·clip(ρ))
    # (+1, 1.5): max(−1.5, −1.3) = −1.3   clipped (positive A, ratio above range)
    # (−1, 1.5): max( 1.5,  1.3) =  1.5   not clipped (negative A, above range: unclipped side wins)
    # (+1, 0.5): max(−0.5, −0.8) = −0.5   not clipped (positive A, below range)
    # (−1, 0.5): max( 0.5,  0.8) =  0.8   clipped (negative A, ratio below range)
    # (+2, 1.0): −2
    # (+1, 1.25): −1.25                   inside [0.8, 1.3] thanks to clip-higher
    # token-mean = (−1.3 + 1.5 − 0.5 + 0.8 − 2 − 1.25) / 6 = −2.75 / 6 = −0.4583333
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = ppo_clip(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3)
    close(loss, -0.4583333)
    close(metrics["clip_frac"], 2 / 6)
    # approx_kl = mean(−log ρ) = −(2 ln 1.5 + 2 ln 0.5 + ln 1.25) / 6 = 0.0587034
    close(metrics["approx_kl"], 0.0587034)
    # ∂L/∂logp_t = −A ρ / 6 where unclipped, exactly 0 where clipped and on padding
    loss.backward()
    close(logp.grad, [[0.0, 1.5 / 6, -0.5 / 6, 0.0], [0.0, -2.0 / 6, -1.25 / 6, 0.0]])


def test_ppo_clip_symmetric_clips_what_clip_higher_lets_through() -> None:
    # ε_high = 0.2 → range [0.8, 1.2]: (+1, ρ=1.5) → −1.2 and (+1, ρ=1.25) is now clipped too → −1.2
    # token-mean = (−1.2 + 1.5 − 0.5 + 0.8 − 2 − 1.2) / 6 = −2.6 / 6 = −0.4333333
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = ppo_clip(logp, old_logp, adv, mask)
    close(loss, -0.4333333)
    close(metrics["clip_frac"], 3 / 6)
    loss.backward()
    assert logp.grad[1, 2] == 0


def test_dual_clip_by_hand() -> None:
    # c = 3, ε = 0.2 → PPO loss then, for A < 0, min(L, 3·|A|):
    # (−1, ρ=4):    PPO max(4, 1.2) = 4 → capped at 3     (gradient 0)
    # (−1, ρ=2):    PPO 2 < 3 → 2                          (∂/∂logp = ρ/4 = 0.5)
    # (+1, ρ=4):    PPO clipped: −1.2, no cap for A > 0     (gradient 0)
    # (+2, ρ=0.25): PPO max(−0.5, −1.6) = −0.5             (∂/∂logp = −2·0.25/4 = −0.125)
    # token-mean = (3 + 2 − 1.2 − 0.5) / 4 = 0.825; plain PPO would be (4 + 2 − 1.2 − 0.5)/4 = 1.075
    ratios = torch.tensor([[4.0, 2.0, 4.0, 0.25]])
    old_logp = torch.zeros(1, 4)
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, metrics = dual_clip(logp, old_logp, adv, mask, clip_ratio_c=3.0)
    close(loss, 0.825)
    close(metrics["dual_clip_frac"], 0.25)
    close(metrics["clip_frac"], 0.25)
    loss.backward()
    close(logp.grad, [[0.0, 0.5, 0.0, -0.125]])
    close(ppo_clip(logp, old_logp, adv, mask)[0], 1.075)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        dual_clip(logp, old_logp, adv, mask, clip_ratio_c=1.0)


def gspo_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # row 0: log ρ = [0.1, 0.3 | pad 5.0] → s_0 = exp(0.2) = 1.2214028, A = +1
    # row 1: log ρ = [−0.4 | pad, pad]    → s_1 = exp(−0.4) = 0.6703200, A = −1
    old_logp = torch.full((2, 3), -2.0)
    logp = (old_logp + torch.tensor([[0.1, 0.3, 5.0], [-0.4, 5.0, 5.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logp, old_logp, adv, mask


def test_gspo_sequence_ratio_by_hand() -> None:
    # range [0.5, 1.5] holds both s_i: L = −A s_i on every token of sequence i
    # token-mean = (−1.2214028 · 2 + 0.6703200) / 3 = −0.5908285
    # ∂/∂logp_t = −A s_i / 3 on each token: −0.4071343 (row 0), +0.2234400 (row 1).
    # Per-token PPO would give row 0 different values: −exp(0.1)/3 = −0.368, −exp(0.3)/3 = −0.450.
    logp, old_logp, adv, mask = gspo_batch()
    loss, metrics = gspo(logp, old_logp, adv, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)
    close(loss, -0.5908285)
    close(metrics["clip_frac"], 0.0)
    loss.backward()
    close(logp.grad, [[-0.4071343, -0.4071343, 0.0], [0.2234400, 0.0, 0.0]])


def test_gspo_token_gradient_follows_each_tokens_advantage() -> None:
    # GSPO-token with row 0 advantages [1, 3]: value −A_t s_0, gradient −A_t s_0 / 3 per token
    # loss = (−1.2214028 − 3 · 1.2214028 + 0.6703200) / 3 = −4.2152910 / 3 = −1.4050970
    # ∂/∂logp: −1.2214028/3 = −0.4071343, −3 · 1.2214028/3 = −1.2214028, row 1 +0.2234400
    # (differentiating s_0 itself would spread the weights evenly: −2 · 1.2214028/3 on both tokens)
    logp, old_logp, adv, mask = gspo_batch()
    adv[0, 1] = 3.0
    loss, _ = gspo(logp, old_logp, adv, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)
    close(loss, -1.4050970)
    loss.backward()
    close(logp.grad, [[-0.4071343, -1.2214028, 0.0], [0.2234400, 0.0, 0.0]])


def test_gspo_seq_mean_token_mean_matches_sequence_level_gspo() -> None:
    # (1/G) Σ_i −A_i s_i = (−1.2214028 + 0.6703200) / 2 = −0.2755414
    # ∂/∂logp_t = −A s_i / (|y_i| · G): row 0 −1.2214028/4 = −0.3053507, row 1 0.6703200/2 = 0.3351600
    logp, old_logp, adv, mask = gspo_batch()
    clip = {"clip_ratio_low": 0.5, "clip_ratio_high": 0.5}
    loss, _ = gspo(logp, old_logp, adv, mask, **clip, loss_agg_mode="seq-mean-token-mean")
    close(loss, -0.2755414)
    loss.backward()
    close(logp.grad, [[-0.3053507, -0.3053507, 0.0], [0.3351600, 0.0, 0.0]])


def test_gspo_clips_whole_sequences_with_tiny_ranges() -> None:
    # range [1 − 3e-4, 1 + 4e-4] = [0.9997, 1.0004]
    # row 0: A > 0, s = 1.2214 above → −1.0004 per token, clipped
    # row 1: A < 0, s = 0.6703 below → +0.9997, clipped
    # row 2: A < 0, s = exp(0.2) = 1.2214 above → unclipped side wins: +1.2214028
    # token-mean = (−1.0004 · 2 + 0.9997 + 1.2214028) / 4 = 0.2203028 / 4 = 0.0550757
    logp, old_logp, adv, mask = gspo_batch()
    logp = torch.cat([logp.detach(), torch.tensor([[-1.8, 0.0, 0.0]])]).requires_grad_(True)
    old_logp = torch.cat([old_logp, torch.tensor([[-2.0, 0.0, 0.0]])])
    adv = torch.cat([adv, torch.tensor([[-1.0, 0.0, 0.0]])])
    mask = torch.cat([mask, torch.tensor([[1, 0, 0]])])
    loss, metrics = gspo(logp, old_logp, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    close(loss, 0.0550757)
    close(metrics["clip_frac"], 3 / 4)
    loss.backward()
    assert (logp.grad[:2] == 0).all() and logp.grad[2, 0] != 0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses_ignore_padding_and_extra_kwargs(name: str) -> None:
    logp, old_logp, adv, mask = ppo_batch()
    kwargs = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "temperature": 1.0}
    loss, metrics = POLICY_LOSSES[name](logp, old_logp, adv, mask, **kwargs)
    junk_logp = torch.where(mask.bool(), logp.detach(), -7.0)
    junk_adv = torch.where(mask.bool(), adv, -123.0)
    loss2, metrics2 = POLICY_LOSSES[name](junk_logp, old_logp, junk_adv, mask, **kwargs)
    torch.testing.assert_close(loss2, loss.detach())
    torch.testing.assert_close(metrics2, metrics)
    assert {"clip_frac", "approx_kl"} <= metrics.keys()


def test_policy_loss_forwards_agg_kwargs() -> None:
    # seq-mean-token-sum with num_seqs = 4: (Σ row 0 + Σ row 1) / 4 = (−0.3 + −2.45) / 4 = −0.6875
    # row 0 (ε_high 0.3): −1.3 + 1.5 − 0.5 = −0.3 ; row 1: 0.8 − 2 − 1.25 = −2.45
    logp, old_logp, adv, mask = ppo_batch()
    loss, _ = ppo_clip(
        logp,
        old_logp,
        adv,
        mask,
        clip_ratio_high=0.3,
        loss_agg_mode="seq-mean-token-sum",
        agg_kwargs={"num_seqs": 4},
    )
    close(loss, -0.6875)


# ---------------------------------------------------------------- aggregation
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, PAD, PAD], [PAD, PAD, PAD]])
AGG_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 is all padding: not a sequence


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("seq-mean-token-mean", {}, 3.0),  # (6/3 + 4/1) / 2
        ("seq-mean-token-sum", {}, 5.0),  # (6 + 4) / 2
        ("seq-mean-token-sum-norm", {"horizon": 4}, 1.25),  # (6/4 + 4/4) / 2
        ("token-mean", {"num_tokens": 8}, 1.25),  # 10 / 8
        ("seq-mean-token-mean", {"num_seqs": 4}, 1.5),  # (2 + 4) / 4
        ("seq-mean-turn-mean", {}, 3.0),  # one turn a row: seq-mean-token-mean's
    ],
)
def test_agg_loss_by_hand(mode: str, kwargs: dict, expected: float) -> None:
    close(agg_loss(VALUES, AGG_MASK, mode, **kwargs), expected)


def test_turn_mean_weighs_each_turn_of_a_trajectory_alike() -> None:
    """An agent's rows: a call, a masked tool reply, an answer. Row 0 has turns (1, 2) and (5): (1.5 + 5) / 2;
    row 1 turns (8, 9, 10) and (12): (9 + 12) / 2; the padding and the replies (PAD) never leak in."""
    values = torch.tensor([[1.0, 2.0, PAD, PAD, 5.0, PAD], [PAD, 8.0, 9.0, 10.0, PAD, 12.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 1]])
    close(agg_loss(values, mask, "seq-mean-turn-mean"), (3.25 + 10.5) / 2)
    close(agg_loss(values, mask, "seq-mean-turn-mean", num_seqs=4), (3.25 + 10.5) / 4)
    # per token within each row, row 1's 3-token call outweighs its 1-token answer 3 to 1
    close(agg_loss(values, mask, "seq-mean-token-mean"), (8 / 3 + 39 / 4) / 2)


def test_agg_loss_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(VALUES, AGG_MASK, "sum")
    with pytest.raises(ValueError, match="horizon"):
        agg_loss(VALUES, AGG_MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_losses_sum_to_the_mini_batch_loss(mode: str) -> None:
    # rows of length 4, 1, 3, 2 split into micro-batches [0, 1] and [2, 3] (different padded widths)
    values = torch.arange(1.0, 17.0).reshape(4, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    counts = {"num_tokens": 10, "num_seqs": 4, "horizon": 4}
    full = agg_loss(values, mask, mode, horizon=4)
    micro = [(values[:2], mask[:2]), (values[2:, :3], mask[2:, :3])]
    summed = sum(agg_loss(v, m, mode, **counts) for v, m in micro)
    torch.testing.assert_close(summed, full)
    # normalising each micro-batch by its own counts breaks the property
    local = sum(agg_loss(v, m, mode, horizon=4) for v, m in micro)
    assert not torch.isclose(local, full)


# ---------------------------------------------------------------- KL
LOGP = torch.tensor([[0.0, -1.0, 0.0, -100.0, -0.5]])
REF = torch.tensor([[-1.0, 0.0, -100.0, 0.0, -0.5]])


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        # logp − ref
        (("k1", "kl"), [1.0, -1.0, 100.0, -100.0, 0.0]),
        (("abs",), [1.0, 1.0, 100.0, 100.0, 0.0]),
        # ½ (logp − ref)²
        (("k2", "mse"), [0.5, 0.5, 5000.0, 5000.0, 0.0]),
        # r = ref − logp: e^−1 − (−1) − 1 = 0.3678794 ; e^1 − 1 − 1 = 0.7182818
        # r = −100 → clamp −20: e^−20 + 20 − 1 = 19.0 → clamp 10 ; r = 100 → 20: e^20 − 21 → clamp 10
        (("k3", "low_var_kl"), [0.3678794, 0.7182818, 10.0, 10.0, 0.0]),
    ],
)
def test_kl_kinds_by_hand(kinds: tuple[str, ...], expected: list[float]) -> None:
    for kind in kinds:
        close(kl_penalty(LOGP, REF, kind), [expected])


def test_k3_is_nonnegative_and_zero_on_equal_policies() -> None:
    gen = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(64, 32, generator=gen) * 3, torch.randn(64, 32, generator=gen) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))


def test_unknown_kl_kind_lists_choices() -> None:
    with pytest.raises(KeyError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
    assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"} <= KL_ESTIMATORS.keys()


# ---------------------------------------------------------------- logits
def test_entropy_uniform_is_log_v_even_for_huge_logits() -> None:
    # ln 7 = 1.9459101; float32 spacing at 1000 is 6e-5, hence the tolerance
    close(entropy_from_logits(torch.full((2, 3, 7), 1000.0)), [[1.9459101] * 3] * 2, atol=2e-4)


def test_entropy_by_hand_and_stable_when_peaked() -> None:
    # logits [0, ln 3] → p = [1/4, 3/4]: H = ¼ ln 4 + ¾ ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    close(entropy_from_logits(torch.tensor([0.0, math.log(3.0)])), 0.5623351)
    # p ≈ [e^−200, 1]: naive −Σ p log p hits 0 · log 0 = NaN; the true value is ≈ 0
    close(entropy_from_logits(torch.tensor([0.0, 200.0])), 0.0)


def test_logprobs_by_hand_with_gradient() -> None:
    # logits [0, ln 3] + 100 (shift-invariant): log p = [ln ¼, ln ¾] = [−1.3862944, −0.2876821]
    logits = (torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]]) + 100.0).requires_grad_(True)
    logp = logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    close(logp, [[-0.2876821, -1.3862944]])
    # ∂ log p_y / ∂z = onehot(y) − p
    logp.sum().backward()
    close(logits.grad, [[[-0.25, 0.25], [0.75, -0.75]]])


def test_logprobs_half_precision_goes_through_float32() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]] * 3, [[math.log(3.0), 0.0]] * 3], dtype=torch.bfloat16)
    logp = logprobs_from_logits(logits.requires_grad_(True), torch.tensor([[1, 0, 1], [1, 0, 1]]))
    assert logp.dtype == torch.float32
    # ln 3 rounds to 1.1015625 in bfloat16, so compare loosely
    close(logp, [[-0.2876821, -1.3862944, -0.2876821], [-1.3862944, -0.2876821, -1.3862944]], atol=5e-3)
    logp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def test_masked_mean_ignores_non_finite_padding() -> None:
    close(masked_mean(torch.tensor([[1.0, 3.0, -math.inf]]), torch.tensor([[1, 1, 0]])), 2.0)


# ---------------------------------------------------------------- registries
def test_unknown_names_list_choices_and_how_to_add() -> None:
    with pytest.raises(KeyError, match=r"grpo.*register_advantage_estimator.*\.py:function"):
        get_advantage_estimator("grpo_typo")
    with pytest.raises(KeyError, match=r"gspo.*register_policy_loss.*\.py:function"):
        get_policy_loss("ppo")
    assert get_advantage_estimator("rloo") is rloo
    assert get_policy_loss("dual_clip") is dual_clip


def test_register_custom_functions_and_refuse_duplicates() -> None:
    try:

        @register_advantage_estimator("test_zero", "test_zero_alias")
        def zero(token_rewards: Tensor, response_mask: Tensor, group_index: Tensor, **kwargs: object):
            return torch.zeros_like(token_rewards), torch.zeros_like(token_rewards)

        assert get_advantage_estimator("test_zero") is zero is get_advantage_estimator("test_zero_alias")
        with pytest.raises(ValueError, match="grpo"):
            register_advantage_estimator("grpo")(zero)
        with pytest.raises(ValueError, match="ppo_clip"):
            register_policy_loss("ppo_clip_2", "ppo_clip")(zero)
        assert "ppo_clip_2" not in POLICY_LOSSES  # nothing registered when one name is taken
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_zero", None)
        ADVANTAGE_ESTIMATORS.pop("test_zero_alias", None)


def test_load_from_file(tmp_path: Path) -> None:
    source = tmp_path / "my_adv.py"
    source.write_text("def double(x):\n    return 2 * x\n\nVALUE = 3\n")
    assert load_from_file(f"{source}:double")(21) == 42
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        load_from_file(f"{tmp_path / 'missing.py'}:double")
    with pytest.raises(AttributeError, match=r"no 'triple'.*double"):
        load_from_file(f"{source}:triple")
    with pytest.raises(TypeError, match="VALUE"):
        load_from_file(f"{source}:VALUE")
    with pytest.raises(ValueError, match=r"path/to/file\.py:function"):
        load_from_file(str(source))
