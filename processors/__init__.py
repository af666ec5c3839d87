"""Image and video inputs for Qwen-VL-style models: loading, the sizing rules, prompts and mRoPE positions.

Rollout and training both go through `fit_image` and `read_video` (with `video_frame_size`), which
size by the model family's own transformers rule, so the number of image and video placeholder
tokens in a prompt always equals the number of features the vision tower produces.
"""

from mmrl.processors.chat import build_messages, encode_prompt, split_image_markers, split_media_markers
from mmrl.processors.image import (
    ImageError,
    PixelBudget,
    SizeRule,
    fit_image,
    is_huge,
    load_image,
    num_image_tokens,
    smart_size,
)
from mmrl.processors.rope import TRANSFORMERS_RULE, PositionRule, mrope_position_ids
from mmrl.processors.video import (
    FramePlan,
    FrameRule,
    Video,
    VideoBudget,
    VideoError,
    frame_by_frame,
    keep_frames_kwargs,
    num_video_tokens,
    plan_frames,
    read_video,
    timestamped_video_text,
    video_frame_size,
    video_grid_thw,
    video_pad_count,
    video_pixel_inputs,
)
from mmrl.processors.vision import pixel_inputs

__all__ = [
    "TRANSFORMERS_RULE",
    "FramePlan",
    "FrameRule",
    "ImageError",
    "PixelBudget",
    "PositionRule",
    "SizeRule",
    "Video",
    "VideoBudget",
    "VideoError",
    "build_messages",
    "encode_prompt",
    "fit_image",
    "frame_by_frame",
    "is_huge",
    "keep_frames_kwargs",
    "load_image",
    "mrope_position_ids",
    "num_image_tokens",
    "num_video_tokens",
    "pixel_inputs",
    "plan_frames",
    "read_video",
    "smart_size",
    "split_image_markers",
    "split_media_markers",
    "timestamped_video_text",
    "video_frame_size",
    "video_grid_thw",
    "video_pad_count",
    "video_pixel_inputs",
]
