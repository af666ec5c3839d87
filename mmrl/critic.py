"""The critic for PPO with GAE: the policy's architecture with a scalar value head instead of the LM head.

V(s_t) is read at the same positions as the policy's log-probs (the state after the prompt and t
response tokens), so values, rewards and advantages line up token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmrl.actor import evaluate_rows, response_hidden
from mmrl.algorithms import clipped_value_loss
from mmrl.batch import Batch
from mmrl.config import CriticConfig
from mmrl.micro_batches import micro_layout
from mmrl.models import autocast_for, load_policy
from mmrl.optim import (
    UpdateStats,
    apply_settings,
    make_optimizer,
    minibatch_updates,
    per_minibatch,
    plan_minibatches,
)


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
        hidden = response_hidden(model, batch, pad_id, padding_free=padding_free)
        return model.value_head(hidden).squeeze(-1).float()


class Critic:
    """Owns the value model and its optimizer; `values` before the advantages, `update` after."""

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
        padding_free: bool = False,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.response_len = response_len
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # actor.max_tokens_per_micro_batch: micro-batches as the actor's
        self.compute_dtype = compute_dtype
        self.padding_free = padding_free  # actor.padding_free: the critic's forward runs as the actor's
        self.optimizer, self.scheduler = make_optimizer(
            [p for p in model.parameters() if p.requires_grad], cfg, total_updates
        )

    def values(self, batch: Batch) -> torch.Tensor:
        """V of every response token under the current critic, 0 on padding."""
        values = evaluate_rows(
            self.model,
            batch,
            self.micro_batch_size,
            lambda micro: forward_values(
                self.model, micro, self.pad_id, self.compute_dtype, self.padding_free
            ),
            micro_layout(batch, self.max_tokens),
        )
        return values * batch["response_mask"]

    def update(self, batch: Batch, rows_per_step: int, epochs: int) -> UpdateStats:
        """Regress V on `returns`, clipped around the rollout's `values`."""
        return minibatch_updates(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            plan_minibatches(batch, rows_per_step, epochs, self.response_len),
            micro_batch_size=self.micro_batch_size,
            max_grad_norm=self.cfg.max_grad_norm,
            micro_step=self._micro_step,
            prefix="critic",
            max_tokens=self.max_tokens,
        )

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer together: a resumed critic must continue, not restart."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_settings(self.optimizer, self.scheduler, self.cfg)

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
