"""A prompt ready for rollout and training, and the model inputs both read from it.

The engines and the training forward import these from here rather than from each other, so the
sample's layout has one owner below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from mmrl.processors import Video
from mmrl.rewards import ImageSize

POSITION_RULE = "position_rule"  # batch list column: the `processors.PositionRule` each row was sampled under


@dataclass
class PromptSample:
    """One prompt, ready for rollout and training; built once per step and shared by its n responses."""

    row_id: int
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    images: list[Image.Image] = field(default_factory=list)
    image_sizes: list[ImageSize] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None
    # Per image, the rows of `pixel_values` it spans: Qwen's (t, h, w) patch grid, or a tiling family's
    # (tiles,) count (InternVL); the product of a row is the image's count of `pixel_values` rows.
    image_grid_thw: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    videos: list[Video] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # seconds per temporal patch, one per video
    originals: list[Image.Image] = field(default_factory=list)  # full-size images, kept for image tools


def vision_inputs(prompts: list[PromptSample]) -> dict[str, torch.Tensor]:
    """Concatenated pixel patches, grids (and video timing) of the prompts' images and videos, in
    prompt order: the model's multimodal keyword arguments."""
    out: dict[str, torch.Tensor] = {}
    with_images = [p for p in prompts if p.pixel_values is not None]
    if with_images:
        out["pixel_values"] = torch.cat([p.pixel_values for p in with_images])
        out["image_grid_thw"] = torch.cat([p.image_grid_thw for p in with_images])
    with_videos = [p for p in prompts if p.pixel_values_videos is not None]
    if with_videos:
        out["pixel_values_videos"] = torch.cat([p.pixel_values_videos for p in with_videos])
        out["video_grid_thw"] = torch.cat([p.video_grid_thw for p in with_videos])
        out["second_per_grid_ts"] = torch.cat([p.second_per_grid_ts for p in with_videos])
    return out
