"""Which responses a step trains on: DAPO's dynamic sampling and PF-PPO's policy filtration.

DAPO (Yu et al. 2025): a group whose n responses all score the same (all right or all wrong) has
advantage 0 under any group baseline, so it only dilutes the batch; DAPO drops such groups and samples
more prompts until the batch is full of groups that carry a gradient (`informative_groups`).

PF-PPO (Zhang et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code Generation", arXiv
2409.06957, §4): a reward model is reliable at the extremes of its range and noisy in the middle, so
training only on each prompt's best (and worst) responses raises the signal-to-noise ratio of the
update. The filters are registered by name in `POLICY_FILTERS` and run on the scored groups, after
dynamic sampling and before advantages (``algorithm.policy_filtration``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmrl.algorithms.registry import Needs, lookup, register

# fn(scores [B], group_index [B], generator) -> Bool [B], the rows kept
PolicyFilter = Callable[[Tensor, Tensor, torch.Generator | None], Tensor]

POLICY_FILTERS: dict[str, PolicyFilter] = {}


def register_policy_filter(
    name: str, *aliases: str, needs: Needs | None = None
) -> Callable[[PolicyFilter], PolicyFilter]:
    """Add `fn(scores, group_index, generator) -> Bool[B]`; `needs.rows_per_group` says how many rows
    of a group it keeps at most."""
    return register(POLICY_FILTERS, name, *aliases, needs=needs)


def get_policy_filter(name: str) -> PolicyFilter:
    """The filter registered as `name`; KeyError lists the choices."""
    return lookup(
        POLICY_FILTERS,
        name,
        what="policy filter",
        how_to_add="Add one with @mmrl.algorithms.register_policy_filter('name').",
    )


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


def _extreme_rows(scores: Tensor, ids: Tensor, best: bool) -> Tensor:
    """Per group, the row index of its best score (the first such row) or its worst (the last such row),
    so that a group of equal scores still gives two different rows."""
    rows = torch.arange(len(scores))
    target = scores.float() if best else -scores.float()
    top = torch.full((int(ids.max()) + 1,), -torch.inf).scatter_reduce(0, ids, target, reduce="amax")
    at_top = target == top[ids]
    fill, reduce = (len(scores), "amin") if best else (-1, "amax")
    return torch.full_like(top, fill, dtype=torch.long).scatter_reduce(
        0, ids[at_top], rows[at_top], reduce=reduce
    )


@register_policy_filter("best_of_n", needs=Needs(rows_per_group=1))
@torch.no_grad()
def best_of_n(scores: Tensor, group_index: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """PF-PPO's BoN: keep each group's best response only (the first, on a tie).

    One response a prompt: a group baseline has nothing left to compare, so pair it with an estimator
    that needs no group (gae, reinforce_plus_plus, remax), as the paper pairs it with PPO's critic.
    """
    if not len(scores):
        return torch.zeros(0, dtype=torch.bool)
    ids = torch.unique(group_index, return_inverse=True)[1]
    keep = torch.zeros(len(scores), dtype=torch.bool)
    keep[_extreme_rows(scores, ids, best=True)] = True
    return keep


@register_policy_filter("best_worst", needs=Needs(rows_per_group=2))
@torch.no_grad()
def best_worst(scores: Tensor, group_index: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """PF-PPO's BW: keep each group's best and worst response (the first best and the last worst, so a
    group of equal scores keeps two rows; a group of one keeps its row)."""
    keep = best_of_n(scores, group_index)
    if len(scores):
        keep[_extreme_rows(scores, torch.unique(group_index, return_inverse=True)[1], best=False)] = True
    return keep


@register_policy_filter("best_random", needs=Needs(rows_per_group=2))
@torch.no_grad()
def best_random(scores: Tensor, group_index: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """PF-PPO's BR: keep each group's best response and one other drawn uniformly from the rest of the
    group (with `generator`); a group of one keeps its row."""
    keep = best_of_n(scores, group_index)
    ids = torch.unique(group_index, return_inverse=True)[1]
    draw = torch.rand(len(scores), generator=generator)
    draw[keep] = -1.0  # the best row is not drawn again
    top = torch.full((len(scores),), -1.0).scatter_reduce(0, ids, draw, reduce="amax")
    keep |= (draw == top[ids]) & (draw >= 0)
    return keep
