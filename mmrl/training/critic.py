"""The critic for PPO with GAE: the policy's architecture with a scalar value head instead of the LM head.

V(s_t) is read at the same positions as the policy's log-probs (the state after the prompt and t
response tokens), so values, rewards and advantages line up token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from mmrl.algorithms import clipped_value_loss, get_advantage_estimator, needs_of
from mmrl.config import Config, CriticConfig
from mmrl.data.batch import Batch
from mmrl.models import autocast_for, family_of, load_policy
from mmrl.training.actor import optimizer_steps
from mmrl.training.forward import evaluate_rows, response_hidden
from mmrl.training.micro_batches import Layout, micro_layout
from mmrl.training.optim import MiniBatch, TrainedModel, UpdatePlan, per_minibatch, plan_minibatches


def needs_critic(cfg: Config) -> bool:
    """Whether the advantage estimator learns a value function (its registry entry says so: GAE)."""
    return needs_of(get_advantage_estimator(cfg.algorithm.adv_estimator)).critic


def critic_plan(cfg: Config, batch: Batch, actor: UpdatePlan) -> list[MiniBatch]:
    """The critic's mini-batches: the actor's (`actor`, the source's plan: prompts' responses, or an
    episode step's decisions), `critic.ppo_epochs` (default the actor's) shuffles."""
    epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
    return plan_minibatches(batch, actor.rows, epochs, actor.horizon)


class ValueModel(nn.Module):
    """The policy's trunk (vision tower and language model) with a linear value head.

    The head starts at zero, so V ≡ 0 at first and the early advantages are plain returns: a
    random head would add noise the policy follows before the critic has learned anything."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.model = policy.model
        self.config = policy.config
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(policy.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: Batch, pad_id: int, padding_free: bool = False) -> torch.Tensor:
        """V (B, T) of every response position; a `forward`, so FSDP gathers the head with the root.

        Copied out of the head's output, a view: FSDP hooks its backward onto what `forward` returns,
        and an in-place op on a view would lose that hook."""
        values = self.value_head(response_hidden(self, batch, pad_id, padding_free=padding_free))
        return values.squeeze(-1).clone()

    @classmethod
    def from_policy_weights(cls, path: str | Path, device: str) -> ValueModel:
        """A critic whose trunk starts from a policy checkpoint (the LM head is dropped)."""
        return cls(load_policy(path, torch.float32, device))


def forward_values(
    model: ValueModel,
    batch: Batch,
    pad_id: int,
    compute_dtype: torch.dtype,
    padding_free: bool = False,
) -> torch.Tensor:
    """V (B, T) of every response position, float32."""
    with autocast_for(model, compute_dtype):
        return model(batch, pad_id, padding_free).float()


class Critic(TrainedModel):
    """Owns the value model and its optimizer; `values` before the advantages, `update` after: it
    regresses V on `returns`, clipped around the rollout's `values`."""

    prefix = "critic"

    def __init__(
        self,
        model: ValueModel,
        cfg: CriticConfig,
        pad_id: int,
        response_len: int,
        total_updates: int,
        micro_batch_size: int,
        compute_dtype: torch.dtype = torch.float32,
        max_tokens: int | None = None,
        padding_free: bool | Literal["auto"] = False,
    ) -> None:
        super().__init__(
            model, cfg, total_updates, micro_batch_size, max_tokens, pad_id, compute_dtype, padding_free
        )
        self.cfg: CriticConfig = cfg
        self.response_len = response_len

    def values(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        """V of every response token under the current critic, 0 on padding; micro-batched by `layout`
        where the worker group chose it, else by the config."""
        values = evaluate_rows(
            self.model,
            batch,
            self.micro_batch_size,
            lambda micro: forward_values(
                self.model, micro, self.pad_id, self.compute_dtype, self.padding_free
            ),
            layout if layout is not None else micro_layout(batch, self.max_tokens),
        )
        return values * batch["response_mask"]

    def _micro_step(self, micro: Batch, totals: dict[str, float]) -> dict[str, float]:
        values = forward_values(self.model, micro, self.pad_id, self.compute_dtype, self.padding_free)
        device = values.device
        loss, metrics = clipped_value_loss(
            values,
            micro["values"].to(device),
            micro["returns"].to(device),
            micro["response_mask"].to(device),
            cliprange_value=self.cfg.cliprange_value,
            loss_agg_mode=self.cfg.loss_agg_mode,
            agg_kwargs=totals,
        )
        loss.backward()
        stats = {"critic/vf_loss": float(loss.detach())}
        stats.update({f"critic/{k}": float(v) for k, v in metrics.items()})
        return per_minibatch(stats, len(micro), totals)


def value_model(cfg: Config, start: str | Path, device: str) -> ValueModel:
    """The critic's model, its trunk from the policy weights at `start`, frozen where the policy's is."""
    model = ValueModel.from_policy_weights(start, device)
    if cfg.model.freeze_vision_tower:
        family_of(model).freeze_vision(model)
    return model


def build_critic(cfg: Config, model: ValueModel, pad_id: int, compute_dtype: torch.dtype) -> Critic:
    """The critic over `model` (whole, or this rank's FSDP shard), set up as `cfg` says."""
    return Critic(
        model,
        cfg.critic,
        pad_id,
        cfg.rollout.max_new_tokens,
        total_updates=optimizer_steps(cfg, cfg.critic.ppo_epochs or cfg.actor.ppo_epochs),
        micro_batch_size=cfg.actor.micro_batch_size,
        compute_dtype=compute_dtype,
        max_tokens=cfg.actor.max_tokens_per_micro_batch,
        padding_free=cfg.actor.padding_free,
    )


def update_critic(critic: Any, plan: list[MiniBatch], batch: Batch) -> dict[str, Any]:
    """One critic update (in-process `Critic` or the workers' `CriticRole`) on `plan`; its metrics."""
    stats = critic.update(batch, plan)
    mask = batch["response_mask"].bool()
    metrics = dict(stats.metrics)
    metrics["critic/returns_mean"] = float(batch["returns"][mask].mean()) if mask.any() else 0.0
    metrics["critic/values_mean"] = float(batch["values"][mask].mean()) if mask.any() else 0.0
    metrics["critic/skipped_updates"] = stats.skipped_steps
    return metrics
