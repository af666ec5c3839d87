"""Supervised terms added to the policy loss: VAPO's positive-example language-model loss."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.masked import masked_sum


def positive_example_nll(
    logp: Tensor,
    response_mask: Tensor,
    scores: Tensor,
    *,
    num_positive_tokens: float | None = None,
    **kwargs: float,
) -> Tensor:
    """VAPO's positive-example LM loss (Yue et al. 2025, "VAPO", arXiv 2504.05118, its "Positive Example
    LM Loss"): the negative log-likelihood of the responses that earned a positive reward,

        L_NLL = −1/Σ_{o∈T} |o| · Σ_{o∈T} Σ_t log π_θ(o_t),  T = {responses with score > 0},

    a token mean over T's valid tokens, added to the policy loss as μ·L_NLL. With a sparse reward the
    few correct samples carry little gradient through the PPO surrogate; imitating them directly uses
    them more. `logp` [B, T] (with gradient), `scores` [B]. Under gradient accumulation pass the
    mini-batch's count of those tokens as `num_positive_tokens` (default: this call's); other totals
    are ignored. No positive response: 0.
    """
    positive = response_mask.bool() & (scores > 0)[:, None]
    count = num_positive_tokens if num_positive_tokens is not None else positive.sum().clamp(min=1)
    return -masked_sum(logp, positive) / count
