"""Episodes in lockstep: every live env gets a decision from one batched `generate` call per step.

A decision is one response of `tokenizer.n_tokens` action tokens to one frame, or, for a policy with a
continuous action head, one chunk its engine drew (`actions`). The batch that comes
back has a row per decision, each pointing at its own prompt (its frame), plus `episode_index`
and `group_index` columns: episodes that started from the same seed form a group, as the n
responses to one prompt do in GRPO on text. Step-level estimators (GiGPO) also get each decision's
own reward (`step_rewards`) and `anchor_index`: equal for decisions that saw the same prompt.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from mmrl.data.batch import Batch, concat
from mmrl.data.sample import PromptSample
from mmrl.envs.actions import ActionTokenizer, ContinuousActions, InvalidAction
from mmrl.envs.vector import VectorEnv
from mmrl.rollout import SamplingParams
from mmrl.rollout.base import RolloutEngine
from mmrl.vla.observations import ObservationPrompts

log = logging.getLogger("mmrl.vla")

# How a policy's decisions become env actions: its action tokens' bins, or its continuous head's chunk.
Actions = ActionTokenizer | ContinuousActions


@dataclass
class Episodes:
    """Decisions as a trainable batch, and what each episode came to."""

    batch: Batch
    returns: torch.Tensor  # (E,) env reward summed, minus the invalid-action penalty
    success: torch.Tensor  # (E,) bool
    lengths: torch.Tensor  # (E,) decisions taken
    invalid: dict[str, int] = field(default_factory=dict)  # malformed decisions by kind
    bad_rewards: int = 0  # env steps whose reward was not a finite number, scored 0
    frames: list[list[np.ndarray]] = field(default_factory=list)  # the first `record` episodes' frames

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/success": float(self.success.float().mean()),
            f"{prefix}/return": float(self.returns.mean()),
            f"{prefix}/episode_length": float(self.lengths.float().mean()),
            f"{prefix}/invalid_actions": float(sum(self.invalid.values())),
            f"{prefix}/bad_env_rewards": float(self.bad_rewards),
        }


def run_episodes(
    engine: RolloutEngine,
    envs: VectorEnv,
    prompts: ObservationPrompts,
    tokenizer: Actions,
    seeds: list[int],
    params: SamplingParams,
    *,
    group_size: int = 1,
    invalid_penalty: float = 0.0,
    record: int = 0,
) -> Episodes:
    """Run one episode per seed until every episode has ended: all at once when `envs` holds one env
    per seed, else in waves of `envs.num_envs` (a simulator whose envs would not all fit in memory).

    Consecutive runs of `group_size` seeds form a group (pass each seed `group_size` times). A
    malformed response is applied as the zero action, counted, and costs `invalid_penalty`."""
    size = envs.num_envs
    anchor_ids: dict[bytes, int] = {}  # shared by the waves: equal states get one anchor across them
    waves = [
        _run_wave(
            engine,
            envs,
            prompts,
            tokenizer,
            seeds[start : start + size],
            params,
            invalid_penalty,
            max(0, record - start),
            anchor_ids,
        )
        for start in range(0, len(seeds), size)
    ]
    for k, wave in enumerate(waves):
        wave.batch.set(episode_index=wave.batch["episode_index"] + k * size)
    batch = concat([w.batch for w in waves])
    returns = torch.cat([w.returns for w in waves])
    batch.set(group_index=batch["episode_index"] // group_size, scores=returns[batch["episode_index"]])
    invalid = sum((Counter(w.invalid) for w in waves), Counter())
    return Episodes(
        batch=batch,
        returns=returns,
        success=torch.cat([w.success for w in waves]),
        lengths=torch.cat([w.lengths for w in waves]),
        invalid=dict(invalid),
        bad_rewards=sum(w.bad_rewards for w in waves),
        frames=[f for w in waves for f in w.frames],
    )


def _run_wave(
    engine: RolloutEngine,
    envs: VectorEnv,
    prompts: ObservationPrompts,
    tokenizer: Actions,
    seeds: list[int],
    params: SamplingParams,
    invalid_penalty: float,
    record: int,
    anchor_ids: dict[bytes, int],
) -> Episodes:
    """One episode per seed, one env each (spare envs idle), in lockstep; `episode_index` counts from 0."""
    n = len(seeds)
    obs = [r[0] for r in envs.reset([*seeds, *[None] * (envs.num_envs - n)])[:n]]
    returns, success, lengths = np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
    live = np.ones(n, dtype=bool)
    invalid: dict[str, int] = {}
    bad_rewards = 0
    frames: list[list[np.ndarray]] = [[obs[i]["image"]] for i in range(min(record, n))]
    recent = [deque([o["image"]] * prompts.history, maxlen=prompts.history) for o in obs]
    params = replace(params, n=1, max_new_tokens=tokenizer.n_tokens)
    parts, step_rewards, anchors = [], [], []
    while live.any():
        idx = np.flatnonzero(live).tolist()
        samples = prompts([obs[i] for i in idx], row_ids=idx, frames=[list(recent[i]) for i in idx])
        out = engine.generate(samples, params)
        out.set(episode_index=torch.tensor(idx), truncated=torch.zeros(len(idx), dtype=torch.bool))
        parts.append(out)
        anchors += [anchor_ids.setdefault(_state_key(s), len(anchor_ids)) for s in samples]
        before = returns[idx].copy()
        chunks: list[np.ndarray | None] = [None] * n
        for row, i in enumerate(idx):
            if "actions" in out:  # a continuous head's chunk
                action = tokenizer.decode(out["actions"][row].numpy())
            else:
                action = tokenizer.decode(out["response_ids"][row][out["response_mask"][row].bool()].tolist())
            if isinstance(action, InvalidAction):
                invalid[action.kind] = invalid.get(action.kind, 0) + 1
                log.debug("episode %d (seed %d): invalid action: %s", i, seeds[i], action.reason)
                returns[i] -= invalid_penalty
                action = np.zeros((tokenizer.chunk, tokenizer.action_dim))
            chunks[i] = action
            lengths[i] += 1
        for k in range(tokenizer.chunk):  # a chunk's steps in order; an episode may end mid-chunk
            step = [chunks[i][k] if live[i] else None for i in range(n)]  # live: decided this round
            # Only the chunk's last `history` frames reach the next decision; the rest go unrendered,
            # except in recorded episodes.
            seen = k >= tokenizer.chunk - prompts.history
            render = [seen or i < len(frames) for i in range(envs.num_envs)]
            for i, result in enumerate(envs.step([*step, *[None] * (envs.num_envs - n)], render)[:n]):
                if result is None:
                    continue
                obs[i], reward, terminated, truncated, info = result
                if not _finite(reward):  # a NaN would make every advantage of its group NaN, then 0
                    if not bad_rewards:
                        log.warning(
                            "episode %d (seed %d): the env's reward is %r, not a finite number: the step "
                            "scores 0 (counted in episode/bad_env_rewards; later ones only counted)",
                            i,
                            seeds[i],
                            reward,
                        )
                    bad_rewards += 1
                    reward = 0.0
                returns[i] += reward
                if seen:
                    recent[i].append(obs[i]["image"])
                if i < len(frames):
                    frames[i].append(obs[i]["image"])
                if terminated or truncated:
                    live[i], success[i] = False, bool(info["success"])
        step_rewards.append(returns[idx] - before)
    batch = concat(parts)
    batch.set(
        step_rewards=torch.tensor(np.concatenate(step_rewards), dtype=torch.float32),
        anchor_index=torch.tensor(anchors),
    )
    return Episodes(
        batch=batch,
        returns=torch.tensor(returns, dtype=torch.float32),
        success=torch.tensor(success),
        lengths=torch.tensor(lengths),
        invalid=invalid,
        bad_rewards=bad_rewards,
        frames=frames,
    )


def _finite(reward: object) -> bool:
    """Whether an env's step reward is a usable number (a custom env may return NaN, inf or None)."""
    try:
        return math.isfinite(float(reward))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _state_key(sample: PromptSample) -> bytes:
    """What makes two decisions' states equal: the same prompt text and the same pixels."""
    digest = hashlib.blake2b(sample.prompt_text.encode(), digest_size=16)
    if sample.pixel_values is not None:
        digest.update(sample.pixel_values.numpy().tobytes())
    return digest.digest()
