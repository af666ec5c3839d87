"""The data a reward function receives and the scores the reward layer hands back to the trainer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

# A reward function is `fn(sample: RewardInput, **kwargs) -> float | dict[str, float]`. A dict must hold
# "overall" (the score used for training); its other keys are only logged, as metrics. Declared
# `batched: true` in the config, it is `fn(samples: list[RewardInput], **kwargs)` returning one such score
# per sample, in order. Either kind may be `async def`; the reward layer awaits it.
RewardFn = Callable[..., Any]


@dataclass(frozen=True)
class ImageSize:
    """An image's (width, height) as stored and as the model saw it, so rewards on pixel coordinates
    (boxes, points) can map the model's answer back to the original image."""

    original: tuple[int, int]
    model_input: tuple[int, int]


@dataclass
class RewardInput:
    """Everything one sampled response is scored on; `extra` carries the dataset's remaining columns so
    task-specific rewards need no change to this type."""

    response: str
    ground_truth: Any = None
    images: list[Image.Image] = field(default_factory=list)
    image_sizes: list[ImageSize] = field(default_factory=list)
    prompt: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    videos: list[np.ndarray] = field(
        default_factory=list
    )  # the frames the model saw: (T, H, W, 3) uint8 each


@dataclass
class RewardResult:
    """Scores for one batch: `overall` trains the policy, `components` and `failures` are for logging.

    `components` holds each function's unweighted "overall" under its name and any extra keys it returned
    as "name/key"; a failed call, or a key a call did not return, reads 0.0. `failures` counts failed calls
    as "name/exception", "name/timeout" or "name/invalid"; `errors` holds each failing function's first
    failure in this batch as one line, so a caller can say why without the log.
    """

    overall: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    errors: dict[str, str] = field(default_factory=dict)
