"""The algorithms of issue 52 (CISPO, SAPO, GMPO, GPG, OPO, KL-Cov, Clip-Cov, PF-PPO, SPPO) against values
worked out by hand from each paper's formula, on small batches with padding, uneven groups, a group of
one and an all-equal group."""

from __future__ import annotations

import pytest
import torch
from algorithm_cases import GROUPS, MASK, PAD, REWARDS, SCORES, close, per_token, ppo_batch
from torch import Tensor

from mmrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_FILTERS,
    POLICY_LOSSES,
    best_of_n,
    best_random,
    best_worst,
    cispo,
    clip_cov,
    get_policy_filter,
    gmpo,
    gpg,
    gpg_loss,
    kl_cov,
    needs_of,
    opo,
    ppo_clip,
    sapo,
    sppo,
    sppo_loss,
)


def test_gpg_corrects_for_groups_without_signal_by_hand() -> None:
    # B = 7 rows; the group of one (row 1) and the all-equal group (rows 3, 5) carry no signal: M = 3
    # α = B / (B − M) = 7 / 4 = 1.75; group 7: mean 0.5, F_norm = 1 → ±0.5 · 1.75 = ±0.875
    adv, returns = gpg(REWARDS, MASK, GROUPS, norm_adv_by_std=True)
    a = 0.875
    close(adv, per_token([a, 0.0, -a, 0.0, -a, 0.0, a]))
    close(returns, per_token(SCORES))
    # without silent groups α = 1: plain group-centred scores (±0.5), not GRPO's ±0.866
    only_group_7 = [0, 2, 4, 6]
    adv, _ = gpg(REWARDS[only_group_7], MASK[only_group_7], GROUPS[only_group_7])
    close(adv[:, 0], [0.5, -0.5, -0.5, 0.5])
    # a batch with no signal at all: 0 everywhere, never NaN
    silent = [1, 3, 5]
    adv, _ = gpg(REWARDS[silent], MASK[silent], GROUPS[silent])
    assert torch.equal(adv, torch.zeros_like(adv))


def test_opo_length_weighted_baseline_by_hand() -> None:
    # group 7: b = (3·1 + 1·0 + 2·0 + 3·1) / (3 + 1 + 2 + 3) = 6/9 = 0.6666667
    #   → 1 − 2/3 = 1/3 (rows 0, 6), 0 − 2/3 = −2/3 (rows 2, 4); the plain mean 0.5 would give ±0.5
    # group of one → 0; all-equal group (lengths 2, 3): b = (2·2 + 3·2)/5 = 2 → 0
    adv, returns = opo(REWARDS, MASK, GROUPS)
    third = 1.0 / 3.0
    close(adv, per_token([third, 0.0, -2 * third, 0.0, -2 * third, 0.0, third]))
    close(returns, per_token(SCORES))


