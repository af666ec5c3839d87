"""The policy's training side: log-probs of responses, and the clipped policy-gradient update.

A training row is its prompt (left-padded) followed by its response (right-padded), so
every response starts at the same column and its log-probs are one slice of the logits.
Only the hidden states of response positions go through the LM head, which keeps memory
flat for real 150k-token vocabularies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch

from mmrl.algorithms import (
    agg_loss,
    block_tokens,
    entropy_from_logits,
    get_policy_loss,
    get_rollout_correction,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
)
from mmrl.config import ActorConfig, Config
from mmrl.data.batch import Batch, left_pad
from mmrl.data.sample import POSITION_RULE, vision_inputs
from mmrl.errors import ConfigError
from mmrl.models import Family, autocast_for, family_of, never_generated_ids
from mmrl.processors import TRANSFORMERS_RULE
from mmrl.training.micro_batches import Layout, micro_batches, micro_layout, scatter_rows
from mmrl.training.optim import (
    MiniBatch,
    UpdatePlan,
    UpdateStats,
    make_optimizer,
    minibatch_updates,
    per_minibatch,
)
from mmrl.training.packing import pack, unpack

log = logging.getLogger("mmrl.training.actor")

SHARDED_LOGITS = "mmrl_response_logits"  # the method name `response_logits` looks for on a sharded policy


def response_hidden(
    model: Any,
    batch: Batch,
    pad_id: int,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict each response token.

    The shared trunk of the policy's log-probs and the critic's values: position t holds the
    state after the prompt and the first t response tokens. The family adapter runs the model's
    own forward, with each prompt's media encoded once for its n responses (`_media`).

    Positions follow the engine that sampled each row (`POSITION_RULE`): the trainer's log-probs
    must be of the tokens at the positions they were sampled at, or the PPO ratio compares two
    different inputs. transformers and vLLM place the text after a long video differently
    (`mmrl.processors.rope`); rows without a rule were sampled by the HF engine. Run under `autocast_for`.
    `router_losses` collects a mixture-of-experts model's load-balancing loss (`Family.hidden_states`).
    `padding_free` runs the rows packed into one sequence without pad tokens (`mmrl.training.packing`): the same
    states, with no compute spent on padding."""
    device = next(model.parameters()).device
    family = family_of(model)
    rows = batch["prompt_index"].tolist()
    prompts = [batch.prompts[i] for i in rows]
    prompt_ids, prompt_mask = left_pad([p.prompt_ids for p in prompts], pad_id)
    response = batch["response_ids"]
    input_ids = torch.cat([prompt_ids, response], dim=1)
    attention = torch.cat([prompt_mask, batch.attention.long()], dim=1)
    rules = batch.lists.get(POSITION_RULE, TRANSFORMERS_RULE)
    positions = family.position_ids(prompts, input_ids, attention, rules)
    media = {
        kind: encoded
        for kind, encoded in (
            ("image", _media(family, model, batch, rows, False)),
            ("video", _media(family, model, batch, rows, True)),
        )
        if encoded is not None
    }
    if padding_free:
        packed = pack(input_ids, attention, positions, prompt_ids.shape[1])
        hidden = family.hidden_states(
            model, packed.input_ids.to(device), None, packed.positions.to(device), media, router_losses
        )
        return unpack(hidden, packed)
    hidden = family.hidden_states(
        model, input_ids.to(device), attention.to(device), positions.to(device), media, router_losses
    )
    start = prompt_ids.shape[1] - 1  # the position whose output predicts the first response token
    return hidden[:, start : start + response.shape[1]]


