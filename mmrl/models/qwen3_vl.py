"""Qwen3-VL: timestamped video frames, DeepStack vision features, interleaved mRoPE, and its tiny build.

What differs from the `Family` defaults:

- Video frame size: its video processor's own `smart_resize` bounds a whole clip's frames x pixels
  (`whole_clip`), where Qwen2/2.5-VL's sizes each frame by the image rule.
- Video text: each temporal patch of a video is its own `<t seconds><|vision_start|>pads<|vision_end|>`
  (`processors.timestamped_video_text`); time is told by those text tokens, not by the position ids.
- Position ids: transformers' `get_rope_index` splits every video into one t=1 grid per temporal patch,
  so a frame's ids are (0, row, col) offset by the running position and the text after it resumes at
  max(h, w) / merge. vLLM 0.32 (`Qwen3VLForConditionalGeneration._get_mrope_input_positions`) places
  every image and every frame the same way and resumes text at 1 + the largest id so far, which for a
  t=1 grid is the same max(h, w) / merge: the two engines' layouts are identical for Qwen3-VL, and
  generated tokens continue after the prompt's last (text) id in both. Each engine's `PositionRule` is
  still honoured, through `processors.mrope_position_ids`, which gives both the same ids for t=1 grids.
  The interleaving of the three axes over the rotary dimensions (`mrope_interleaved`) happens inside
  the model's rotary embedding; the ids are the usual 3 x B x L.
- DeepStack: the vision tower returns per-layer features that are added to the first decoder layers'
  hidden states. The default `encode_media` / `select_media` / `hidden_states` carry them to the model's
  own forward (`mm_encoder_outputs`); tests/test_family_qwen3_vl.py proves dropping them is caught.
- Saved names: transformers 5.19 saves Qwen3-VL under the names it holds in memory
  (`model.language_model.*`, `model.visual.*`), which is what vLLM's loader maps, so no renaming.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

from mmrl.models.family import Family, register
from mmrl.models.qwen2_5_vl import media_ids, tiny_text
from mmrl.processors import Video, VideoBudget
from mmrl.processors import timestamped_video_text as _timestamped_video_text


def frame_grids(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Each video's (t, h, w) grid as t grids (1, h, w), one per temporal patch, as Qwen3-VL places them."""
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def whole_clip(
    num_frames: int, height: int, width: int, budget: VideoBudget, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video processor sizes a clip, not a frame: its `smart_resize` bounds frames x pixels,
    so the per-frame bounds are scaled by the frame count (and frames under one grid cell grow first)."""
    low, high = budget.min_pixels * num_frames, max_pixels * num_frames
    return smart_resize(num_frames, height, width, budget.temporal_patch_size, budget.factor, low, high)


def tiny_vision() -> dict[str, Any]:
    """The tiny Qwen3-VL vision tower: depth 2, hidden 64, patch 16, DeepStack after both blocks."""
    return {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 128,  # the language model's hidden size
        "num_position_embeddings": 256,  # a 16 x 16 learned grid, interpolated to each image
        "deepstack_visual_indexes": [0, 1],
    }


def tiny_qwen3_text(tokenizer: Any) -> dict[str, Any]:
    """The shared tiny language model with Qwen3's explicit head_dim and interleaved mRoPE."""
    text = tiny_text(tokenizer)
    text["head_dim"] = 32
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    return text


@register
class Qwen3_VL(Family):
    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    model_class = "Qwen3VLForConditionalGeneration"
    tiny_grid_factor = 32
    # save_pretrained writes the in-memory names (checked in tests/test_family_qwen3_vl.py).
    video_time_in_seconds = False  # time is in the timestamp text; every frame's time id is 0
    video_size_rule = staticmethod(whole_clip)
    saved_prefixes: ClassVar[dict[str, str]] = {}

    def video_grids(self, grids: torch.Tensor) -> torch.Tensor:
        return frame_grids(grids)

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        return _timestamped_video_text(video, budget)

    def vllm_prompt_ids(self, prompt_ids: Sequence[int], tokenizer: Any) -> list[int]:
        """Prompt ids as vLLM takes them: one `<|video_pad|>` per video and one `<|image_pad|>` per image
        (vLLM expands each itself). A video's whole timestamped text, `<t seconds><|vision_start|>pads
        <|vision_end|>` per temporal patch, becomes one pad inside the template's own `<|vision_start|>`
        and `<|vision_end|>`, which is what vLLM's Qwen3-VL processor replaces. The default (pad runs cut
        to one) would leave a video's frames and timestamps behind."""
        cfg = self.config
        start, end = cfg.vision_start_token_id, cfg.vision_end_token_id
        pads = (cfg.image_token_id, cfg.video_token_id)
        ids = list(prompt_ids)
        out: list[int] = []
        i = 0
        while i < len(ids):
            token = ids[i]
            if token in pads and out and out[-1] == token:
                i += 1  # an image's pad run: one pad
                continue
            out.append(token)
            i += 1
            if token == start and i < len(ids) and ids[i] not in (start, *pads):
                # A timestamped video: skip to its last frame's <|vision_end|>, before the template's own.
                while i + 1 < len(ids) and not (ids[i] == end and ids[i + 1] == end):
                    i += 1
                out.append(cfg.video_token_id)
                i += 1
        return out

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Any:
        return Qwen3VLConfig(
            text_config=tiny_qwen3_text(tokenizer),
            vision_config=tiny_vision(),
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `Qwen3VLProcessor`: images sized within [min_pixels, max_pixels] on the 32 px grid
        (`processors.fit_image` applies its rule); the video processor's size bounds a whole clip's pixels
        (Qwen3-VL's convention), here up to 32 frames at `max_pixels`."""
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(
                size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                patch_size=16,
                merge_size=2,
                temporal_patch_size=2,
                image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5],
            ),
            video_processor=Qwen3VLVideoProcessor(
                size={"shortest_edge": min_pixels, "longest_edge": 32 * max_pixels},
                patch_size=16,
                merge_size=2,
                temporal_patch_size=2,
            ),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )
