"""One supervised step on given responses: the format warm-up and behaviour cloning (`mmrl sft`) both
teach by example through the same forward the RL update uses, so what they teach is what RL sees. A
policy with a continuous action head is taught its demos' action chunks by its own loss instead."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.data.batch import Batch, right_pad
from mmrl.data.sample import PromptSample
from mmrl.models import action_head_of
from mmrl.training.forward import forward_logprobs, query_batch, response_hidden


def supervised_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    prompts: list[PromptSample],
    rows: list[int],
    responses: list[list[int]],
    pad_id: int,
    max_grad_norm: float | None = None,
) -> float:
    """Mean token negative log-likelihood of `responses[i]` after prompt `prompts[rows[i]]`; one step,
    its gradient clipped to `max_grad_norm` when given."""
    response, mask = right_pad(responses, pad_id)
    batch = Batch(
        tensors={"prompt_index": torch.as_tensor(rows), "response_ids": response, "response_mask": mask},
        prompts=prompts,
    )
    return supervised_batch_step(model, optimizer, batch, pad_id, max_grad_norm)


def supervised_batch_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    pad_id: int,
    max_grad_norm: float | None = None,
) -> float:
    """`supervised_step` on a built batch: only `response_mask` tokens are taught, so a multi-turn row's
    tool responses are context, not targets (`mmrl.agent`)."""
    mask = batch["response_mask"]
    model.train()
    logp, _ = forward_logprobs(model, batch, pad_id)
    loss = -(logp * mask.to(logp.device)).sum() / mask.sum().clamp(min=1)
    return _descend(model, optimizer, loss, max_grad_norm)


def regression_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    prompts: list[PromptSample],
    rows: list[int],
    targets: torch.Tensor,
    pad_id: int,
    max_grad_norm: float | None = None,
) -> float:
    """A continuous head's cloning loss (`ActionHead.imitation_loss`: L1 for a Gaussian head, flow
    matching for a flow expert) against `targets[i]` (chunk, action_dim), normalised actions, after
    prompt `prompts[rows[i]]`. One step, as `supervised_step`."""
    head = action_head_of(model)
    if head is None:
        raise ValueError("regression_step needs a model with a continuous action head (attach_action_head)")
    model.train()
    hidden = response_hidden(model, query_batch(prompts, rows, head), pad_id)
    return _descend(model, optimizer, head.imitation_loss(hidden, targets), max_grad_norm)


def _descend(
    model: Any, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float | None
) -> float:
    """One optimizer step down `loss`, its gradient clipped to `max_grad_norm` when given; the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())
