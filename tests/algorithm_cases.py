"""The small batches the algorithm tests work out by hand: padding, uneven groups, a group of one and an
all-equal group (tests/test_algorithms.py, tests/test_algorithms_cited.py)."""

from __future__ import annotations

import torch
from torch import Tensor

PAD = 99.0  # junk written on padding: any result it reaches is wrong


def close(actual: Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- advantages
# Seven responses, T = 3, outcome score on the last valid token, junk on padding.
# group 7: rows 0, 2, 4, 6 with scores 1, 0, 0, 1   (a normal group)
# group 3: row 1 with score 5                        (a group of one)
# group 1: rows 3, 5 with scores 2, 2                (an all-equal group)
REWARDS = torch.tensor(
    [
        [0.0, 0.0, 1.0],
        [0.0, 5.0, PAD],
        [0.0, PAD, PAD],
        [0.0, 2.0, PAD],
        [0.0, 0.0, PAD],
        [0.0, 0.0, 2.0],
        [0.0, 0.0, 1.0],
    ]
)
MASK = torch.tensor(
    [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float32
)
GROUPS = torch.tensor([7, 3, 7, 1, 7, 1, 7])
SCORES = [1.0, 5.0, 0.0, 2.0, 0.0, 2.0, 1.0]


def per_token(per_seq: list[float], mask: Tensor = MASK) -> list[list[float]]:
    """Spread one value per row over that row's valid tokens of `mask` (0 on padding)."""
    return [[v * m for m in row] for v, row in zip(per_seq, mask.tolist(), strict=True)]


def ppo_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows of 3 valid tokens + 1 padding; ratios ρ and advantages A chosen per token.

    row 0: (A=+1, ρ=1.5) (A=−1, ρ=1.5) (A=+1, ρ=0.5) | pad
    row 1: (A=−1, ρ=0.5) (A=+2, ρ=1.0) (A=+1, ρ=1.25) | pad
    Padding has a huge ratio and advantage: it would dominate the loss if it leaked in.
    log π_old = −1, so log π = −1 + ln ρ: −0.5945349 (ρ 1.5), −1.6931472 (ρ 0.5), −1 (ρ 1), −0.7768564 (ρ 1.25).
    """
    ratios = torch.tensor([[1.5, 1.5, 0.5, 1.0], [0.5, 1.0, 1.25, 1.0]])
    old_logp = torch.full((2, 4), -1.0)
    logp = (old_logp + ratios.log()).clone()
    logp[:, 3] = 40.0
    logp.requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 1.0, 50.0], [-1.0, 2.0, 1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float32)
    return logp, old_logp, advantages, mask
