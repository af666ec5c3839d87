"""Image inputs for Qwen-VL-style models: loading, the one sizing rule, prompts and mRoPE positions.

Rollout and training both go through `fit_image`, so the number of image placeholder tokens
in a prompt always equals the number of features the vision tower produces.
"""

from processors.chat import build_messages, encode_prompt, split_image_markers
from processors.image import ImageError, PixelBudget, fit_image, load_image, num_image_tokens, smart_size
from processors.rope import mrope_position_ids
from processors.vision import pixel_inputs

__all__ = [
    "ImageError",
    "PixelBudget",
    "build_messages",
    "encode_prompt",
    "fit_image",
    "load_image",
    "mrope_position_ids",
    "num_image_tokens",
    "pixel_inputs",
    "smart_size",
    "split_image_markers",
]
