"""Off-policy correction between the policy that sampled a rollout and the one the loss treats as old.

The engine that samples (vLLM in bf16 with its own kernels, or a rollout worker a version behind) is
not exactly the trainer's π_old, so PPO's ratio π_θ/π_old, computed with the trainer's π_old, leaves
the mismatch π_old/π_rollout uncorrected. Each correction turns the importance ratio

    ρ_t = π_old(y_t) / π_rollout(y_t) = exp(old_logp_t − rollout_logp_t)

into a weight w ≥ 0 per token, detached, that scales the token's advantage (so any policy loss in
`policy_loss` takes it unchanged: every one is positively homogeneous in A, w·max(a, b) = max(w·a, w·b)).
The cap C (> 1) bounds the variance a rare token would otherwise bring.

Each takes ``old_logp``, ``rollout_logp`` and ``response_mask`` [B, T] and ``cap``, and returns the
weights [B, T] (0 on padding) and detached metrics: ``mean`` (mean weight over valid tokens),
``capped_frac`` (share of valid tokens whose weight the cap changed: truncated or masked) and
``ratio_max``. Unknown keyword arguments are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.masked import masked_mean, masked_sum
from mmrl.algorithms.registry import lookup, register

RolloutCorrection = Callable[..., tuple[Tensor, dict[str, Tensor]]]

ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection] = {}

# exp(20) ≈ 5e8: far beyond any cap, and a sequence's summed log-ratio cannot overflow.
_MAX_LOG_RATIO = 20.0


def register_rollout_correction(name: str, *aliases: str) -> Callable[[RolloutCorrection], RolloutCorrection]:
    """Add `fn(old_logp, rollout_logp, response_mask, *, cap, **kwargs) -> (weights, metrics)`."""
    return register(ROLLOUT_CORRECTIONS, name, *aliases)


def get_rollout_correction(name: str) -> RolloutCorrection:
    """The correction registered as `name`; KeyError lists the choices."""
    return lookup(
        ROLLOUT_CORRECTIONS,
        name,
        what="rollout correction",
        how_to_add="Add one with @mmrl.algorithms.register_rollout_correction('name'), "
        "or name a function in the config as 'path/to/file.py:function'.",
    )


def _token_log_ratio(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> Tensor:
    """log ρ_t per token, 0 on padding."""
    log_ratio = (old_logp.detach().float() - rollout_logp.float()) * response_mask
    return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _sequence_log_ratio(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> Tensor:
    """log ρ_i = Σ_t log ρ_t over each sequence's valid tokens, broadcast to them [B, T]."""
    per_seq = masked_sum(_token_log_ratio(old_logp, rollout_logp, response_mask), response_mask, dim=-1)
    return per_seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)[:, None].expand(response_mask.shape)


def _result(ratio: Tensor, weights: Tensor, response_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    mask = response_mask.float()
    weights = weights * mask
    valid = mask.bool()
    return weights.detach(), {
        "mean": masked_mean(weights, mask).detach(),
        "capped_frac": masked_mean((weights != ratio).float(), mask).detach(),
        "ratio_max": ratio[valid].max().detach() if valid.any() else torch.tensor(0.0),
    }


def _truncated(log_ratio: Tensor, response_mask: Tensor, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    ratio = torch.exp(log_ratio)
    return _result(ratio, ratio.clamp(max=cap), response_mask)


def _masked(log_ratio: Tensor, response_mask: Tensor, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    ratio = torch.exp(log_ratio)
    inside = (ratio >= 1 / cap) & (ratio <= cap)
    return _result(ratio, torch.where(inside, ratio, torch.zeros_like(ratio)), response_mask)


@register_rollout_correction("tis")
@torch.no_grad()
def token_tis(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0, **kwargs: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling per token (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): w_t = min(ρ_t, C)."""
    return _truncated(_token_log_ratio(old_logp, rollout_logp, response_mask), response_mask, cap)


@register_rollout_correction("seq_tis")
@torch.no_grad()
def sequence_tis(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0, **kwargs: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling per sequence: w_it = min(ρ_i, C) with ρ_i = Π_t ρ_t, the unbiased
    ratio for a sequence-level reward (before the cap), at the price of a higher variance."""
    return _truncated(_sequence_log_ratio(old_logp, rollout_logp, response_mask), response_mask, cap)


@register_rollout_correction("mis")
@torch.no_grad()
def token_mis(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0, **kwargs: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling per token (Liu et al. 2025, "When speed kills stability"):
    w_t = ρ_t inside the band 1/C ≤ ρ_t ≤ C, else 0: a token the two policies disagree on that much
    is left out of the update rather than weighted at the cap."""
    return _masked(_token_log_ratio(old_logp, rollout_logp, response_mask), response_mask, cap)


@register_rollout_correction("seq_mis")
@torch.no_grad()
def sequence_mis(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0, **kwargs: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling per sequence: w_it = ρ_i inside 1/C ≤ ρ_i ≤ C, else 0 for the whole
    sequence (rejection of responses the trainer's policy would hardly have sampled)."""
    return _masked(_sequence_log_ratio(old_logp, rollout_logp, response_mask), response_mask, cap)
