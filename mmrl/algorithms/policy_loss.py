"""Clipped policy-gradient surrogates: the loss whose gradient is Σ_t A_t ∇ log π(y_t).

Each loss takes per-token ``logp`` (current policy, with grad), ``old_logp`` (the policy
that sampled, no grad), ``advantages`` and ``response_mask``, all [B, T], and returns the
scalar loss (aggregated by `agg_loss`, see ``loss_agg_mode``) and detached metrics:
``clip_frac`` (share of valid tokens whose clipped branch is active, i.e. gets no gradient)
and ``approx_kl`` (mean of old_logp − logp over valid tokens, the k1 estimate of
KL(π_old ‖ π_θ)). Unknown keyword arguments are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.aggregation import agg_loss
from mmrl.algorithms.masked import masked_mean, masked_sum
from mmrl.algorithms.registry import Needs, lookup, register

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}

# exp(20) ≈ 5e8: far outside any clip range, yet far from float overflow.
MAX_LOG_RATIO = 20.0


def register_policy_loss(
    name: str, *aliases: str, needs: Needs | None = None
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Add `fn(logp, old_logp, advantages, response_mask, **kwargs) -> (loss, metrics)`; `needs` says
    what it asks of the run (`mmrl.algorithms.Needs`: the estimator it pairs with)."""
    return register(POLICY_LOSSES, name, *aliases, needs=needs)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; KeyError lists the choices."""
    return lookup(
        POLICY_LOSSES,
        name,
        what="policy loss",
        how_to_add="Add one with @mmrl.algorithms.register_policy_loss('name'), "
        "or name a function in the config as 'path/to/file.py:function'.",
    )


def clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Per-token max(−A·ρ, −A·clip(ρ, 1−low, 1+high)) with ρ = exp(log_ratio); also where clipping won.

    Taking the larger loss (the pessimistic bound) means a ratio that has already moved
    past the range in the advantage's direction gets no further push.
    """
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    is_clipped = clipped > unclipped
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def aggregated(
    token_loss: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    agg_kwargs: dict[str, Any] | None,
    is_clipped: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A per-token loss reduced by `agg_loss`, and the metrics every policy loss reports: ``clip_frac``,
    the share of valid tokens in `is_clipped` (none when it is None), and ``approx_kl``."""
    loss = agg_loss(token_loss, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    clipped = torch.zeros_like(token_loss) if is_clipped is None else is_clipped.float()
    return loss, {
        "clip_frac": masked_mean(clipped, response_mask).detach(),
        "approx_kl": masked_mean(old_logp - logp, response_mask).detach(),
    }


@register_policy_loss("ppo_clip")
def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO (Schulman et al. 2017): L_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε_low, 1+ε_high)), ρ_t = π_θ/π_old.

    The asymmetric range is DAPO's clip-higher (Yu et al. 2025): a larger ε_high lets
    unlikely tokens with positive advantage grow, which keeps entropy from collapsing.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    token_loss, is_clipped = clipped_surrogate(logp - old_logp, advantages, clip_ratio_low, clip_ratio_high)
    return aggregated(token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs, is_clipped)


@register_policy_loss("dual_clip")
def dual_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO (Ye et al. 2020): for A_t < 0, L_t = min(L_t^PPO, −c·A_t), with c > 1.

    With a negative advantage PPO's loss −A·ρ grows without bound in ρ, so one very
    off-policy token can dominate the update; the cap c·|A| stops it (and its gradient).
    Adds metric ``dual_clip_frac``, the share of valid tokens at the cap.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    old_logp, advantages = old_logp.detach(), advantages.detach()
    token_loss, is_clipped = clipped_surrogate(logp - old_logp, advantages, clip_ratio_low, clip_ratio_high)
    cap = -clip_ratio_c * advantages
    is_capped = (advantages < 0) & (token_loss > cap)
    token_loss = torch.where(is_capped, cap, token_loss)
    loss, metrics = aggregated(
        token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs, is_clipped
    )
    metrics["dual_clip_frac"] = masked_mean(is_capped.float(), response_mask).detach()
    return loss, metrics


@register_policy_loss("gspo")
def gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clipped loss on the sequence ratio s_i = exp(1/|y_i| Σ_t log ρ_it).

    Token ratios are noisy and their clipping is arbitrary per token; the length-normalised
    sequence ratio is what the sequence-level reward actually judges. Applied per token as
    GSPO-token, s_it = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]: its value is s_i, its gradient flows
    through each token. Clipping is per sequence, so use the paper's tiny ranges
    (ε_low = 3e-4, ε_high = 4e-4) and its ``seq-mean-token-mean`` aggregation.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    seq_log_ratio = masked_mean(logp - old_logp, response_mask, dim=-1)
    token_log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    token_loss, is_clipped = clipped_surrogate(token_log_ratio, advantages, clip_ratio_low, clip_ratio_high)
    return aggregated(token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs, is_clipped)


@register_policy_loss("cispo")
def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, §3.1, the CISPO objective and its clipped
    IS weight): L_t = −sg(clip(ρ_t, 1−ε_low, 1+ε_high))·A_t·log π_θ(y_t).

    PPO's clip drops the gradient of a token whose ratio left the range, and those are often the rare
    tokens that start a new line of reasoning ("However", "Wait"). CISPO bounds the importance weight
    instead, with its gradient stopped, so every token keeps ∇log π and only its weight is capped.
    The value follows the paper's formula (−w·A·log π, not −w·A); only its gradient means anything.
    The paper sets no lower bound in practice (a large ε_low) and tunes ε_high. ``clip_frac`` is the
    share of tokens whose weight was capped (they still get a gradient).
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    ratio = torch.exp((logp.detach() - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    token_loss = -weight * advantages * logp
    return aggregated(token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs, weight != ratio)


@register_policy_loss("sapo", needs=Needs(defaults=(("actor.loss_agg_mode", "seq-mean-token-mean"),)))
def sapo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347, §3, the SAPO
    objective and its gate f): L_t = −f(ρ_t)·A_t, f(ρ) = σ(τ(ρ − 1))·4/τ, τ = τ_pos if A_t > 0 else τ_neg.

    The gradient is −A_t·w_t·∇log π with w = 4σ(1−σ)·ρ, σ = σ(τ(ρ−1)): exactly 1 on-policy (ρ = 1, the
    plain policy gradient), fading smoothly as ρ moves away, where PPO's clip cuts it to 0 at a hard
    edge. A larger τ fades faster; the paper fades negative advantages faster (τ_neg = 1.05 > τ_pos = 1),
    because pushing a token down raises every other token's logit. The paper averages per sequence
    (``loss_agg_mode=seq-mean-token-mean``). Nothing is clipped: ``clip_frac`` is 0.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    ratio = torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return aggregated(-gate * advantages, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs)


@register_policy_loss(
    "gmpo", "geo_mean", needs=Needs(defaults=(("actor.clip_ratio_low", 0.4), ("actor.clip_ratio_high", 0.4)))
)
def gmpo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673, §3, the GMPO
    objective): the geometric mean of the token terms instead of GRPO's arithmetic mean,

    L_i = −A_i · exp(1/|y_i| Σ_t m_t),  m_t = sgn(A_i)·min(sgn(A_i)·log ρ_t, sgn(A_i)·clip(log ρ_t, −ε_low, ε_high)),

    i.e. |A_i|·(Π_t min(ρ_t, clip ρ_t))^{1/|y_i|} for A > 0 (max for A < 0), PPO's pessimistic bound per
    token, clipped in log space. One outlier ratio moves a geometric mean far less than an arithmetic
    one, so a wider range is safe: the paper's ε = 0.4 is (e^−0.4, e^0.4). A_i is the mean of the row's
    token advantages (sequence-level, as the paper's). The objective is a mean over sequences, so
    ``loss_agg_mode`` does not apply (num_seqs from ``agg_kwargs`` still does). ``clip_frac`` is the
    share of tokens whose clipped bound won.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_adv = masked_mean(advantages, response_mask, dim=-1)
    sign = torch.sign(seq_adv)[:, None]
    clipped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    bound = sign * torch.minimum(sign * log_ratio, sign * clipped)
    per_seq = -seq_adv * torch.exp(masked_mean(bound, response_mask, dim=-1))
    is_clipped = sign * clipped < sign * log_ratio
    return _per_sequence(per_seq, logp, old_logp, response_mask, agg_kwargs, is_clipped)


@register_policy_loss("gpg")
def gpg(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG's loss (Chu et al. 2025, arXiv 2504.02546, §3, the GPG objective): L_t = −A_t·log π_θ(y_t),
    the policy gradient itself, with no ratio, no clip and no surrogate.

    Its advantages come from ``algorithm.adv_estimator=gpg`` (group-centred and corrected for groups
    without signal). With several optimizer steps per batch the samples grow off-policy and nothing
    corrects for it: the paper takes one step per batch. Value: −A·log π; only the gradient means
    anything. Nothing is clipped: ``clip_frac`` is 0.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    return aggregated(-advantages * logp, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs)


@register_policy_loss("sppo", needs=Needs(pairs_with="sppo"))
def sppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SPPO's loss (Wu et al. 2024, "Self-Play Preference Optimization", arXiv 2405.00675, Algorithm 1):
    L_i = (log π_θ(y_i|x) − log π_t(y_i|x) − η(P̂_i − ½))², a regression, not a surrogate.

    The log-ratio is the whole sequence's, Σ_t (log π_θ − log π_old) over its valid tokens; π_t is the
    policy that sampled (``old_logp``). The target η(P̂_i − ½) is what ``algorithm.adv_estimator=sppo``
    puts in the advantages (the mean over the row's tokens is taken). The loss is a mean over sequences,
    so ``loss_agg_mode`` does not apply. Nothing is clipped: ``clip_frac`` is 0.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    seq_log_ratio = masked_sum(logp - old_logp, response_mask, dim=-1)
    target = masked_mean(advantages, response_mask, dim=-1)
    return _per_sequence((seq_log_ratio - target).square(), logp, old_logp, response_mask, agg_kwargs)


def _per_sequence(
    per_seq: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    response_mask: Tensor,
    agg_kwargs: dict[str, Any] | None,
    is_clipped: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_i L_i / N_seqs for a loss defined per sequence: the seq-mean-token-mean of L_i spread over each
    row's tokens, so the mini-batch's `num_seqs` divides it under gradient accumulation."""
    spread = per_seq[:, None].expand(response_mask.shape)
    return aggregated(spread, logp, old_logp, response_mask, "seq-mean-token-mean", agg_kwargs, is_clipped)
