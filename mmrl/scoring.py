"""From responses to rewards: what reward functions see, how scores become metrics, and validation-style
generate-then-score shared by the trainer and `mmrl eval`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.batch import Batch
from mmrl.data import PromptSample
from mmrl.rollout import RolloutEngine, SamplingParams
from rewards import RewardInput, RewardManager, RewardResult


def reward_label(name: str) -> str:
    """The metric name a reward function's score is logged under."""
    return name.rpartition(":")[2] if ":" in name else name


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
