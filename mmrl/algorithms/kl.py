"""Per-token estimators of KL(π_θ ‖ π_ref) from the log-probs of the sampled tokens.

With samples from π_θ and r = π_ref / π_θ, each is a single-sample estimate
(Schulman, "Approximating KL Divergence", 2020): k1 is unbiased but can be negative,
k2 is low-variance but biased, k3 is unbiased, always ≥ 0 and low-variance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmrl.algorithms.registry import lookup, register

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str, *aliases: str) -> Callable[[KLEstimator], KLEstimator]:
    """Add `fn(logp, ref_logp) -> Tensor[B, T]` to `KL_ESTIMATORS` under `name` and `aliases`."""
    return register(KL_ESTIMATORS, name, *aliases)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [B, T] of the estimator named `kind` (mask it when aggregating)."""
    estimator = lookup(
        KL_ESTIMATORS,
        kind,
        what="KL estimator",
        how_to_add="Add one with @mmrl.algorithms.register_kl_estimator('name').",
    )
    return estimator(logp, ref_logp)


@register_kl_estimator("k1", "kl")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π_θ − log π_ref = −log r."""
    return logp - ref_logp


@register_kl_estimator("abs")
def abs_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|log π_θ − log π_ref|: k1 without the sign, so it cannot reward drifting away."""
    return (logp - ref_logp).abs()


@register_kl_estimator("k2", "mse")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½ (log π_θ − log π_ref)²."""
    return 0.5 * (logp - ref_logp).square()


@register_kl_estimator("k3", "low_var_kl")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = r − log r − 1 with log r = log π_ref − log π_θ.

    log r is clamped to [−20, 20] so exp cannot overflow, and the estimate to [−10, 10]
    so one wildly off-policy token cannot dominate the penalty.
    """
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)
