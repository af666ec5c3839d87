"""Advantage estimators: how much to push up log π(y_t) for each response token.

Every estimator takes ``token_rewards`` [B, T] (an outcome reward sits on the last valid
token, so the score is s_i = Σ_t r_it), ``response_mask`` [B, T] and ``group_index`` [B]
(the n responses to one prompt share a value), and returns ``(advantages, returns)``, both
float32 [B, T] and exactly 0 on padding. ``returns`` is what the rewards alone make a token
worth, before any baseline: the score s_i, or the discounted return-to-go for REINFORCE++.
Unknown keyword arguments are ignored, so the trainer can pass one common set.

Standard deviations are unbiased (Bessel's n − 1, the torch.std default). A group of one,
or of equal scores, has no signal to rank by and gets advantage 0, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.masked import masked_sum, masked_whiten, wide_enough
from mmrl.algorithms.registry import Needs, lookup, register

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, *aliases: str, needs: Needs | None = None
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Add `fn(token_rewards, response_mask, group_index, **kwargs) -> (advantages, returns)`;
    `needs` says what it asks of the run (`mmrl.algorithms.Needs`)."""
    return register(ADVANTAGE_ESTIMATORS, name, *aliases, needs=needs)


GROUPS = Needs(groups=True)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; KeyError lists the choices."""
    return lookup(
        ADVANTAGE_ESTIMATORS,
        name,
        what="advantage estimator",
        how_to_add="Add one with @mmrl.algorithms.register_advantage_estimator('name'), "
        "or name a function in the config as 'path/to/file.py:function'.",
    )


def _scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """s_i = Σ_t r_it over valid tokens, float32 [B]."""
    return masked_sum(token_rewards.float(), response_mask, dim=-1)


def _broadcast(per_seq: Tensor, response_mask: Tensor) -> Tensor:
    """Copy a per-sequence value [B] onto that sequence's valid tokens, 0 elsewhere."""
    values = per_seq[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), values, torch.zeros_like(values))


def _group_sum(values: Tensor, ids: Tensor) -> Tensor:
    """Σ of `values` over each sample's group, per sample. `ids` are dense group ids < B."""
    return torch.zeros_like(values).index_add_(0, ids, values)[ids]


