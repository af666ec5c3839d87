"""The KL coefficient β when KL(π_old ‖ π_ref) is charged as a token-level reward penalty.

Fixed: β never changes. Adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences"): β follows the measured KL towards a target, so the policy may drift
as far as the target allows and no further, whatever the reward scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.algorithms.kl import kl_penalty
from mmrl.algorithms.masked import masked_mean


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n_steps / horizon)."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """`current_kl` measured on a batch of `n_steps` samples."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def kl_reward_penalty(
    old_logp: Tensor, ref_logp: Tensor, response_mask: Tensor, kind: str, kl_coef: float
) -> tuple[Tensor, float]:
    """(−β · KL_t [B, T], 0 on padding; the batch KL the controller adapts to).

    The batch KL is the mean over sequences of each sequence's mean per-token KL.
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_penalty(old_logp, ref_logp, kind), 0.0)
    current = float(masked_mean(kl, mask, dim=-1).mean()) if len(kl) else 0.0
    return -kl_coef * kl, current
