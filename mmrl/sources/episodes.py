"""Simulator episodes as the source of a training step's rollouts (`mmrl.sources.base`).

Each step runs `rollout.n` episodes from each of `data.train_batch_size` initial states. An episode's
return is the reward of every decision in it, and advantages are normalised over the episodes that
share an initial state (trajectory-level GRPO), so each episode counts once however long it ran.
With a learned critic (`algorithm.adv_estimator=gae`) each decision is credited by GAE over its
episode's decisions instead (`decision_advantages`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.algorithms import first_rows, get_advantage_estimator, informative_groups
from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.data.dataset import image_budget
from mmrl.envs.actions import ActionTokenizer
from mmrl.envs.vector import LocalEnvs, VectorEnv
from mmrl.errors import ConfigError
from mmrl.rollout import SamplingParams
from mmrl.run.checkpoint import rng_devices
from mmrl.sources.base import RolloutSource, StepContext
from mmrl.training.optim import UpdatePlan
from mmrl.vla.episodes import Actions, Episodes, run_episodes
from mmrl.vla.media import episodes_gif
from mmrl.vla.observations import ObservationPrompts
from mmrl.vla.sft import acting_on, policy_actions, save_action_tokenizer


def train_env_count(cfg: Any) -> int:
    """The envs a training run asks for: one per training episode of a step or per evaluation episode."""
    return max(cfg.data.train_batch_size * cfg.rollout.n, cfg.env.val_episodes)


def env_workers(cfg: Any, count: int) -> int:
    """The Ray env workers that `count` envs take: `env.num_workers`, but no more than the envs alive."""
    return min(cfg.env.num_workers, count, cfg.env.max_envs or count)


def make_envs(cfg: Any, count: int) -> VectorEnv:
    """`count` envs of the configured task (at most `env.max_envs`): in this process, or over
    `env.num_workers` Ray workers."""
    env = cfg.env
    count = min(count, env.max_envs or count)
    if not env.num_workers:
        return LocalEnvs(env.task, count, env.options)
    from mmrl.envs.workers import EnvPool
    from mmrl.workers.cluster import connect

    connect(cfg.trainer.ray_address)
    return EnvPool(
        env.task,
        count,
        env_workers(cfg, count),
        env.options,
        timeout_s=env.timeout_s,
        max_restarts=env.max_restarts,
    )


def train_seeds(seed: int, step: int, count: int, below: int) -> list[int]:
    """The initial states of a step: a function of (run seed, step) alone, so a resumed run meets the
    same ones, and all below the evaluation seeds so training never sees an evaluation scene."""
    return np.random.default_rng([seed, step, 3]).integers(0, below, size=count).tolist()


def episode_tokenizer(cfg: Any, model_path: str, vocab_size: int, action_dim: int) -> Actions:
    """How the policy `mmrl sft` saved acts (its action tokens' bins or its continuous head's chunks),
    or fresh bins over [-1, 1] for a model never taught actions (then RL must discover the action tokens
    on its own)."""
    saved = policy_actions(model_path)
    if saved is not None:
        return acting_on(saved, model_path, cfg.env.task, action_dim)
    return ActionTokenizer.for_vocab(vocab_size, action_dim, n_bins=cfg.env.n_bins, chunk=cfg.env.chunk)


class EpisodeSource(RolloutSource):
    """Simulator episodes as a rollout source: rewards are returns, validation is a success rate, and a
    checkpoint's model folder carries the action tokenizer. It keeps no state of its own in a checkpoint:
    a step's seeds follow from the step number."""

    def __init__(self, cfg: Config, processor: Any, model_config: Any) -> None:
        self.cfg = cfg
        self.envs = make_envs(cfg, train_env_count(cfg))
        self.action_tokenizer = episode_tokenizer(
            cfg, cfg.model.path, model_config.get_text_config().vocab_size, self.envs.action_dim
        )
        self.prompts = ObservationPrompts(
            processor, image_budget(cfg.data, model_config), cfg.env.prompt, cfg.env.history
        )
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.validates = cfg.env.val_episodes > 0

    def episodes(
        self, ctx: StepContext, seeds: list[int], params: SamplingParams, group_size: int = 1, record: int = 0
    ) -> Episodes:
        with ctx.guard("episode rollout"):
            return run_episodes(
                ctx.engine,
                self.envs,
                self.prompts,
                self.action_tokenizer,
                seeds,
                params,
                group_size=group_size,
                invalid_penalty=self.cfg.env.invalid_penalty,
                record=record,
            )

    def rollouts(self, ctx: StepContext) -> tuple[Batch, dict[str, Any]]:
        """The step's episodes; with dynamic sampling, only groups whose returns differ (one round:
        a fresh round would need fresh initial states and as long again)."""
        cfg, r = self.cfg, self.cfg.rollout
        seeds = train_seeds(cfg.trainer.seed, ctx.step, cfg.data.train_batch_size, cfg.env.val_seed)
        params = SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, logprobs=ctx.engine.logprobs_are_free
        )
        with ctx.timer("rollout"):
            episodes = self.episodes(ctx, [s for s in seeds for _ in range(r.n)], params, group_size=r.n)
        batch = episodes.batch
        metrics = episodes.metrics("episode")
        metrics["reward/mean"] = float(episodes.returns.mean())
        metrics.update({f"episode/invalid_{k}": v for k, v in episodes.invalid.items()})
        if cfg.algorithm.dynamic_sampling:
            keep = informative_groups(batch["scores"], batch["group_index"])
            metrics["dynamic_sampling/kept_groups"] = len(batch["group_index"][keep].unique())
            batch = batch.select(keep.nonzero().squeeze(1))
        return batch, metrics

    def metrics(self, batch: Batch) -> dict[str, Any]:
        return {"env/restarts": self.envs.restarts}

    def advantages(
        self, batch: Batch, metrics: dict[str, Any], ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.cfg.algorithm
        options = a.estimator_options()
        if a.adv_estimator == "gigpo":
            return step_advantages(self.estimator, batch, step_weight=a.step_weight, **options)
        if "values" in batch:  # a learned critic: GAE over each episode's decisions
            return decision_advantages(self.estimator, batch, **options)
        return episode_advantages(self.estimator, batch, **options)

    def update_plan(self, batch: Batch) -> UpdatePlan:
        """`data.train_batch_size / actor.mini_batch_size` optimizer steps per epoch over the decisions."""
        a = self.cfg.actor
        steps = self.cfg.data.train_batch_size // a.mini_batch_size
        return UpdatePlan(-(-len(batch) // steps), a.ppo_epochs, self.action_tokenizer.n_tokens)

    def validate(self, ctx: StepContext) -> dict[str, Any]:
        """Success over the fixed evaluation seeds, and a GIF of the first `env.media_episodes`.

        Sampled validation (`rollout.val.temperature > 0`) draws from its own seeded stream, so it
        leaves the training run's RNG alone and `mmrl eval` of the checkpoint reproduces it."""
        env, v = self.cfg.env, self.cfg.rollout.val
        if not env.val_episodes:
            return {}
        params = SamplingParams(temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)
        seeds = list(range(env.val_seed, env.val_seed + env.val_episodes))
        with torch.random.fork_rng(devices=rng_devices()):  # the same draws at every validation
            torch.manual_seed(self.cfg.trainer.seed)
            episodes = self.episodes(ctx, seeds, params, record=env.media_episodes)
        metrics = episodes.metrics("val")
        metrics["val/accuracy"] = metrics["val/success"]
        if episodes.frames:
            shown = episodes.success[: len(episodes.frames)].tolist()
            episodes_gif(episodes.frames, shown, self.cfg.run_dir / "media" / f"step_{ctx.step:06d}.gif")
        return metrics

    def warmup(self, model: Any, tokenizer: Any, seed: int) -> list[float]:
        raise ConfigError("episode runs start from demonstrations (`mmrl sft`), not a format warm-up")

    def save_files(self, model_folder: Path) -> None:
        """The action tokenizer beside the checkpoint's model (a continuous head's files are the model's)."""
        if isinstance(self.action_tokenizer, ActionTokenizer):
            save_action_tokenizer(self.action_tokenizer, model_folder)

    def close(self) -> None:
        self.envs.close()


def episode_advantages(estimator: Any, batch: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Trajectory-level advantages: `estimator` (a registry entry) over episodes, one return each and
    grouped by initial state, then each decision takes its episode's value on every action token.

    Normalising over episodes rather than decisions keeps a long failed episode from outweighing a
    short successful one in its group's mean and std."""
    position, first = first_rows(batch["episode_index"])
    returns = batch["scores"][first][:, None]
    advantages, targets = estimator(returns, torch.ones_like(returns), batch["group_index"][first], **options)
    mask = batch["response_mask"].float()
    return advantages[position] * mask, targets[position] * mask


def step_advantages(estimator: Any, batch: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Decision-level advantages (GiGPO): `estimator` over every decision with its own reward, its
    episode and its state, then each decision's value on all of its action tokens."""
    rewards = batch["step_rewards"][:, None]
    advantages, targets = estimator(
        rewards,
        torch.ones_like(rewards),
        batch["group_index"],
        episode_index=batch["episode_index"],
        anchor_index=batch["anchor_index"],
        **options,
    )
    mask = batch["response_mask"].float()
    return advantages * mask, targets * mask


def decision_advantages(estimator: Any, batch: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages from a learned critic (GAE, PPO's estimator): each episode's decisions form one
    sequence in time order, decision t with its own reward r_t and the critic's V(s_t), read where the
    decision's prompt ends (before any of its action tokens). The estimator runs over those sequences as
    over a response's tokens, so δ_t = r_t + γ V(s_{t+1}) − V(s_t), with V = 0 after the last decision:
    an episode's end, by success or by its time limit, is terminal, as the return counts only what the
    episode collected. Each decision's advantage and return then stand on all of its action tokens (the
    critic regresses every one of its positions on the decision's return).

    Unlike the group baselines this needs no group, and credits each decision with what followed it
    rather than with the whole episode's return."""
    position, first = first_rows(batch["episode_index"])
    order = torch.argsort(position, stable=True)  # each episode's rows together, still in time order
    counts = torch.bincount(position)
    starts = counts.cumsum(0) - counts
    time = torch.empty_like(position)
    time[order] = torch.arange(len(position)) - starts[position[order]]  # each row's decision index
    shape = (len(first), int(time.max()) + 1)
    rewards = torch.zeros(shape).index_put_((position, time), batch["step_rewards"].float())
    values = torch.zeros(shape).index_put_((position, time), batch["values"][:, 0].float())
    taken = torch.zeros(shape).index_put_((position, time), torch.ones(len(position)))
    advantages, returns = estimator(rewards, taken, batch["group_index"][first], values=values, **options)
    mask = batch["response_mask"].float()
    return advantages[position, time][:, None] * mask, returns[position, time][:, None] * mask
