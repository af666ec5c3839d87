"""Frames and instructions as prompts: the only place a simulator observation meets the tokenizer.

Every decision is its own prompt (a new frame), so prompts are built in bulk: one image-processor
call for all envs stepped together, and one tokenisation per distinct instruction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from envs.base import Obs
from mmrl.data import PromptSample
from processors import (
    PixelBudget,
    build_messages,
    encode_prompt,
    fit_image,
    num_image_tokens,
    pixel_inputs,
)
from rewards import ImageSize


class ObservationPrompts:
    """Builds `PromptSample`s from observations with the policy's processor and the run's pixel budget.

    `template` holds `{instruction}` and one `<image>` marker where the frame goes."""

    def __init__(self, processor: Any, budget: PixelBudget, template: str = "<image>{instruction}") -> None:
        if template.count("<image>") != 1 or "{instruction}" not in template:
            raise ValueError(
                f"env.prompt must contain one <image> marker and {{instruction}}, got {template!r}"
            )
        self.processor, self.budget, self.template = processor, budget, template
        self._ids: dict[tuple[str, int], list[int]] = {}

    def __call__(self, observations: list[Obs], row_ids: list[int] | None = None) -> list[PromptSample]:
        if not observations:
            return []
        images = [fit_image(Image.fromarray(np.asarray(obs["image"])), self.budget) for obs in observations]
        inputs = pixel_inputs(images, self.processor.image_processor)
        grids = inputs["image_grid_thw"]
        ends = grids.prod(dim=1).cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        samples = []
        for i, (obs, image) in enumerate(zip(observations, images, strict=True)):
            size = ImageSize(original=(obs["image"].shape[1], obs["image"].shape[0]), model_input=image.size)
            samples.append(
                PromptSample(
                    row_id=i if row_ids is None else row_ids[i],
                    prompt_ids=self._prompt_ids(obs["instruction"], image),
                    prompt_text=self.template.format(instruction=obs["instruction"]),
                    ground_truth=obs["instruction"],
                    images=[image],
                    image_sizes=[size],
                    pixel_values=inputs["pixel_values"][starts[i] : ends[i]],
                    image_grid_thw=grids[i : i + 1],
                )
            )
        return samples

    def _prompt_ids(self, instruction: str, image: Image.Image) -> list[int]:
        tokens = num_image_tokens(image.height, image.width, self.budget)
        key = (instruction, tokens)
        if key not in self._ids:
            text = self.template.format(instruction=instruction)
            self._ids[key] = encode_prompt(self.processor.tokenizer, build_messages(text, 1), [tokens])
        return self._ids[key]