def test_opo_all_equal_group_is_exactly_zero() -> None:
    # 0.9 weighted by lengths 1, 2, 4: a naive Σ l s / Σ l leaves ±1 ulp; the shifted scores do not
    rewards = torch.tensor([[0.9, PAD, PAD, PAD], [0.0, 0.9, PAD, PAD], [0.0, 0.0, 0.0, 0.9]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv, _ = opo(rewards, mask, torch.zeros(3, dtype=torch.long))
    assert torch.equal(adv, torch.zeros_like(adv))


def test_sppo_win_rate_target_by_hand() -> None:
    # η = 2. P̂_i = 1/n Σ_j (1[s_i > s_j] + ½·1[s_i = s_j]), j over the whole group, i itself included.
    # group 7 (1, 0, 0, 1): s = 1 → (½ + 1 + 1 + ½)/4 = 0.75 → 2·0.25 = 0.5 ; s = 0 → (0 + ½ + ½ + 0)/4 = 0.25 → −0.5
    # group of one: P̂ = ½/1 → 0 ; all-equal group: (½ + ½)/2 → 0
    adv, returns = sppo(REWARDS, MASK, GROUPS, eta=2.0)
    close(adv, per_token([0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5]))
    close(returns, per_token(SCORES))
    # win rates are ranks, not distances: scores 3, 1, 1, 0 →
    #   3: (½ + 1 + 1 + 1)/4 = 0.875 → 2·0.375 = 0.75 ; 1: (0 + ½ + ½ + 1)/4 = 0.5 → 0 ; 0: (0 + 0 + 0 + ½)/4 = 0.125 → −0.75
    # (mean-centring would give 1.75, −0.25, −0.25, −1.25)
    adv, _ = sppo(torch.tensor([[3.0], [1.0], [1.0], [0.0]]), torch.ones(4, 1), torch.zeros(4), eta=2.0)
    close(adv[:, 0], [0.75, 0.0, 0.0, -0.75])


@pytest.mark.parametrize("name", ["gpg", "opo", "sppo"])
def test_new_group_estimators_give_zero_to_singletons_and_equal_groups(name: str) -> None:
    adv, _ = ADVANTAGE_ESTIMATORS[name](REWARDS, MASK, GROUPS)
    assert (adv[[1, 3, 5]] == 0).all()
    assert needs_of(ADVANTAGE_ESTIMATORS[name]).groups


# ---------------------------------------------------------------- policy losses
def test_cispo_keeps_every_tokens_gradient_by_hand() -> None:
    # range [0.8, 1.3]: weights w = sg(clip ρ) = 1.3, 1.3, 0.8 | 0.8, 1.0, 1.25; L_t = −w·A·log π
    #   −1.3·1·(−0.5945349) = 0.7728954 ; −1.3·(−1)·(−0.5945349) = −0.7728954 ; −0.8·1·(−1.6931472) = 1.3545178
    #   −0.8·(−1)·(−1.6931472) = −1.3545178 ; −1·2·(−1) = 2 ; −1.25·1·(−0.7768564) = 0.9710705
    # token-mean = 2.9710705 / 6 = 0.4951784
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = cispo(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3)
    close(loss, 0.4951784)
    close(metrics["clip_frac"], 4 / 6)  # four weights capped, yet none loses its gradient
    # ∂L/∂log π_t = −w·A/6: the weight is a constant, and tokens PPO clips (ρ 1.5 with A > 0, ρ 0.5 with
    # A < 0) keep theirs: −1.3/6, +1.3/6, −0.8/6 | +0.8/6, −2/6, −1.25/6
    loss.backward()
    close(logp.grad, [[-0.2166667, 0.2166667, -0.1333333, 0.0], [0.1333333, -0.3333333, -0.2083333, 0.0]])
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo_clip(ppo_logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3)[0].backward()
    assert ppo_logp.grad[0, 0] == 0 and ppo_logp.grad[1, 0] == 0  # the two tokens PPO drops


def test_sapo_soft_gate_by_hand() -> None:
    # τ_pos = 1, τ_neg = 2; f(ρ) = σ(τ(ρ − 1))·4/τ, L_t = −f·A
    #   (+1, 1.5, τ 1): σ(0.5) = 0.6224593, f = 2.4898373, L = −2.4898373
    #   (−1, 1.5, τ 2): σ(1) = 0.7310586, f = 1.4621172, L = +1.4621172
    #   (+1, 0.5, τ 1): σ(−0.5) = 0.3775407, f = 1.5101627, L = −1.5101627
    #   (−1, 0.5, τ 2): σ(−1) = 0.2689414, f = 0.5378828, L = +0.5378828
    #   (+2, 1.0, τ 1): σ(0) = ½, f = 2, L = −4
    #   (+1, 1.25, τ 1): σ(0.25) = 0.5621765, f = 2.2487060, L = −2.2487060
    # token-mean = −8.2487060 / 6 = −1.3747843
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = sapo(logp, old_logp, adv, mask, tau_pos=1.0, tau_neg=2.0)
    close(loss, -1.3747843)
    close(metrics["clip_frac"], 0.0)
    # ∂L/∂log π = −A·w/6 with w = 4σ(1 − σ)·ρ:
    #   4·0.6224593·0.3775407·1.5 = 1.4100223 → −0.2350037 ; 4·0.7310586·0.2689414·1.5 = 1.1796716 → +0.1966119
    #   4·0.3775407·0.6224593·0.5 = 0.4700074 → −0.0783346 ; 4·0.2689414·0.7310586·0.5 = 0.3932239 → +0.0655373
    #   on-policy 4·¼·1 = 1 → −2/6 = −0.3333333 (the plain policy gradient) ; 4·0.5621765·0.4378235·1.25 = 1.2306704 → −0.2051117
    # PPO gives 0 to the first and fourth, the full −Aρ/6 to the others: SAPO fades, it does not cut.
    loss.backward()
    close(logp.grad, [[-0.2350037, 0.1966119, -0.0783346, 0.0], [0.0655373, -0.3333333, -0.2051117, 0.0]])


def test_sapo_temperature_follows_the_advantages_sign() -> None:
    # A > 0 sees τ_pos, A = 0 τ_neg (its loss is 0 either way):
    # ρ = e^0.4 = 1.4918247, τ_pos = 3: f = σ(3·0.4918247)·4/3 = σ(1.4754741)·4/3 = 0.8138880·4/3 = 1.0851840
    # (with τ_neg = 0.5 it would be σ(0.2459124)·8 = 4.4893612, a loss of −2.24)
    logp = torch.tensor([[0.4, 0.4]], requires_grad=True)
    loss, _ = sapo(
        logp, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), torch.ones(1, 2), tau_pos=3.0, tau_neg=0.5
    )
    close(loss, -1.0851840 / 2)


def gmpo_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # row 0: log ρ = [0.1, 0.5 | pad], A = +1 ; row 1: log ρ = [−0.6, 0.2 | pad], A = −1 ; row 2: [0.3 | pad pad], A = 0
    old_logp = torch.full((3, 3), -2.0)
    log_ratio = torch.tensor([[0.1, 0.5, 9.0], [-0.6, 0.2, 9.0], [0.3, 9.0, 9.0]])
    logp = (old_logp + log_ratio).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, PAD], [-1.0, -1.0, PAD], [0.0, PAD, PAD]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    return logp, old_logp, adv, mask


