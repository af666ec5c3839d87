"""Frames and instructions as prompts: the only place a simulator observation meets the tokenizer.

Every decision is its own prompt (new frames), so prompts are built in bulk: one image-processor
call for all envs stepped together, and one tokenisation per distinct prompt text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from mmrl.data.sample import PromptSample
from mmrl.envs.base import Obs
from mmrl.processors import (
    PixelBudget,
    build_messages,
    encode_prompt,
    fit_image,
    num_image_tokens,
    pixel_inputs,
)
from mmrl.rewards import ImageSize


def frame_history(frames: Sequence[np.ndarray], t: int, k: int) -> list[np.ndarray]:
    """Frames t-k+1 .. t of an episode, oldest first; before its first frame, the first frame again."""
    return [frames[max(0, i)] for i in range(t - k + 1, t + 1)]


class ObservationPrompts:
    """Builds `PromptSample`s from observations with the policy's processor and the run's pixel budget.

    `template` holds `{instruction}`, one `<image>` marker where the frames go (the last `history`
    frames, oldest first), and optionally `{state}`: the proprioceptive state, two decimals a number."""

    def __init__(
        self, processor: Any, budget: PixelBudget, template: str = "<image>{instruction}", history: int = 1
    ) -> None:
        if template.count("<image>") != 1 or "{instruction}" not in template:
            raise ValueError(
                f"env.prompt must contain one <image> marker and {{instruction}}, got {template!r}"
            )
        if history < 1:
            raise ValueError(f"env.history must be at least 1 frame, got {history}")
        self.processor, self.budget, self.template, self.history = processor, budget, template, history
        self._ids: dict[tuple[str, int], list[int]] = {}

    def __call__(
        self,
        observations: list[Obs],
        row_ids: list[int] | None = None,
        frames: list[list[np.ndarray]] | None = None,
    ) -> list[PromptSample]:
        """One prompt per observation; `frames[i]` is row i's last `history` frames (default: its image)."""
        if not observations:
            return []
        frames = frames or [[obs["image"]] for obs in observations]
        if any(len(row) != self.history for row in frames):
            raise ValueError(f"each observation needs its last {self.history} frames")
        k = self.history
        images = [fit_image(Image.fromarray(np.asarray(f)), self.budget) for row in frames for f in row]
        inputs = pixel_inputs(images, self.processor.image_processor)
        grids = inputs["image_grid_thw"]
        ends = grids.prod(dim=1).cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        samples = []
        for i, obs in enumerate(observations):
            own = images[i * k : (i + 1) * k]
            text = self.text(obs)
            samples.append(
                PromptSample(
                    row_id=i if row_ids is None else row_ids[i],
                    prompt_ids=self._prompt_ids(text, own[0]),
                    prompt_text=text,
                    ground_truth=obs["instruction"],
                    images=own,
                    image_sizes=[
                        ImageSize(original=(f.shape[1], f.shape[0]), model_input=image.size)
                        for f, image in zip(frames[i], own, strict=True)
                    ],
                    pixel_values=inputs["pixel_values"][starts[i * k] : ends[(i + 1) * k - 1]],
                    image_grid_thw=grids[i * k : (i + 1) * k],
                )
            )
        return samples

    def text(self, obs: Obs) -> str:
        """The prompt's text: the template filled in, its one `<image>` standing for `history` frames."""
        state = " ".join(f"{x:.2f}" for x in np.asarray(obs.get("state", ()), dtype=float).ravel())
        filled = self.template.format(instruction=obs["instruction"], state=state)
        return filled.replace("<image>", "<image>" * self.history)

    def _prompt_ids(self, text: str, image: Image.Image) -> list[int]:
        tokens = num_image_tokens(image.height, image.width, self.budget)
        key = (text, tokens)
        if key not in self._ids:
            if len(self._ids) > 4096:  # a {state} prompt is new text at every step
                self._ids.clear()
            self._ids[key] = encode_prompt(
                self.processor.tokenizer, build_messages(text, self.history), [tokens] * self.history
            )
        return self._ids[key]
