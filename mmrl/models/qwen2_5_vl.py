"""Qwen2.5-VL: the `Family` defaults (mRoPE whose video time axis follows real seconds) and its tiny build."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

from mmrl.models.family import Family, register


def tiny_text(tokenizer: Any) -> dict[str, Any]:
    """The tiny language model the Qwen2-style families share: hidden 128, 2 layers, head_dim 32."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        # mrope_section must sum to head_dim / 2 = 128 / 4 / 2 = 16.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }


def media_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


@register
class Qwen2_5_VL(Family):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    model_class = "Qwen2_5_VLForConditionalGeneration"
    tiny_grid_factor = 28
    saved_prefixes: ClassVar[dict[str, str]] = {"model.language_model.": "model.", "model.visual.": "visual."}

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Qwen2_5_VLConfig:
        return Qwen2_5_VLConfig(
            text_config=tiny_text(tokenizer),
            vision_config={
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 4,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 128,
                "window_size": 56,
                "fullatt_block_indexes": [1],
                "tokens_per_second": 2,
            },
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        return qwen_processor(Qwen2_5_VLProcessor, tokenizer, min_pixels, max_pixels, chat_template)


def qwen_processor(
    processor_class: type, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str
) -> Any:
    """A Qwen2-VL or Qwen2.5-VL processor as their checkpoints ship it: both use Qwen2-VL's image and
    video processors, with the pixel budget as their size."""
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return processor_class(
        image_processor=Qwen2VLImageProcessor(size=size),
        video_processor=Qwen2VLVideoProcessor(size=size),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
