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
from mmrl.algorithms.masked import masked_mean
from mmrl.algorithms.registry import lookup, register

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}

# exp(20) ≈ 5e8: far outside any clip range, yet far from float overflow.
_MAX_LOG_RATIO = 20.0


def register_policy_loss(name: str, *aliases: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Add `fn(logp, old_logp, advantages, response_mask, **kwargs) -> (loss, metrics)`."""
    return register(POLICY_LOSSES, name, *aliases)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; KeyError lists the choices."""
    return lookup(
        POLICY_LOSSES,
        name,
        what="policy loss",
        how_to_add="Add one with @mmrl.algorithms.register_policy_loss('name'), "
        "or name a function in the config as 'path/to/file.py:function'.",
    )


def _clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Per-token max(−A·ρ, −A·clip(ρ, 1−low, 1+high)) with ρ = exp(log_ratio); also where clipping won.

    Taking the larger loss (the pessimistic bound) means a ratio that has already moved
    past the range in the advantage's direction gets no further push.
    """
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    is_clipped = clipped > unclipped
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def _metrics(is_clipped: Tensor, logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    return {
        "clip_frac": masked_mean(is_clipped.float(), response_mask).detach(),
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
    token_loss, is_clipped = _clipped_surrogate(logp - old_logp, advantages, clip_ratio_low, clip_ratio_high)
    loss = agg_loss(token_loss, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    return loss, _metrics(is_clipped, logp, old_logp, response_mask)


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
    token_loss, is_clipped = _clipped_surrogate(logp - old_logp, advantages, clip_ratio_low, clip_ratio_high)
    cap = -clip_ratio_c * advantages
    is_capped = (advantages < 0) & (token_loss > cap)
    token_loss = torch.where(is_capped, cap, token_loss)
    loss = agg_loss(token_loss, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    metrics = _metrics(is_clipped, logp, old_logp, response_mask)
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
    token_loss, is_clipped = _clipped_surrogate(token_log_ratio, advantages, clip_ratio_low, clip_ratio_high)
    loss = agg_loss(token_loss, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    return loss, _metrics(is_clipped, logp, old_logp, response_mask)
