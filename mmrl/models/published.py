"""The architectures of the models mmrl's GPU recipes train, as their published configs give them.

`mmrl plan` sizes a recipe before its model is downloaded: each entry is the family's transformers
config with the published sizes over its defaults, enough to build the model on the meta device and
count every parameter. A downloaded model's own config.json always wins (`mmrl.models.load_config`).
"""

from __future__ import annotations

import copy
from typing import Any

import transformers

# Qwen3-4B's language model, which Qwen3-VL-4B carries as its text model
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}

# Qwen3-8B's language model, which Qwen3-VL-8B and InternVL3.5-8B carry as their text models
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

# hub id -> (transformers config class, keyword arguments over its defaults)
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": (
        "Qwen2_5_VLConfig",
        {
            "text_config": {
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "vocab_size": 152064,
            },
            "vision_config": {"hidden_size": 1280, "out_hidden_size": 3584},
            "tie_word_embeddings": False,
        },
    ),
    "Qwen/Qwen2.5-VL-3B-Instruct": (
        "Qwen2_5_VLConfig",
        {
            "text_config": {
                "hidden_size": 2048,
                "intermediate_size": 11008,
                "num_hidden_layers": 36,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            },
            "vision_config": {"hidden_size": 1280, "out_hidden_size": 2048},
            "tie_word_embeddings": True,
        },
    ),
    "Qwen/Qwen3-VL-8B-Instruct": (
        "Qwen3VLConfig",
        {
            "text_config": QWEN3_8B,
            "vision_config": {"out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]},
            "tie_word_embeddings": False,
        },
    ),
    "Qwen/Qwen3-VL-4B-Instruct": (
        "Qwen3VLConfig",
        {
            "text_config": QWEN3_4B,
            "vision_config": {
                "depth": 24,
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "out_hidden_size": 2560,
                "deepstack_visual_indexes": [5, 11, 17],
            },
            "tie_word_embeddings": True,
        },
    ),
    "Qwen/Qwen3-4B": (
        "Qwen3Config",
        QWEN3_4B,
    ),
    "Qwen/Qwen3.5-9B": (
        "Qwen3_5Config",
        {"vision_config": {"out_hidden_size": 4096}, "tie_word_embeddings": False},
    ),
    "zai-org/GLM-4.1V-9B-Thinking": ("Glm4vConfig", {}),
    "OpenGVLab/InternVL3_5-8B-HF": (
        "InternVLConfig",
        {
            "text_config": {
                "model_type": "qwen3",
                **QWEN3_8B,
                "vocab_size": 151936,
                "tie_word_embeddings": False,
            },
            "tie_word_embeddings": False,
        },
    ),
    "google/gemma-3-4b-it": (
        "Gemma3Config",
        {
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "num_hidden_layers": 34,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
            },
            "vision_config": {
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "image_size": 896,
                "patch_size": 14,
            },
        },
    ),
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": (
        "LlavaOnevisionConfig",
        {
            "text_config": {
                "model_type": "qwen2",
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "vocab_size": 152128,
            },
        },
    ),
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": ("Mistral3Config", {"tie_word_embeddings": False}),
}


def published_config(hub_id: str) -> Any | None:
    """The config of a recipe's model from its published sizes; None for a model not listed."""
    if hub_id not in PUBLISHED:
        return None
    name, kwargs = PUBLISHED[hub_id]
    return getattr(transformers, name)(**copy.deepcopy(kwargs))  # a config may keep or change its dicts
