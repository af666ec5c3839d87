"""Turn-level credit for games: GiGPO over the moves of trajectories that share a start.

A game trajectory is one row whose policy tokens fall in one run per assistant turn (a move), with the
observation tokens between them masked out. Trajectory-level GRPO gives every move of an episode the
episode's advantage. GiGPO (`mmrl.algorithms.advantages.gigpo`) adds a step level: moves chosen in the
same state (the same frame and instruction, `mmrl.agent.game.state_key`) by the episodes of one start
are compared by their discounted return-to-go. Here each move is one GiGPO row, its reward 0 except the
last move's, which carries the trajectory's score (the reward functions' total); each move's advantage
then goes on all of its tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.agent.game import STATES
from mmrl.data.batch import Batch


def turn_spans(policy: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of policy tokens in one row's mask: the row's assistant turns in order."""
    flags = policy.bool().tolist()
    spans, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def turn_advantages(estimator: Any, batch: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO advantages and returns (B, T) for a batch of game trajectories (see the module);
    `options` are the estimator's (gamma, step_weight, norm_adv_by_std)."""
    mask = batch["response_mask"]
    spans = [turn_spans(row) for row in mask]
    states = [batch.prompts[i].extra.get(STATES) for i in batch["prompt_index"].tolist()]
    anchors: dict[tuple[int, str], int] = {}
    rewards, groups, episodes, anchor_ids = [], [], [], []
    for row, (row_spans, row_states) in enumerate(zip(spans, states, strict=True)):
        if row_states is None or len(row_states) < len(row_spans):
            raise ValueError(
                f"trajectory {row} has {len(row_spans)} moves but {len(row_states or [])} recorded states: "
                "turn-level credit (algorithm.adv_estimator=gigpo) needs a game's trajectories (agent.game)"
            )
        group = int(batch["group_index"][row])
        for turn in range(len(row_spans)):
            last = turn == len(row_spans) - 1
            rewards.append(float(batch["scores"][row]) if last else 0.0)
            groups.append(group)
            episodes.append(row)
            anchor_ids.append(anchors.setdefault((group, row_states[turn]), len(anchors)))
    step = torch.tensor(rewards)[:, None]
    advantages, returns = estimator(
        step,
        torch.ones_like(step),
        torch.tensor(groups),
        episode_index=torch.tensor(episodes),
        anchor_index=torch.tensor(anchor_ids),
        **options,
    )
    token_adv, token_ret = torch.zeros(mask.shape), torch.zeros(mask.shape)
    flat = 0
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            token_adv[row, start:end] = advantages[flat, 0]
            token_ret[row, start:end] = returns[flat, 0]
            flat += 1
    return token_adv, token_ret
