"""Qwen2-VL: Qwen2.5-VL's layout without real-time video positions, and its tiny build.

Qwen2-VL's mRoPE has no `second_per_grid_ts` scaling: a video's time ids are its temporal patch
indices 0..t-1 whatever the clip's frame rate, in transformers (`get_rope_index`) and in vLLM 0.32
(its Qwen2-VL processor emits no seconds field, so its time factor is 1). The text after an image
or video still resumes where each engine's rule says (`mmrl.processors.rope`): transformers at
max(h, w) / merge after the block's start, vLLM at 1 + the block's largest id (time axis included).
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import Qwen2VLConfig, Qwen2VLProcessor

from mmrl.models.family import Family, register
from mmrl.models.qwen2_5_vl import media_ids, qwen_processor, tiny_text


@register
class Qwen2_VL(Family):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    model_class = "Qwen2VLForConditionalGeneration"
    tiny_grid_factor = 28
    video_time_in_seconds = False  # time ids 0..t-1, whatever the frame rate
    saved_prefixes: ClassVar[dict[str, str]] = {"model.language_model.": "model.", "model.visual.": "visual."}

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
        return qwen_processor(Qwen2VLProcessor, tokenizer, min_pixels, max_pixels, chat_template)
