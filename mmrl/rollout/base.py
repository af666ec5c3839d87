"""What every rollout engine takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

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

    def submit(self, prompts: list[PromptSample], params: SamplingParams) -> Generation:
        """Start generating; `result()` of the returned generation waits for the batch. An engine that
        generates ahead (a rollout worker of its own) returns at once; the others finish first."""

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        """What the engine knows of a batch it generated (an overlapped run: its staleness)."""

    def sync_weights(self) -> None:
        """Make the engine generate with the trainer's current weights."""

    def sleep(self) -> None:
        """Free generation memory (the KV cache) while training; the next call wakes it."""


class Generation(Protocol):
    """A generation that `RolloutEngine.submit` started."""

    def result(self) -> Batch: ...


@dataclass
class Finished:
    """A generation already done, handed out as one in flight would be."""

    batch: Batch

    def result(self) -> Batch:
        return self.batch


class GeneratesAtOnce:
    """`submit` and `rollout_metrics` for an engine that generates when asked, so that callers treat
    every engine like the rollout worker that generates ahead (`mmrl.workers.remote.RemoteRollout`)."""

    def submit(self, prompts: list[PromptSample], params: SamplingParams) -> Finished:
        return Finished(self.generate(prompts, params))  # type: ignore[attr-defined]

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        return {}