def _group_shifted(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """(s_i − max of its group, dense group ids), each [B].

    Baselines are taken of the shifted scores: then an all-equal group centres to exactly 0
    instead of to ±1 ulp of rounding, which a division by σ + eps would inflate.
    """
    ids = torch.unique(group_index, return_inverse=True)[1]
    group_max = torch.zeros_like(scores).scatter_reduce(0, ids, scores, reduce="amax", include_self=False)
    return scores - group_max[ids], ids


def _group_centred(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(s_i − mean of its group, group size, dense group ids), each [B]; exactly 0 for equal scores."""
    shifted, ids = _group_shifted(scores, group_index)
    size = _group_sum(torch.ones_like(scores), ids)
    return shifted - _group_sum(shifted, ids) / size, size, ids


@register_advantage_estimator("grpo", needs=GROUPS)
@torch.no_grad()
def grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    eps: float = 1e-6,
    norm_adv_by_std: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): A_i = (s_i − mean_g(s)) / (std_g(s) + eps), std unbiased.

    Normalising by the group std makes every prompt contribute at the same scale;
    ``norm_adv_by_std=False`` keeps only the mean-centring (as in Dr.GRPO).
    """
    scores = _scores(token_rewards, response_mask)
    centred, size, ids = _group_centred(wide_enough(scores), group_index)
    if norm_adv_by_std:
        std = (_group_sum(centred.square(), ids) / (size - 1).clamp(min=1)).sqrt()
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return _broadcast(centred.float(), response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("drgrpo", needs=GROUPS)
@torch.no_grad()
def drgrpo(
    token_rewards: Tensor, response_mask: Tensor, group_index: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """Dr.GRPO (Liu et al. 2025): A_i = s_i − mean_g(s).

    Dividing by std up-weights prompts that are nearly all right or all wrong; Dr.GRPO
    drops it (and ``norm_adv_by_std`` is ignored here).
    """
    scores = _scores(token_rewards, response_mask)
    centred = _group_centred(scores, group_index)[0]
    return _broadcast(centred, response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("rloo", needs=GROUPS)
@torch.no_grad()
def rloo(
    token_rewards: Tensor, response_mask: Tensor, group_index: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = s_i − 1/(n−1) Σ_{j≠i} s_j.

    A baseline without s_i itself keeps the gradient estimate unbiased. Computed as the
    identical n/(n−1)·(s_i − mean_g(s)); a group of one gets 0.
    """
    scores = _scores(token_rewards, response_mask)
    centred, size, _ = _group_centred(scores, group_index)
    leave_one_out = centred * size / (size - 1).clamp(min=1)
    return _broadcast(leave_one_out, response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("prime", needs=Needs(groups=True, prm=True))
@torch.no_grad()
def prime(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    process_rewards: Tensor | None = None,
    gamma: float = 1.0,
    outcome_coef: float = 1.0,
    process_coef: float = 1.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456, §3.2,
    Eq. 5, its outcome part Eq. 4): RLOO on the outcome reward and on the implicit process rewards r_φ(y_t) of the PRM
    (`mmrl.algorithms.implicit_process_rewards`), each with its own leave-one-out baseline, the process
    part as a return:

        A^i_t = c_p · Σ_{s=t}^{|y^i|} γ^{s−t} · [ r_φ(y^i_s) − 1/(K−1) Σ_{j≠i} r_φ(y^j)/|y^j| ]
              + c_o · [ r_o(y^i) − 1/(K−1) Σ_{j≠i} r_o(y^j) ],

    K the responses to the prompt. The process baseline is the other responses' mean reward per token
    (r_φ(y^j) = Σ_t r_φ(y^j_t) over its |y^j| tokens), so a long response is not compared with a short
    one's sum; the outcome advantage is RLOO's (`rloo`) on every token. c_o, c_p are
    ``algorithm.prime_outcome_coef`` and ``prime_process_coef`` (the paper sums the two: 1 and 1).
    ``process_rewards`` [B, T] are the PRM's rewards; ``returns`` is what the rewards alone make a token
    worth: c_o·r_o(y^i) + c_p·Σ_{s≥t} γ^{s−t} r_φ(y^i_s). No whitening (the paper's Eq. 5; verl's recipe
    also whitens). A group of one has no baseline and gets 0 from both parts.
    """
    if process_rewards is None:
        raise ValueError(
            "prime needs process_rewards=<Tensor[B, T], the implicit PRM's reward of each token>"
        )
    if process_rewards.shape != token_rewards.shape:
        raise ValueError(
            f"process_rewards must have shape {tuple(token_rewards.shape)}, got {tuple(process_rewards.shape)}"
        )
    mask = response_mask.bool()
    outcome, scores = rloo(token_rewards, response_mask, group_index)
    process = torch.where(mask, process_rewards.float(), 0.0)
    per_token = process.sum(-1) / mask.sum(-1).clamp(min=1)
    ids = torch.unique(group_index, return_inverse=True)[1]
    size = _group_sum(torch.ones_like(per_token), ids)
    baseline = (_group_sum(per_token, ids) - per_token) / (size - 1).clamp(min=1)
    alone = (size == 1)[:, None]
    centred = torch.where(mask & ~alone, process - baseline[:, None], 0.0)
    process_adv = _returns_to_go(centred, mask, gamma)
    returns = outcome_coef * scores + process_coef * _returns_to_go(process, mask, gamma)
    return outcome_coef * outcome + process_coef * process_adv, returns


def _returns_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ·G_{t+1} over each row's valid tokens (masked ones skipped, not discounted through);
    0 on padding."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
    return returns


@register_advantage_estimator("gpg", needs=Needs(groups=True, pairs_with="gpg"))
@torch.no_grad()
def gpg(
    token_rewards: Tensor, response_mask: Tensor, group_index: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546, §3, the corrected advantage): A_i = α·(s_i − mean_g(s)) / F_norm with
    α = B / (B − M), B the rows of the batch and M those in groups without signal (all scores equal, or
    a group of one), whose advantage is 0.

    Those rows still count in the loss's mean, so they shrink every other row's gradient by (B − M)/B;
    α undoes that shrinkage, so the gradient estimate does not depend on how many groups happened to be
    all right or all wrong. Choice: F_norm = 1 (no std division, as the paper's plain policy gradient and
    verl do; ``norm_adv_by_std`` is ignored). Pair it with ``actor.policy_loss=gpg``. A batch with no
    signal at all gets 0 everywhere.
    """
    scores = _scores(token_rewards, response_mask)
    centred, _, ids = _group_centred(scores, group_index)
    has_signal = _group_sum(centred.abs(), ids) > 0  # exactly 0 for a group of one or of equals
    rows, silent = len(scores), int((~has_signal).sum())
    alpha = rows / max(rows - silent, 1)
    return _broadcast(alpha * centred, response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("opo", needs=Needs(groups=True, exact_on_policy=True))
@torch.no_grad()
def opo(
    token_rewards: Tensor, response_mask: Tensor, group_index: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585, §3, the
    optimal baseline under its length assumption): A_i = s_i − b_g, b_g = Σ_j |y_j| s_j / Σ_j |y_j| over the group.

    With a sequence's gradient norm growing with its length, the baseline that minimises the gradient's
    variance weights each response's reward by its length; no std division. The paper's other half,
    exact on-policy training, is this entry's `Needs.exact_on_policy`: the config refuses more than one
    optimizer step per batch. A group of one gets 0 (verl gives it s_i; here it has nothing to compare
    with, like every group estimator of this module).
    """
    scores = _scores(token_rewards, response_mask)
    lengths = response_mask.bool().sum(-1).float()
    shifted, ids = _group_shifted(scores, group_index)
    baseline = _group_sum(lengths * shifted, ids) / _group_sum(lengths, ids).clamp(min=1)
    return _broadcast(shifted - baseline, response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("sppo", needs=Needs(groups=True, pairs_with="sppo"))
@torch.no_grad()
def sppo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    eta: float = 1.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """SPPO's regression target (Wu et al. 2024, "Self-Play Preference Optimization for Language Model
    Alignment", arXiv 2405.00675, Algorithm 1, the regression target): A_i = η·(P̂_i − ½), with P̂_i the estimated
    probability that y_i beats the current policy, here the within-group win rate by score:

    P̂_i = 1/n Σ_{j in group} (1[s_i > s_j] + ½·1[s_i = s_j]),

    every response of the group counted, y_i itself included (a tie: ½), as the paper averages P(y ≻ y_k)
    over all K samples. A group of one or of equals gets P̂ = ½, so 0. The loss that regresses the
    sequence log-ratio on it is ``actor.policy_loss=sppo``; η is ``algorithm.sppo_eta``.
    """
    scores = _scores(token_rewards, response_mask)
    ids = torch.unique(group_index, return_inverse=True)[1]
    same_group = ids[:, None] == ids[None, :]
    beats = (scores[:, None] > scores[None, :]).float() + 0.5 * (scores[:, None] == scores[None, :]).float()
    win_rate = (beats * same_group).sum(1) / same_group.sum(1)
    return _broadcast(eta * (win_rate - 0.5), response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): G_t = r_t + γ G_{t+1}, A = whiten(G) over the batch's valid tokens.

    Whitening over the whole batch instead of per group stabilises the scale without a critic.
    Masked tokens are skipped, not discounted through: G carries over them unchanged.
    """
    mask = response_mask.bool()
    returns = _returns_to_go(torch.where(mask, token_rewards.float(), 0.0), mask, gamma)
    return masked_whiten(returns, mask, eps), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    eps: float = 1e-6,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): A = whiten(s_i − mean_g(s)) over the batch's valid tokens.

    The group mean removes the prompt's difficulty; whitening over the batch, not the
    group, avoids GRPO's blow-up on groups with a tiny std.
    """
    scores = _scores(token_rewards, response_mask)
    centred = _group_centred(scores, group_index)[0]
    return (
        masked_whiten(_broadcast(centred, response_mask), response_mask, eps),
        _broadcast(scores, response_mask),
    )


@register_advantage_estimator("remax")
@torch.no_grad()
def remax(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    baseline_scores: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): A_i = s_i − b_i, b_i the score of the greedy response to the prompt.

    The greedy rollout is a per-prompt baseline that needs no critic and no group.
    """
    if baseline_scores is None:
        raise ValueError("remax needs baseline_scores=<Tensor[B], score of each prompt's greedy response>")
    scores = _scores(token_rewards, response_mask)
    if baseline_scores.shape != scores.shape:
        raise ValueError(
            f"baseline_scores must have shape {tuple(scores.shape)}, got {tuple(baseline_scores.shape)}"
        )
    return _broadcast(scores - baseline_scores.float(), response_mask), _broadcast(scores, response_mask)


@register_advantage_estimator("gae", needs=Needs(critic=True))
@torch.no_grad()
def gae(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    critic_lam: float | None = None,
    length_adaptive_alpha: float | None = None,
    eps: float = 1e-6,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016), the PPO estimator with a learned critic V:

    δ_t = r_t + γ V_{t+1} − V_t,  Â_t = Σ_l (γλ)^l δ_{t+l},  returns R_t = Â_t + V_t,
    with V = 0 after the last valid token; the policy gets whiten(Â) over the batch's valid
    tokens, the critic regresses on R. λ trades the critic's bias (λ→0) for the return's
    variance (λ=1 gives R_t − V_t with R_t the discounted return-to-go). Masked tokens are
    skipped, not discounted through.

    VAPO (Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning
    Tasks", arXiv 2504.05118) adds two options:

    - Decoupled-GAE: the critic's returns use their own λ, ``critic_lam`` (VAPO: 1.0, the unbiased
      Monte-Carlo return, as long bootstrapped chains carry the critic's bias back to the first
      tokens), and the policy's advantages use ``lam``; ``critic_lam=None`` uses ``lam`` for both.
    - Length-Adaptive GAE: the policy's λ is set per response of l valid tokens to
      λ_policy = 1 − 1/(α·l) (α = ``length_adaptive_alpha``, VAPO: 0.05), so that the TD errors' total
      weight Σ_t λ^t = 1/(1 − λ) = α·l grows with the length: a long response's first tokens still see
      its final reward, a short one's advantage keeps a low variance. It replaces
      ``lam`` for the policy. Choice: λ is clipped to [0, 1], as α·l < 1 (short responses) gives a
      negative λ the paper, with thousands of tokens, never meets.
    """
    if values is None:
        raise ValueError("gae needs values=<Tensor[B, T], the critic's value of each response token>")
    if values.shape != token_rewards.shape:
        raise ValueError(f"values must have shape {tuple(token_rewards.shape)}, got {tuple(values.shape)}")
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards.float(), 0.0)
    values = torch.where(mask, values.float(), 0.0)
    rows = rewards.new_ones(rewards.shape[0])
    policy_lam = rows * lam
    if length_adaptive_alpha is not None:
        lengths = mask.sum(-1).clamp(min=1).float()
        policy_lam = (1 - 1 / (length_adaptive_alpha * lengths)).clamp(0.0, 1.0)
    critic_lam_rows = rows * (lam if critic_lam is None else critic_lam)
    advantages = _td_sums(rewards, values, mask, gamma, policy_lam)
    critic_advantages = (
        advantages
        if torch.equal(critic_lam_rows, policy_lam)
        else _td_sums(rewards, values, mask, gamma, critic_lam_rows)
    )
    returns = critic_advantages + values
    return masked_whiten(advantages, mask, eps), returns


def _td_sums(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: Tensor) -> Tensor:
    """Â_t = Σ_l (γλ)^l δ_{t+l} over each row's valid tokens, λ [B] one per row; 0 on padding."""
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(mask[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(mask[:, t], running, 0.0)
    return advantages


@register_advantage_estimator("gigpo")
@torch.no_grad()
def gigpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    *,
    episode_index: Tensor | None = None,
    anchor_index: Tensor | None = None,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    norm_adv_by_std: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """GiGPO (Feng et al. 2025, verl-agent): rows are the decisions of multi-step episodes, an
    episode's rows in time order, each carrying its own step reward r_t.

    A(a_t) = A^E(τ) + ω·A^S(a_t). The episode level is GRPO over whole returns R(τ) = Σ_t r_t within
    `group_index` (episodes from one initial state). The step level compares actions taken from the
    same state: decisions whose `anchor_index` matches within a group form a step group, each valued
    by its discounted return-to-go R_t = Σ_{k≥t} γ^{k−t} r_k, and A^S is GRPO over that group (0 for a
    state met once). ω is `step_weight`; `norm_adv_by_std=False` only centres, at both levels.
    ``returns`` is R_t. Credit for single steps comes without a critic or extra rollouts, because
    episodes from one start revisit states.
    """
    if episode_index is None or anchor_index is None:
        raise ValueError(
            "gigpo needs episode_index and anchor_index (Tensor[B]: each decision's episode and state)"
        )
    step_rewards = _scores(token_rewards, response_mask)
    position, first = first_rows(episode_index)
    episode_return = torch.zeros(len(first)).index_add_(0, position, step_rewards)
    episode_adv = _normalised(episode_return, group_index[first], eps, norm_adv_by_std)[position]

    to_go = torch.zeros_like(step_rewards)
    running = torch.zeros(len(first))
    for row in reversed(range(len(position))):  # rows of an episode are in time order
        e = position[row]
        running[e] = step_rewards[row] + gamma * running[e]
        to_go[row] = running[e]
    anchors = torch.unique(torch.stack([group_index, anchor_index], dim=1), dim=0, return_inverse=True)[1]
    step_adv = _normalised(to_go, anchors, eps, norm_adv_by_std)
    advantages = episode_adv + step_weight * step_adv
    return _broadcast(advantages, response_mask), _broadcast(to_go, response_mask)


def first_rows(episode_index: Tensor) -> tuple[Tensor, Tensor]:
    """For each row its episode's position among the distinct episodes, and each episode's first row."""
    _, position = episode_index.unique(return_inverse=True)
    rows = torch.arange(len(episode_index))
    first = torch.full((int(position.max()) + 1,), len(episode_index)).scatter_reduce(
        0, position, rows, "amin"
    )
    return position, first


def _normalised(scores: Tensor, group_index: Tensor, eps: float, by_std: bool) -> Tensor:
    """GRPO's per-group (s − mean) / (std + eps), or only s − mean; 0 for a group of one or of equals."""
    token_scores = scores[:, None]
    adv = grpo(token_scores, torch.ones_like(token_scores), group_index, eps=eps, norm_adv_by_std=by_std)[0]
    return adv[:, 0]
