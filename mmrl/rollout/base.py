"""What every rollout engine takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one `generate` call; temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: bool = False  # also return each sampled token's log-prob (costs memory on the HF engine)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RolloutEngine(Protocol):
    """Generates n responses per prompt.

    The returned batch has `len(prompts) * n` rows, the n responses of a prompt adjacent, and:
    tensors `prompt_index` (N,), `response_ids` (N, T) right-padded, `response_mask` (N, T),
    `truncated` (N,) bool (no stop token within max_new_tokens); list `response_text`; and,
    when `params.logprobs`, `rollout_logprobs` (N, T) of the sampled tokens under
    softmax(logits / temperature). An engine whose mRoPE layout is not transformers' also sets
    the list `position_rule` (`POSITION_RULE`), so training uses the positions it sampled at.
    """

    # True when sampled-token log-probs come at no extra cost (vLLM computes them while sampling), so the
    # trainer asks for them on every rollout to measure the engine/trainer mismatch.
    logprobs_are_free: bool

    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch: ...

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        """What the engine knows of a batch it generated (an overlapped run: its staleness)."""

    def sync_weights(self) -> None:
        """Make the engine generate with the trainer's current weights."""

    def sleep(self) -> None:
        """Free generation memory (the KV cache) while training; the next call wakes it."""


class GeneratesAtOnce:
    """`rollout_metrics` for an engine that generates when asked, so that callers treat every engine
    like the rollout workers that generate ahead (`mmrl.workers.remote.RemoteRollout`)."""

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        return {}


def draw_seed() -> int:
    """A prompt group's sampling seed, from the trainer's RNG (which checkpoints restore)."""
    return int(torch.randint(2**31 - 1, ()))


def generate_seeded(
    engine: RolloutEngine, prompts: list[PromptSample], params: SamplingParams, seed: int
) -> Batch:
    """`engine.generate` with torch's RNG seeded by `seed` and restored after: the samples depend on the
    seed, the prompts and the weights alone, not on what else the process or the engine's batch holds.
    A rollout worker samples each prompt group this way, and so does a synchronous run with
    `rollout.group_seeds`, so the two draw the same tokens."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return engine.generate(prompts, params)
