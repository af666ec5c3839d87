"""The critic's loss for PPO with GAE: a value regression whose step size is clipped like the policy's."""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.algorithms.aggregation import agg_loss
from mmrl.algorithms.masked import masked_mean


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, float] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's value loss (Schulman et al. 2017, as in OpenAI baselines), all tensors [B, T]:

    V^clip = V_old + clip(V − V_old, −ε, ε),  L = ½ · agg(max((V − R)², (V^clip − R)²)).

    Taking the larger error stops one batch from moving a value estimate further than ε from
    where the rollout saw it. Metrics: ``vf_clip_frac`` (share of valid tokens where the
    clipped error is the larger one, so no gradient flows) and ``vpred_mean``.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    error = (values - returns).square()
    error_clipped = (clipped - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(error, error_clipped), response_mask, loss_agg_mode, **(agg_kwargs or {})
    )
    metrics = {
        "vf_clip_frac": masked_mean((error_clipped > error).float(), response_mask).detach(),
        "vpred_mean": masked_mean(values.detach(), response_mask),
    }
    return loss, metrics
