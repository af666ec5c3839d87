"""Qwen2-VL: Qwen2.5-VL's layout without real-time video positions, and its tiny build.

Qwen2-VL's mRoPE has no `second_per_grid_ts` scaling: a video's time ids are its temporal patch
indices 0..t-1 whatever the clip's frame rate, in transformers (`get_rope_index`) and in vLLM 0.32
(its Qwen2-VL processor emits no seconds field, so its time factor is 1). The text after an image
or video still resumes where each engine's rule says (`processors.rope`): transformers at
max(h, w) / merge after the block's start, vLLM at 1 + the block's largest id (time axis included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from transformers import Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

from mmrl.models.family import Family, register
from mmrl.models.qwen2_5_vl import media_ids, tiny_text
from processors import TRANSFORMERS_RULE, PositionRule, mrope_position_ids


@register
class Qwen2_VL(Family):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    model_class = "Qwen2VLForConditionalGeneration"
    tiny_grid_factor = 28
    saved_prefixes: ClassVar[dict[str, str]] = {"model.language_model.": "model.", "model.visual.": "visual."}

    def position_ids(
        self,
        prompts: Sequence[Any],
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        rules: PositionRule | Sequence[PositionRule] = TRANSFORMERS_RULE,
    ) -> torch.Tensor:
        """mRoPE ids with a video's time axis at its patch index (one id per temporal patch): the
        prompts' `second_per_grid_ts` are ignored, as both engines ignore them for Qwen2-VL."""
        images = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
        videos = [p.video_grid_thw for p in prompts if p.video_grid_thw is not None]
        cfg = self.config
        return mrope_position_ids(
            input_ids,
            attention,
            torch.cat(images) if images else None,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            spatial_merge_size=cfg.vision_config.spatial_merge_size,
            video_grid_thw=torch.cat(videos) if videos else None,
            second_per_grid_ts=None,  # one second per temporal patch ...
            tokens_per_second=1.0,  # ... at one id per second: ids 0..t-1
            rules=rules,
        )

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Qwen2-VL's `generate` refuses `second_per_grid_ts` (its forward takes no such argument)."""
        vision = {k: v for k, v in vision.items() if k != "second_per_grid_ts"}
        return super().generate_inputs(input_ids, vision)

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Qwen2VLConfig:
        return Qwen2VLConfig(
            text_config=tiny_text(tokenizer),
            vision_config={
                "depth": 2,
                "embed_dim": 64,
                "hidden_size": 128,  # the merger's output: the language model's hidden size
                "mlp_ratio": 2,
                "num_heads": 4,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        return Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(size=size),
            video_processor=Qwen2VLVideoProcessor(size=size),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )
