"""KL-Cov and Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617, §4): PPO-style losses that hold entropy up by restraining the few
tokens that drive it down.

Under a policy gradient, a token's entropy change follows the covariance of its log-probability with its
advantage: a confident token (high log π) with a high advantage, or an unlikely one with a low advantage,
sharpens the policy. The paper measures that per token,

    Cov_t = (log π_θ(y_t) − mean log π) · (A_t − mean A),

means over the valid tokens (here: of the micro-batch the loss sees), and restrains only a small share of
the tokens with the largest covariance. The policy's entropy is logged by the actor as ``actor/entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.masked import masked_mean
from mmrl.algorithms.policy_loss import MAX_LOG_RATIO, aggregated, clipped_surrogate, register_policy_loss


def token_covariance(logp: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Cov_t [B, T] of the paper's §4 over the valid tokens, detached; −inf on padding (never selected)."""
    logp, advantages = logp.detach(), advantages.detach()
    cov = (logp - masked_mean(logp, response_mask)) * (advantages - masked_mean(advantages, response_mask))
    return torch.where(response_mask.bool(), cov, -torch.inf)


def _share(ratio: float, response_mask: Tensor) -> int:
    """k = ⌊ratio · N⌋ tokens of the N valid ones, at least one (with the paper's tiny ratios a small
    micro-batch would otherwise restrain nothing), at most N."""
    valid = int(response_mask.bool().sum())
    return min(valid, max(1, int(ratio * valid)))


@register_policy_loss("kl_cov")
def kl_cov(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (§4, the KL-Cov objective): L_t = −ρ_t·A_t, plus β·|log π_θ(y_t) − log π_old(y_t)| on the
    k = ⌊r·N⌋ valid tokens of largest Cov_t (r = ``kl_cov_ratio``, β = ``kl_cov_coef``).

    Choices: the surrogate is the unclipped ρ·A, as in the paper's formula; the KL of π_θ from π_old on a
    selected token is estimated by |log ρ_t|, as the authors' released code does; among tokens tied at
    the k-th covariance, `torch.topk` picks. Adds ``kl_cov_frac``, the share of valid tokens penalised.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_loss = -advantages * torch.exp(log_ratio)
    cov = token_covariance(logp, advantages, response_mask).flatten()
    chosen = torch.zeros_like(cov, dtype=torch.bool)
    if response_mask.bool().any():
        chosen[torch.topk(cov, _share(kl_cov_ratio, response_mask)).indices] = True
    chosen = chosen.view_as(logp)
    token_loss = torch.where(chosen, token_loss + kl_cov_coef * log_ratio.abs(), token_loss)
    loss, metrics = aggregated(token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs)
    metrics["kl_cov_frac"] = masked_mean(chosen.float(), response_mask)
    return loss, metrics


@register_policy_loss("clip_cov")
def clip_cov(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (§4, the Clip-Cov objective): PPO's clipped loss, except that k = ⌊r·N⌋ tokens drawn
    uniformly at random from those with ω_low < Cov_t < ω_high (r = ``clip_cov_ratio``, ω =
    ``clip_cov_lb``, ``clip_cov_ub``) get L_t = 0: no gradient at all.

    Choices: as in the authors' released code, the base is PPO's clipped surrogate (``clip_ratio_low``,
    ``clip_ratio_high``) and tokens PPO already clipped are not candidates; a selected token's loss is 0
    as in the paper's formula (not merely detached). Fewer candidates than k: all of them. `generator`
    draws the tokens (default: torch's global one). Adds ``clip_cov_frac``, the share of valid tokens cut.
    """
    old_logp, advantages = old_logp.detach(), advantages.detach()
    token_loss, is_clipped = clipped_surrogate(logp - old_logp, advantages, clip_ratio_low, clip_ratio_high)
    cov = token_covariance(logp, advantages, response_mask)
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & ~is_clipped).flatten().nonzero().squeeze(1)
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if len(candidates):
        order = torch.randperm(
            len(candidates), generator=generator, device=generator.device if generator else None
        )
        chosen[candidates[order[: _share(clip_cov_ratio, response_mask)]]] = True
    chosen = chosen.view_as(logp)
    token_loss = torch.where(chosen, torch.zeros_like(token_loss), token_loss)
    loss, metrics = aggregated(
        token_loss, logp, old_logp, response_mask, loss_agg_mode, agg_kwargs, is_clipped
    )
    metrics["clip_cov_frac"] = masked_mean(chosen.float(), response_mask)
    return loss, metrics
