"""Pixel tensors for images that `fit_image` has already sized."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image


def pixel_inputs(images: list[Image.Image], image_processor: Any) -> dict[str, torch.Tensor]:
    """Normalise and patchify with the checkpoint's own image processor, never resizing again.

    Resizing here would let the processor and the prompt disagree on the token count, the
    classic "image features and image tokens do not match" failure.
    """
    out = image_processor(images=images, do_resize=False, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
