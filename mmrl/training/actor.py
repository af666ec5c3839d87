"""The policy's training side: the clipped policy-gradient update over the shared forward
(`mmrl.training.forward`), and what a run's actor is built from."""

from __future__ import annotations

import logging
from typing import Any

import torch

from mmrl.algorithms import (
    agg_loss,
    get_advantage_estimator,
    get_policy_filter,
    get_policy_loss,
    get_rollout_correction,
    kl_penalty,
    masked_mean,
    needs_of,
    positive_example_nll,
)
from mmrl.config import ActorConfig, Config
from mmrl.data.batch import Batch
from mmrl.errors import ConfigError
from mmrl.models import family_of
from mmrl.training.forward import evaluate_rows, forward_logprobs
from mmrl.training.micro_batches import Layout, micro_layout
from mmrl.training.optim import MiniBatch, TrainedModel, UpdatePlan, per_minibatch

log = logging.getLogger("mmrl.training.actor")


class Actor(TrainedModel):
    """Owns the policy's optimizer and runs the PPO-style update over a batch of rollouts: one optimizer
    step per planned mini-batch (`update`)."""

    prefix = "actor"

    def __init__(
        self,
        model: Any,
        cfg: ActorConfig,
        pad_id: int,
        temperature: float,
        response_len: int,
        total_updates: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(
            model,
            cfg,
            total_updates,
            cfg.micro_batch_size,
            cfg.max_tokens_per_micro_batch,
            pad_id,
            compute_dtype,
            cfg.padding_free,
        )
        self.cfg: ActorConfig = cfg
        self.temperature = temperature
        self.response_len = response_len
        self.policy_loss = get_policy_loss(cfg.policy_loss)
        self.rollout_correction = (
            get_rollout_correction(cfg.rollout_correction) if cfg.rollout_correction else None
        )

    def logprobs(self, batch: Batch, model: Any = None, layout: Layout | None = None) -> torch.Tensor:
        """Log-probs of every row under `model` (default: the policy; or the frozen reference), micro-batched:
        by `layout` where the worker group chose it, else by the config."""
        model = model if model is not None else self.model
        return evaluate_rows(
            model,
            batch,
            self.cfg.micro_batch_size,
            lambda micro: forward_logprobs(
                model,
                micro,
                self.pad_id,
                self.temperature,
                compute_dtype=self.compute_dtype,
                padding_free=self.padding_free,
            )[0],
            layout if layout is not None else micro_layout(batch, self.cfg.max_tokens_per_micro_batch),
        )

    def _micro_step(self, micro: Batch, totals: dict[str, float]) -> dict[str, float]:
        cfg = self.cfg
        router_losses: list[torch.Tensor] | None = [] if cfg.router_aux_loss_coef else None
        logp, entropy = forward_logprobs(
            self.model,
            micro,
            self.pad_id,
            self.temperature,
            with_entropy="grad" if cfg.entropy_coef else True,
            compute_dtype=self.compute_dtype,
            router_losses=router_losses,
            padding_free=self.padding_free,
        )
        device = logp.device
        mask = micro["response_mask"].to(device).float()
        old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else logp.detach()
        advantages, is_metrics = self._corrected_advantages(micro, old, mask)
        pg_loss, pg_metrics = self.policy_loss(
            logp,
            old,
            advantages,
            mask,
            loss_agg_mode=cfg.loss_agg_mode,
            agg_kwargs=totals,
            **cfg.policy_loss_options(),
        )
        loss = pg_loss
        entropy_value = agg_loss(entropy, mask, cfg.loss_agg_mode, **totals)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_value
        stats = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_value.detach())}
        if "rollout_logprobs" in micro:  # how far the engine's sampling distribution is from the trainer's
            gap = (logp.detach() - micro["rollout_logprobs"].to(device)).abs()
            stats["actor/rollout_logprob_diff"] = float(masked_mean(gap, mask))
        if cfg.use_kl_loss and "ref_logprobs" in micro:  # the reference may be loaded for the KL reward only
            kl = agg_loss(
                kl_penalty(logp, micro["ref_logprobs"].to(device), cfg.kl_loss_type),
                mask,
                cfg.loss_agg_mode,
                **totals,
            )
            loss = loss + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"] = float(kl.detach())
        if cfg.positive_lm_coef:  # VAPO: imitate the responses that scored above 0
            nll = positive_example_nll(logp, mask, micro["scores"].to(device), **totals)
            loss = loss + cfg.positive_lm_coef * nll
            stats["actor/positive_lm_loss"] = float(nll.detach())
        if router_losses:  # a micro-batch's share of the mini-batch's load-balancing loss
            router = router_losses[0] * len(micro) / totals["num_seqs"]
            loss = loss + cfg.router_aux_loss_coef * router
            stats["actor/router_aux_loss"] = float(router.detach())
        loss.backward()
        stats.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
        stats.update({f"actor/rollout_is_{k}": float(v) for k, v in is_metrics.items()})
        return per_minibatch(stats, len(micro), totals)

    def _corrected_advantages(
        self, micro: Batch, old: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The advantages, weighted by `actor.rollout_correction` for the gap between the engine that
        sampled and the old policy (`mmrl.algorithms.rollout_correction`), and that correction's metrics."""
        advantages = micro["advantages"].to(old.device)
        if self.rollout_correction is None:
            return advantages, {}
        if "rollout_logprobs" not in micro:
            raise RuntimeError(
                "actor.rollout_correction needs the sampling engine's log-probs (rollout_logprobs), and this "
                "batch has none: a rollout source that records them is required"
            )
        weights, metrics = self.rollout_correction(
            old, micro["rollout_logprobs"].to(old.device), mask, cap=self.cfg.rollout_correction_cap
        )
        return advantages * weights, metrics


def update_actor(policy: Any, batch: Batch, plan: list[MiniBatch], step: int) -> dict[str, Any]:
    """One policy update (in-process or the workers') on `plan`; its metrics, with the updates that a
    non-finite gradient skipped counted and logged."""
    stats = policy.update(batch, plan)
    if stats.skipped_steps:
        log.warning(
            "step %d: %d of %d actor updates skipped for a non-finite gradient norm (NaN/inf); they changed "
            "no weights and no optimizer state",
            step,
            stats.skipped_steps,
            stats.steps,
        )
    return {**stats.metrics, "actor/updates": stats.steps, "actor/skipped_updates": stats.skipped_steps}


def optimizer_steps(cfg: Config, epochs: int) -> int:
    """Optimizer steps over the whole run, the length of the learning-rate schedule."""
    return cfg.trainer.total_steps * epochs * (cfg.data.train_batch_size // cfg.actor.mini_batch_size)


def build_actor(cfg: Config, model: Any, pad_id: int, compute_dtype: torch.dtype) -> Actor:
    """The run's actor over `model`'s trainable parameters (all of them, or the LoRA adapters)."""
    family = family_of(model)
    if cfg.actor.router_aux_loss_coef and not family.mixture_of_experts:
        raise ConfigError(
            f"actor.router_aux_loss_coef={cfg.actor.router_aux_loss_coef}: {family.name} models have no "
            "experts to balance; set it to 0"
        )
    if cfg.actor.padding_free is True and not family.packs_sequences:
        raise ConfigError(
            f"actor.padding_free: {family.name} models {family.why_unpacked}; set it to false or auto"
        )
    checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if cfg.actor.padding_free is True and checkpointing and next(model.parameters()).device.type == "cpu":
        log.warning(
            "actor.padding_free with gradient checkpointing on a CPU: the recomputed forward cannot run "
            "mmrl's per-sequence attention, so transformers keeps packed sequences apart with a dense mask "
            "over the whole pack, which costs more than the padding it saves (0.60x the padded update at a "
            "108M-parameter shape, docs/benchmarks.md); turn one of them off"
        )
    actor = Actor(
        model,
        cfg.actor,
        pad_id,
        cfg.rollout.temperature or 1.0,
        cfg.rollout.max_new_tokens,
        total_updates=optimizer_steps(cfg, cfg.actor.ppo_epochs),
        compute_dtype=compute_dtype,
    )
    if cfg.actor.padding_free == "auto":
        log.info(
            "actor.padding_free=auto: %s (%s, language model %d wide)",
            "packed" if actor.padding_free else "padded",
            family.name,
            family.text_config.hidden_size,
        )
    return actor


def needs_reference(cfg: Config) -> bool:
    """A frozen reference is loaded only when a KL loss or KL reward uses it, or an implicit PRM's rewards
    are measured against it (PRIME)."""
    kl = (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0) or cfg.algorithm.use_kl_in_reward
    return kl or needs_of(get_advantage_estimator(cfg.algorithm.adv_estimator)).prm


def update_plan(cfg: Config) -> UpdatePlan:
    """`actor.ppo_epochs` shuffles cut into mini-batches of `actor.mini_batch_size` prompts' responses."""
    a = cfg.actor
    return UpdatePlan(a.mini_batch_size * responses_per_prompt(cfg), a.ppo_epochs, cfg.rollout.max_new_tokens)


def responses_per_prompt(cfg: Config) -> int:
    """`rollout.n`, or fewer where `algorithm.policy_filtration` keeps only some of each group."""
    name = cfg.algorithm.policy_filtration
    kept = needs_of(get_policy_filter(name)).rows_per_group if name else None
    return min(cfg.rollout.n, kept) if kept else cfg.rollout.n
