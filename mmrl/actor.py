"""The policy's training side: log-probs of responses, and the clipped policy-gradient update.

A training row is its prompt (left-padded) followed by its response (right-padded), so
every response starts at the same column and its log-probs are one slice of the logits.
Only the hidden states of response positions go through the LM head, which keeps memory
flat for real 150k-token vocabularies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from mmrl.algorithms import (
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    logprobs_from_logits,
)
from mmrl.batch import Batch
from mmrl.config import ActorConfig
from mmrl.models import autocast_for
from mmrl.rollout.hf import left_pad, vision_inputs
from processors import mrope_position_ids


def forward_logprobs(
    model: Any,
    batch: Batch,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool | Literal["grad"] = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of `response_ids` under `model`, and optionally per-token entropy.

    Entropy is returned without a graph: it is a metric, and an autograd graph over (B, T, V)
    softmaxes would cost gigabytes at real vocabulary sizes. The entropy bonus asks for
    `with_entropy="grad"`."""
    device = next(model.parameters()).device
    rows = batch["prompt_index"].tolist()
    prompts = [batch.prompts[i] for i in rows]
    prompt_ids, prompt_mask = left_pad([p.prompt_ids for p in prompts], pad_id)
    response = batch["response_ids"]
    input_ids = torch.cat([prompt_ids, response], dim=1)
    attention = torch.cat([prompt_mask, batch["response_mask"].long()], dim=1)
    cfg = model.config
    grids = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
    positions = mrope_position_ids(
        input_ids,
        attention,
        torch.cat(grids) if grids else None,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        spatial_merge_size=cfg.vision_config.spatial_merge_size,
    )
    input_ids = input_ids.to(device)
    with autocast_for(model, compute_dtype):
        embeds = model.model.get_input_embeddings()(input_ids)
        image_embeds = _image_embeds(model, batch, rows, device)
        if image_embeds is not None:
            slots = (input_ids == cfg.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(slots, image_embeds.to(embeds.dtype))
        hidden = model.model(
            inputs_embeds=embeds,
            attention_mask=attention.to(device),
            position_ids=positions.to(device),
            use_cache=False,
        ).last_hidden_state
        start = prompt_ids.shape[1] - 1  # the position whose output predicts the first response token
        logits = model.lm_head(hidden[:, start : start + response.shape[1]]).float() / temperature
    logp = logprobs_from_logits(logits, response.to(device))
    entropy = None
    if with_entropy == "grad":
        entropy = entropy_from_logits(logits)
    elif with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return logp, entropy


def _image_embeds(model: Any, batch: Batch, rows: list[int], device: torch.device) -> torch.Tensor | None:
    """Vision features for every row, encoding each distinct prompt's images once.

    The n responses of a prompt share its images, so the vision tower runs once per prompt
    instead of once per response; reusing the features also sums their gradients, which is
    exactly what n separate encodings would give.
    """
    distinct = sorted({i for i in rows if batch.prompts[i].pixel_values is not None})
    if not distinct:
        return None
    vision = vision_inputs([batch.prompts[i] for i in distinct])
    features = model.model.get_image_features(
        vision["pixel_values"].to(device), vision["image_grid_thw"].to(device)
    ).pooler_output
    per_prompt, cursor = {}, 0
    for i in distinct:
        count = len(batch.prompts[i].image_grid_thw)
        per_prompt[i] = torch.cat(features[cursor : cursor + count])
        cursor += count
    return torch.cat([per_prompt[i] for i in rows if i in per_prompt])


def lr_factor(update: int, cfg: ActorConfig, total: int) -> float:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio` over `total` optimizer steps.

    Decay matters most for small models trained at large rates: without it the policy keeps
    moving after it has learned, and its entropy collapses."""
    if update < cfg.warmup_steps:
        return (update + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (update - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class UpdateStats:
    """What one `update` call did, for the step's metrics."""

    metrics: dict[str, float]
    skipped_steps: int


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
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, cfg=cfg, total=total_updates)
        )
        self.policy_loss = get_policy_loss(cfg.policy_loss)

    def needs_old_logprobs(self, num_rows: int, group_size: int) -> bool:
        """Old log-probs equal the current ones (detached) when the batch is used for exactly one
        optimizer step, so the extra forward pass is skipped then."""
        mini_rows = self.cfg.mini_batch_size * group_size
        return self.cfg.ppo_epochs > 1 or num_rows > mini_rows

    @torch.no_grad()
    def logprobs(self, model: Any, batch: Batch) -> torch.Tensor:
        """Log-probs of every row under `model` (the policy or the frozen reference), micro-batched."""
        was_training = model.training
        model.eval()
        parts = [
            forward_logprobs(model, mb, self.pad_id, self.temperature, compute_dtype=self.compute_dtype)[
                0
            ].cpu()
            for mb in batch.split(self.cfg.micro_batch_size)
        ]
        model.train(was_training)
        return torch.cat(parts)

    def update(self, batch: Batch, group_size: int) -> UpdateStats:
        """`ppo_epochs` passes over shuffled mini-batches; gradients accumulate over micro-batches
        with losses normalised by mini-batch totals, so micro-batching never changes the result."""
        cfg = self.cfg
        self.model.train()
        sums: dict[str, float] = {}
        count, skipped = 0, 0
        mini_rows = cfg.mini_batch_size * group_size
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch))
            for start in range(0, len(batch), mini_rows):
                mini = batch.select(order[start : start + mini_rows])
                totals = {  # at least 1 token: mask_truncated may leave a mini-batch with none
                    "num_tokens": max(1.0, float(mini["response_mask"].sum())),
                    "num_seqs": float(len(mini)),
                    "horizon": self.response_len,
                }
                self.optimizer.zero_grad(set_to_none=True)
                for micro in mini.split(cfg.micro_batch_size):
                    stats = self._micro_step(micro, totals)
                    for key, value in stats.items():
                        sums[key] = sums.get(key, 0.0) + value * len(micro) / len(mini)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a non-finite gradient never reaches the weights or the optimizer moments
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                sums["actor/lr"] = sums.get("actor/lr", 0.0) + self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + grad_norm
                count += 1
        metrics = {k: v / count for k, v in sums.items()}
        return UpdateStats(metrics=metrics, skipped_steps=skipped)

    def _micro_step(self, micro: Batch, totals: dict[str, float]) -> dict[str, float]:
        cfg = self.cfg
        logp, entropy = forward_logprobs(
            self.model,
            micro,
            self.pad_id,
            self.temperature,
            with_entropy="grad" if cfg.entropy_coef else True,
            compute_dtype=self.compute_dtype,
        )
        device = logp.device
        mask = micro["response_mask"].to(device).float()
        old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else logp.detach()
        agg = {
            "num_tokens": totals["num_tokens"],
            "num_seqs": totals["num_seqs"],
            "horizon": totals["horizon"],
        }
        pg_loss, pg_metrics = self.policy_loss(
            logp,
            old,
            micro["advantages"].to(device),
            mask,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            agg_kwargs=agg,
        )
        loss = pg_loss
        entropy_value = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_value
        stats = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_value.detach())}
        if cfg.use_kl_loss and "ref_logprobs" in micro:  # the reference may be loaded for the KL reward only
            kl = agg_loss(
                kl_penalty(logp, micro["ref_logprobs"].to(device), cfg.kl_loss_type),
                mask,
                cfg.loss_agg_mode,
                **agg,
            )
            loss = loss + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"] = float(kl.detach())
        loss.backward()
        stats.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
        # Losses are already divided by mini-batch totals: scale them back to per-mini-batch values.
        share = len(micro) / totals["num_seqs"]
        return {k: (v / share if k.endswith(("loss", "entropy")) else v) for k, v in stats.items()}
