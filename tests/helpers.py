"""Inputs shared by the engine tests: prompts that mix image sizes and text-only rows."""

from __future__ import annotations

from PIL import Image

from mmrl.data import PromptSample
from processors import PixelBudget, build_messages, encode_prompt, fit_image, num_image_tokens, pixel_inputs

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=112 * 112)


def mixed_prompts(processor, with_text_only: bool = True) -> list[PromptSample]:
    """Three images of different shapes (so different token counts) and, optionally, a text-only prompt
    second, as the trainer prepares them."""
    tok = processor.tokenizer
    samples = []
    for i, (size, colour) in enumerate(
        [((112, 112), (220, 20, 20)), ((56, 140), (20, 20, 220)), ((84, 84), (0, 160, 0))]
    ):
        image = fit_image(Image.new("RGB", size, colour), BUDGET)
        count = num_image_tokens(image.height, image.width, BUDGET)
        ids = encode_prompt(tok, build_messages("<image>What colour is the shape?", 1), [count])
        inputs = pixel_inputs([image], processor.image_processor)
        samples.append(
            PromptSample(i, ids, "q", "red", [image], [], inputs["pixel_values"], inputs["image_grid_thw"])
        )
    if with_text_only:
        ids = encode_prompt(tok, build_messages("How many circles?", 0), [])
        samples.insert(1, PromptSample(9, ids, "q", "one"))
    return samples