def test_gmpo_geometric_mean_clipped_in_log_space_by_hand() -> None:
    # ε = 0.4 in log space. m_t = min(log ρ, clip(log ρ)) for A > 0, max for A < 0:
    #   row 0: min(0.1, 0.1) = 0.1, min(0.5, 0.4) = 0.4 (clipped) → mean 0.25 → L_0 = −1·e^0.25 = −1.2840254
    #   row 1: max(−0.6, −0.4) = −0.4 (clipped), max(0.2, 0.2) = 0.2 → mean −0.1 → L_1 = +1·e^−0.1 = 0.9048374
    #   row 2: A = 0 → 0
    # mean over 3 sequences = (−1.2840254 + 0.9048374) / 3 = −0.1263960
    # (the arithmetic mean of clipped token ratios, GRPO's, gives row 0 −(1.1052 + 1.4918)/2 = −1.2985)
    logp, old_logp, adv, mask = gmpo_batch()
    loss, metrics = gmpo(logp, old_logp, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    close(loss, -0.1263960)
    close(metrics["clip_frac"], 2 / 5)
    # ∂L_i/∂log π_t = −A_i·e^{mean m}/|y_i| on unclipped tokens, over 3 sequences:
    #   row 0 token 0: −1.2840254/2/3 = −0.2140042 ; row 1 token 1: +0.9048374/2/3 = 0.1508062 ; clipped: 0
    loss.backward()
    close(logp.grad, [[-0.2140042, 0.0, 0.0], [0.0, 0.1508062, 0.0], [0.0, 0.0, 0.0]])


def test_gmpo_ignores_loss_agg_mode_but_not_num_seqs() -> None:
    logp, old_logp, adv, mask = gmpo_batch()
    clip = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    loss, _ = gmpo(logp, old_logp, adv, mask, loss_agg_mode="token-mean", agg_kwargs={"num_seqs": 6}, **clip)
    close(loss, -0.3791880 / 6)


def test_gpg_loss_is_the_plain_policy_gradient_by_hand() -> None:
    # L_t = −A·log π: 0.5945349 − 0.5945349 + 1.6931472 − 1.6931472 + 2 + 0.7768564 = 2.7768564 → /6 = 0.4628094
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = gpg_loss(logp, old_logp, adv, mask)
    close(loss, 0.4628094)
    close(metrics["clip_frac"], 0.0)
    # ∂/∂log π = −A/6 whatever the ratio: −1/6, 1/6, −1/6 | 1/6, −2/6, −1/6
    loss.backward()
    s = 1 / 6
    close(logp.grad, [[-s, s, -s, 0.0], [s, -2 * s, -s, 0.0]])


def test_sppo_loss_regresses_the_sequence_log_ratio_by_hand() -> None:
    # row 0: log ρ = [0.1, 0.3 | pad] → Σ = 0.4, target 0.5 → (0.4 − 0.5)² = 0.01
    # row 1: log ρ = [−0.4 | pad pad] → Σ = −0.4, target −1 → (−0.4 + 1)² = 0.36
    # mean over 2 sequences = 0.185
    old_logp = torch.full((2, 3), -2.0)
    logp = (old_logp + torch.tensor([[0.1, 0.3, 5.0], [-0.4, 5.0, 5.0]])).requires_grad_(True)
    targets = torch.tensor([[0.5, 0.5, PAD], [-1.0, PAD, PAD]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = sppo_loss(logp, old_logp, targets, mask)
    close(loss, 0.185)
    # ∂/∂log π_t = 2(Σ log ρ − target)/2 on each valid token: row 0 −0.1, row 1 +0.6
    loss.backward()
    close(logp.grad, [[-0.1, -0.1, 0.0], [0.6, 0.0, 0.0]])


def cov_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log π: row 0 [−1, −2 | pad], row 1 [−1, −4, −2]; A: row 0 +1, row 1 −1; 5 valid tokens.

    mean log π = −10/5 = −2, mean A = (2 − 3)/5 = −0.2 → Cov = (log π + 2)(A + 0.2):
    row 0: (1)(1.2) = 1.2, (0)(1.2) = 0 ; row 1: (1)(−0.8) = −0.8, (−2)(−0.8) = 1.6, (0)(−0.8) = 0
    log ρ: row 0 [0.2, 0], row 1 [0, −0.1, 0] → ρ = 1.2214028, 1 | 1, 0.9048374, 1
    """
    logp = torch.tensor([[-1.0, -2.0, 30.0], [-1.0, -4.0, -2.0]], requires_grad=True)
    old_logp = logp.detach() - torch.tensor([[0.2, 0.0, 0.0], [0.0, -0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, PAD], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp, old_logp, adv, mask


def test_kl_cov_penalises_the_top_covariance_tokens_by_hand() -> None:
    # k = ⌊0.4 · 5⌋ = 2: the two largest Cov are 1.6 (row 1 token 1) and 1.2 (row 0 token 0)
    # L_t = −A·ρ: −1.2214028, −1 | +1, +0.9048374, +1 ; plus β·|log ρ| (β = 1): +0.2 and +0.1
    # token-mean = (−1.2214028 + 0.2 − 1 + 1 + 0.9048374 + 0.1 + 1) / 5 = 0.9834346 / 5 = 0.1966869
    logp, old_logp, adv, mask = cov_batch()
    loss, metrics = kl_cov(logp, old_logp, adv, mask, kl_cov_ratio=0.4, kl_cov_coef=1.0)
    close(loss, 0.1966869)
    close(metrics["kl_cov_frac"], 2 / 5)
    # ∂/∂log π = (−A·ρ + β·sign(log ρ) on the chosen) / 5:
    #   (−1.2214028 + 1)/5 = −0.0442806, −1/5 | +1/5, (0.9048374 − 1)/5 = −0.0190325, +1/5
    loss.backward()
    close(logp.grad, [[-0.0442806, -0.2, 0.0], [0.2, -0.0190325, 0.2]])


def test_kl_cov_takes_at_least_one_token() -> None:
    # the paper's r = 2e-4 of 5 tokens is 0.001: one token, the largest Cov (1.6) → (0.9834346 − 0.2)/5
    logp, old_logp, adv, mask = cov_batch()
    loss, metrics = kl_cov(logp, old_logp, adv, mask, kl_cov_ratio=2e-4, kl_cov_coef=1.0)
    close(loss, 0.7834346 / 5)
    close(metrics["kl_cov_frac"], 1 / 5)


def test_clip_cov_cuts_a_token_inside_the_band_by_hand() -> None:
    # band (0.5, 1.5): only Cov 1.2 (row 0 token 0) is inside; PPO range [0.8, 1.3] clips nothing here.
    # k = ⌊0.2 · 5⌋ = 1 → that token's loss is 0.
    # PPO: −1.2214028 (cut → 0), −1 | +1, max(0.9048374, 0.9048374) = 0.9048374, +1
    # token-mean = (−1 + 1 + 0.9048374 + 1) / 5 = 1.9048374 / 5 = 0.3809675
    logp, old_logp, adv, mask = cov_batch()
    band = {"clip_cov_lb": 0.5, "clip_cov_ub": 1.5, "clip_cov_ratio": 0.2}
    loss, metrics = clip_cov(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, **band)
    close(loss, 0.3809675)
    close(metrics["clip_cov_frac"], 1 / 5)
    close(metrics["clip_frac"], 0.0)
    # ∂/∂log π = −A·ρ/5 elsewhere: 0 (cut), −0.2 | +0.2, 0.9048374/5 = 0.1809675, +0.2
    loss.backward()
    close(logp.grad, [[0.0, -0.2, 0.0], [0.2, 0.1809675, 0.2]])


def test_clip_cov_skips_tokens_ppo_already_clipped() -> None:
    # with ε_high = 0.2, ρ = 1.2214 with A > 0 is clipped by PPO: no candidate is left in (0.5, 1.5)
    logp, old_logp, adv, mask = cov_batch()
    band = {"clip_cov_lb": 0.5, "clip_cov_ub": 1.5, "clip_cov_ratio": 0.2}
    loss, metrics = clip_cov(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, **band)
    close(metrics["clip_cov_frac"], 0.0)
    close(loss, ppo_clip(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)[0].item())


def test_clip_cov_draws_uniformly_among_candidates() -> None:
    # band (0.5, 2): candidates Cov 1.2 (row 0 token 0) and 1.6 (row 1 token 1); k = 1 of them each time
    logp, old_logp, adv, mask = cov_batch()
    band = {"clip_cov_lb": 0.5, "clip_cov_ub": 2.0, "clip_cov_ratio": 0.2}
    cut = set()
    for seed in range(20):
        logp.grad = None
        gen = torch.Generator().manual_seed(seed)
        loss, metrics = clip_cov(logp, old_logp, adv, mask, clip_ratio_high=0.3, generator=gen, **band)
        close(metrics["clip_cov_frac"], 1 / 5)
        loss.backward()
        zero = {(r, t) for r, t in [(0, 0), (1, 1)] if logp.grad[r, t] == 0}
        assert len(zero) == 1
        cut |= zero
    assert cut == {(0, 0), (1, 1)}


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "gpg", "sppo", "kl_cov", "clip_cov"])
def test_new_losses_ignore_padding_and_report_the_common_metrics(name: str) -> None:
    logp, old_logp, adv, mask = ppo_batch()
    loss, metrics = POLICY_LOSSES[name](logp, old_logp, adv, mask, clip_ratio_high=0.3, unused=1)
    junk_logp = torch.where(mask.bool(), logp.detach(), -7.0)
    junk_adv = torch.where(mask.bool(), adv, -123.0)
    loss2, _ = POLICY_LOSSES[name](junk_logp, old_logp, junk_adv, mask, clip_ratio_high=0.3)
    torch.testing.assert_close(loss2, loss.detach())
    assert {"clip_frac", "approx_kl"} <= metrics.keys()
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[:, 3] == 0).all()


# ---------------------------------------------------------------- PF-PPO filters
# group 7: rows 0, 2, 4, 6, 7 with scores 0.2, 0.9, 0.1, 0.9, 0.5 (best: row 2, the first 0.9; worst: row 4)
# group 3: row 1 alone ; group 1: rows 3, 5 both 2.0 (best: the first, row 3; worst: the last, row 5)
FILTER_SCORES = torch.tensor([0.2, 5.0, 0.9, 2.0, 0.1, 2.0, 0.9, 0.5])
FILTER_GROUPS = torch.tensor([7, 3, 7, 1, 7, 1, 7, 7])


def kept(mask: Tensor) -> list[int]:
    return mask.nonzero().squeeze(1).tolist()


def test_best_of_n_keeps_each_groups_first_best() -> None:
    assert kept(best_of_n(FILTER_SCORES, FILTER_GROUPS)) == [1, 2, 3]
    assert needs_of(best_of_n).rows_per_group == 1


def test_best_worst_keeps_two_distinct_rows_per_group() -> None:
    assert kept(best_worst(FILTER_SCORES, FILTER_GROUPS)) == [1, 2, 3, 4, 5]
    assert needs_of(best_worst).rows_per_group == 2


def test_best_random_keeps_the_best_and_one_uniform_other() -> None:
    drawn = set()
    for seed in range(40):
        keep = kept(best_random(FILTER_SCORES, FILTER_GROUPS, torch.Generator().manual_seed(seed)))
        assert {1, 2, 3, 5} <= set(keep) and len(keep) == 5  # the best of each group, group 1's other row
        (other,) = set(keep) - {1, 2, 3, 5}
        drawn.add(other)
    assert drawn == {0, 4, 6, 7}  # every other row of group 7 is drawn, never the best again


def test_filters_are_registered_and_named_in_errors() -> None:
    assert set(POLICY_FILTERS) == {"best_of_n", "best_worst", "best_random"}
    with pytest.raises(KeyError, match=r"best_worst.*register_policy_filter"):
        get_policy_filter("max_min")
