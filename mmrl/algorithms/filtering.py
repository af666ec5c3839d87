"""DAPO dynamic sampling (Yu et al. 2025): keep only groups whose rewards differ.

A group whose n responses all score the same (all right or all wrong) has advantage 0
under any group baseline, so it only dilutes the batch; DAPO drops such groups and
samples more prompts until the batch is full of groups that carry a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def informative_groups(scores: Tensor, group_index: Tensor, atol: float = 0.0) -> Tensor:
    """Bool [B]: True for rows whose group's scores are not all equal (max − min > atol).

    A group of one is never informative: there is nothing to compare it with.
    """
    ids = torch.unique(group_index, return_inverse=True)[1]
    scores = scores.float()
    high = torch.full_like(scores, -torch.inf).scatter_reduce(0, ids, scores, reduce="amax")
    low = torch.full_like(scores, torch.inf).scatter_reduce(0, ids, scores, reduce="amin")
    return (high - low)[ids] > atol
