"""The rollout engine of a policy with a continuous action head: one forward per batch of decisions.

Nothing is decoded token by token. Each prompt is followed by the head's action queries, the backbone
runs once over prompt and queries, and the head draws every chunk step's action from what it read: a
Gaussian's mean or sample, or a flow expert's denoising chain, noise-free when greedy, from the global
torch RNG otherwise (the callers seed it, as for the HF engine). The batch it returns is a token
engine's, the queries standing as the response, plus the draw (`actions`, N x chunk x action_dim,
normalised and unclipped; a flow expert's `chain`), which the trainer scores (`chunk_logprobs`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.models import ActionHead, autocast_for, tokenizer_of
from mmrl.rollout.base import GeneratesAtOnce, SamplingParams
from mmrl.training.forward import query_batch, response_hidden


class ActionHeadEngine(GeneratesAtOnce):
    """Samples action chunks from `model`'s head with the trainer's own weights (nothing to sync)."""

    logprobs_are_free = True  # the log-density comes with the draw

    def __init__(self, model: Any, head: ActionHead, processor: Any, compute_dtype: torch.dtype) -> None:
        self.model, self.head, self.compute_dtype = model, head, compute_dtype
        self.pad_id = tokenizer_of(processor).pad_token_id

    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        batch = query_batch(prompts, torch.arange(len(prompts)).repeat_interleave(params.n), self.head)
        batch.set(truncated=torch.zeros(len(batch), dtype=torch.bool))
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            with autocast_for(self.model, self.compute_dtype):
                hidden = response_hidden(self.model, batch, self.pad_id)
            draw, logp = self.head.sample(hidden, params.temperature, params.greedy)
        self.model.train(was_training)
        batch.set(**{key: value.cpu() for key, value in draw.items()}, rollout_logprobs=logp.cpu())
        batch.set(response_text=[_text(chunk) for chunk in draw["actions"].cpu()])
        return batch

    def sync_weights(self) -> None:
        """The engine samples with the trainer's parameters themselves."""

    def sleep(self) -> None:
        """No cache to free: each call is one forward."""


def _text(chunk: torch.Tensor) -> str:
    """A chunk as a gallery or log line shows it: one step a line, two decimals a dimension."""
    return "\n".join(" ".join(f"{x:+.2f}" for x in step.tolist()) for step in chunk)
