"""From responses to rewards: what reward functions see, how scores become metrics, and validation-style
generate-then-score shared by the trainer and `mmrl eval`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.config import RewardConfig
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.errors import ConfigError, RewardError
from mmrl.rewards import RewardInput, RewardManager, RewardResult
from mmrl.rewards.manager import configure_functions
from mmrl.rollout import RolloutEngine, SamplingParams


def reward_label(name: str) -> str:
    """The metric name a reward function's score is logged under."""
    return name.rpartition(":")[2] if ":" in name else name


def check_rewards(cfg: RewardConfig) -> None:
    """Load and check every reward function as a run would, starting no worker, so a wrong name, a broken
    file or a wrong signature stops `mmrl` before any model loads, as one line."""
    from mmrl.sources import reward_models  # noqa: F401  (registers the reward_model and llm_judge rewards)

    specs = [f.model_dump() for f in cfg.functions]
    try:
        configure_functions(specs, cfg.timeout_s, cfg.isolation)
    except (ValueError, ImportError, AttributeError, FileNotFoundError) as err:
        raise ConfigError(f"reward.functions: {err}") from None


class FailingRewards:
    """Stops a run in which one reward function fails on every sample, step after step: its score is 0
    throughout, so the run would otherwise train on nothing from it to the end, silently.

    `max_steps` in a row (0: never) raise a RewardError naming the function and its first error."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self._streaks: dict[str, tuple[int, str]] = {}  # label -> (first step of the streak, its first error)

    def observe(self, step: int, result: RewardResult) -> None:
        """Count `step` against each function that failed on all of `result`'s samples; a step scored in
        several rounds (dynamic sampling) counts once."""
        failed: dict[str, int] = {}
        for key, count in result.failures.items():
            label = key.rpartition("/")[0]
            failed[label] = failed.get(label, 0) + count
        for label in list(self._streaks):
            if failed.get(label, 0) < len(result.overall):
                del self._streaks[label]
        for label, count in failed.items():
            if not result.overall or count < len(result.overall):
                continue
            first, error = self._streaks.setdefault(label, (step, result.errors.get(label, "")))
            if self.max_steps and step - first + 1 >= self.max_steps:
                raise RewardError(
                    f"reward function {label!r} failed on every sample for {step - first + 1} steps in a "
                    f"row (steps {first}-{step}); its first error: {error}. Fix it, or raise "
                    "reward.max_all_failed_steps to wait longer"
                )


def reward_metrics(result: RewardResult, prefix: str) -> dict[str, Any]:
    """Mean and spread of the combined reward, each component's mean, and failure counts."""
    scores = np.asarray(result.overall, dtype=np.float64)
    metrics: dict[str, Any] = {f"{prefix}/mean": float(scores.mean()), f"{prefix}/std": float(scores.std())}
    metrics.update({f"{prefix}/{k}": float(np.mean(v)) for k, v in result.components.items()})
    metrics.update({f"{prefix}/failures/{k}": v for k, v in result.failures.items()})
    return metrics


def reward_inputs(batch: Batch) -> list[RewardInput]:
    """What each response's reward functions see: the text, the answer, the images and the row."""
    inputs = []
    for index, text in zip(batch["prompt_index"].tolist(), batch["response_text"], strict=True):
        sample: PromptSample = batch.prompts[index]
        inputs.append(
            RewardInput(
                response=text,
                ground_truth=sample.ground_truth,
                images=sample.images,
                image_sizes=sample.image_sizes,
                prompt=sample.prompt_text,
                extra=sample.extra,
                videos=[video.frames for video in sample.videos],
            )
        )
    return inputs


def generate_and_score(
    engine: RolloutEngine,
    rewards: RewardManager,
    samples: list[PromptSample],
    params: SamplingParams,
    batch_size: int,
) -> tuple[list[RewardInput], RewardResult]:
    """Responses to `samples` in chunks of `batch_size` prompts, and their rewards; the RNG the caller
    trains with is left untouched, so evaluating mid-run never changes the run."""
    inputs: list[RewardInput] = []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for start in range(0, len(samples), batch_size):
            inputs += reward_inputs(engine.generate(samples[start : start + batch_size], params))
    return inputs, rewards.score(inputs)
