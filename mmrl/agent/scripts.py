"""Scripted trajectories: the assistant turns a warm-up answers each prompt with, and the engine that
plays them through the agent loop in place of the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrl.data.batch import Batch, right_pad
from mmrl.data.sample import PromptSample
from mmrl.rollout.base import GeneratesAtOnce, SamplingParams

SCRIPT = "warmup_script"  # a warm-up prompt's `extra` key: the assistant turns it is answered with


@dataclass
class Script:
    """One trajectory's assistant turns, and how many were given: every turn of a trajectory is generated
    from a copy of its prompt sample, and all copies share this object."""

    turns: list[str]
    given: int = 0

    def next(self) -> str:
        self.given += 1
        return self.turns[min(self.given, len(self.turns)) - 1]


class ScriptedEngine(GeneratesAtOnce):
    """A rollout engine that answers each prompt with the next turn of its script (`extra[SCRIPT]`)."""

    logprobs_are_free = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        rows = [p.extra[SCRIPT].next() for p in prompts]
        ids = [
            self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            for t in rows
        ]
        response, mask = right_pad(ids, self.tokenizer.pad_token_id)
        batch = Batch(
            tensors={
                "prompt_index": torch.arange(len(prompts)),
                "response_ids": response,
                "response_mask": mask,
                "truncated": torch.zeros(len(prompts), dtype=torch.bool),
                "rollout_logprobs": torch.zeros(mask.shape),
            },
            prompts=prompts,
        )
        batch.set(response_text=rows)
        return batch

    def sync_weights(self) -> None:
        """A script has no weights."""

    def sleep(self) -> None:
        """Nothing to free."""