def response_logits(
    model: Any,
    batch: Batch,
    pad_id: int,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """LM-head logits (B, T, V) at the response positions.

    A policy sharded with FSDP2 carries this computation as a registered forward method
    (`mmrl.workers.fsdp.shard_policy`), so its shards are gathered around it and its gradients
    reduced after it, as for `forward` itself."""
    sharded = getattr(model, SHARDED_LOGITS, None)
    if sharded is not None:
        return sharded(batch, pad_id, router_losses, padding_free)
    return model.lm_head(response_hidden(model, batch, pad_id, router_losses, padding_free))


def forward_logprobs(
    model: Any,
    batch: Batch,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool | Literal["grad"] = False,
    compute_dtype: torch.dtype = torch.float32,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of `response_ids` under `model`, and optionally per-token entropy.

    Entropy is returned without a graph: it is a metric, and an autograd graph over (B, T, V)
    softmaxes would cost gigabytes at real vocabulary sizes. The entropy bonus asks for
    `with_entropy="grad"`."""
    with autocast_for(model, compute_dtype):
        logits = response_logits(model, batch, pad_id, router_losses, padding_free).float() / temperature
        logits = block_tokens(logits, never_generated_ids(model.config))
    logp = logprobs_from_logits(logits, batch["response_ids"].to(logits.device))
    entropy = None
    if with_entropy == "grad":
        entropy = entropy_from_logits(logits)
    elif with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return logp, entropy


def _media(family: Family, model: Any, batch: Batch, rows: list[int], video: bool) -> Any:
    """The vision tower's output for every row's images (or videos), encoding each distinct prompt's
    media once.

    The n responses of a prompt share its media, so the vision tower runs once per prompt instead
    of once per response; reusing the features also sums their gradients, which is exactly what n
    separate encodings would give.
    """
    pixels = "pixel_values_videos" if video else "pixel_values"
    distinct = sorted({i for i in rows if getattr(batch.prompts[i], pixels) is not None})
    if not distinct:
        return None
    inputs = vision_inputs([batch.prompts[i] for i in distinct])
    grids = inputs["video_grid_thw" if video else "image_grid_thw"]
    encoded = family.encode_media(model, inputs[pixels], grids, video)
    items, cursor = {}, 0
    for i in distinct:
        prompt = batch.prompts[i]
        count = len(prompt.video_grid_thw if video else prompt.image_grid_thw)
        items[i] = range(cursor, cursor + count)
        cursor += count
    return family.select_media(encoded, [item for i in rows if i in items for item in items[i]])


def evaluate_rows(
    model: Any,
    batch: Batch,
    micro_batch_size: int,
    fn: Callable[[Batch], torch.Tensor],
    layout: Layout | None = None,
) -> torch.Tensor:
    """`fn` over micro-batches in eval mode without gradients, gathered on the CPU in row order: how
    the policy, the reference and the critic score a whole rollout batch. Micro-batches are chunks of
    `micro_batch_size` rows, or `layout`'s token-budget groups (`mmrl.training.micro_batches`)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        if layout is None:
            out = torch.cat([fn(micro).cpu() for micro in batch.split(micro_batch_size)])
        else:
            parts = [fn(micro).cpu() for micro in micro_batches(batch, layout)]
            out = scatter_rows(len(batch), batch["response_ids"].shape[1], layout, parts)
    model.train(was_training)
    return out


class Actor:
    """Owns the policy's optimizer and runs the PPO-style update over a batch of rollouts."""

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
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.temperature = temperature
        self.response_len = response_len
        self.compute_dtype = compute_dtype
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(params, cfg, total_updates)
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
                padding_free=self.cfg.padding_free,
            )[0],
            layout if layout is not None else micro_layout(batch, self.cfg.max_tokens_per_micro_batch),
        )

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        """One optimizer step per planned mini-batch (see `plan`)."""
        return minibatch_updates(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            plan,
            micro_batch_size=self.cfg.micro_batch_size,
            max_grad_norm=self.cfg.max_grad_norm,
            micro_step=self._micro_step,
            prefix="actor",
            max_tokens=self.cfg.max_tokens_per_micro_batch,
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
            padding_free=cfg.padding_free,
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
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            agg_kwargs=totals,
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
    if cfg.actor.padding_free and not family.packs_sequences:
        raise ConfigError(
            f"actor.padding_free: {family.name} models have recurrent (Gated DeltaNet) layers that would "
            "carry their state from one packed sequence into the next; set it to false"
        )
    if cfg.actor.padding_free and next(model.parameters()).device.type == "cpu":
        log.warning(
            "actor.padding_free on a CPU: transformers keeps packed sequences apart there with a dense "
            "block-diagonal mask over the whole pack, which costs more than the padding it saves (the "
            "update ran at 0.60x the padded speed at a 108M-parameter shape, docs/benchmarks.md). On GPUs "
            "flash-attention's varlen kernels skip the padding instead; here, padded is faster"
        )
    return Actor(
        model,
        cfg.actor,
        pad_id,
        cfg.rollout.temperature or 1.0,
        cfg.rollout.max_new_tokens,
        total_updates=optimizer_steps(cfg, cfg.actor.ppo_epochs),
        compute_dtype=compute_dtype,
    )


def needs_reference(cfg: Config) -> bool:
    """A frozen KL reference is loaded only when a KL loss or KL reward uses it."""
    return (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0) or cfg.algorithm.use_kl_in_reward


def update_plan(cfg: Config) -> UpdatePlan:
    """`actor.ppo_epochs` shuffles cut into mini-batches of `actor.mini_batch_size` prompts' responses."""
    a = cfg.actor
    return UpdatePlan(a.mini_batch_size * cfg.rollout.n, a.ppo_epochs, cfg.rollout.max_new_tokens)
