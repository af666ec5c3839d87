"""Model loading, and the tiny random-init Qwen2.5-VL that CPU tests and the quickstart train.

No hub is needed: `build_tiny` trains its own byte-level BPE tokenizer and writes a
checkpoint folder in the exact layout of a real `Qwen/Qwen2.5-VL-*` directory, so
`load_policy`/`load_processor` serve both through one code path.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoProcessor,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2TokenizerFast,
    Qwen2VLImageProcessor,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

# Qwen's special tokens, in Qwen's order, so ids line up with the names a real checkpoint uses.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Plain-text tags the answer formats use; single tokens keep tiny-model responses short.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "what colour color is the shape how many circles square triangle circle red green blue yellow "
    "purple orange black white grey one two three four five six seven eight nine ten zero answer "
    "think image video frame object box point left right up down move moves direction towards away "
    "find locate the a an of in on at to and or with which where count angle degrees length area "
    "radius side find value x y z pi sqrt frac boxed cm units reach push block goal target arm "
    "pick place put arrow dot it are there this that question respond format only word"
).split()


def _tokenizer_corpus() -> list[str]:
    """Text the tiny BPE is trained on: words, digits, LaTeX and the chat scaffolding."""
    lines = [" ".join(_WORDS), " ".join(w.capitalize() for w in _WORDS)]
    lines += [f"{w} " * 3 for w in _WORDS]
    lines += [" ".join(str(i) for i in range(200)), "0.5 1.25 3.14 -2 +7 = ( ) [ ] { } , . : ; ? ! % ° ^"]
    lines += ["\\boxed{12} \\frac{1}{2} \\sqrt{3} \\pi 60^\\circ x = 5 \\cdot \\times \\div"]
    lines += ['{"bbox_2d": [10, 20, 30, 40], "label": "red"}', "user assistant system\n"]
    return lines * 4


def build_tokenizer(vocab_size: int = 1024) -> Qwen2TokenizerFast:
    """Train a byte-level BPE with Qwen's special tokens and chat template (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.add_tokens(TAG_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer: Qwen2TokenizerFast) -> Qwen2_5_VLConfig:
    """A ~1M-parameter Qwen2.5-VL: real architecture, tiny widths (see ENVIRONMENT.md)."""
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config={
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
        },
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
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def build_tiny(
    out_dir: str | Path, seed: int = 0, min_pixels: int = 28 * 28, max_pixels: int = 448 * 448
) -> Path:
    """Write a random-init tiny Qwen2.5-VL checkpoint (weights, tokenizer, processor) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        video_processor=Qwen2VLVideoProcessor(size=size),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / "mmrl_tiny.json").write_text(json.dumps({"seed": seed, "built_by": "mmrl model init-tiny"}))
    return out


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto` means bf16 on GPUs that support it, fp32 elsewhere (CPU bf16 is slow and noisy)."""
    if name == "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def never_generated_ids(config: Any) -> list[int]:
    """Vision placeholder tokens: the policy must never emit them (they would break mRoPE and the image
    slots of the next forward), so engines block them and the trainer's log-probs exclude them too,
    keeping the trained distribution the one that was sampled."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, n, None) for n in names) if i is not None]


def autocast_for(model: Any, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for forward passes. Trained parameters stay fp32, so AdamW steps of 1e-6
    are not rounded away as they would be in bf16 weights; the matmuls run in `dtype`."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


SHARDED_MARKER = "mmrl_sharded.json"  # in a checkpoint's model/ folder: the weights are FSDP shards in dcp/


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """Load a Qwen2.5-VL checkpoint folder (tiny or real) for training or generation."""
    path = Path(path)
    if (path / SHARDED_MARKER).exists():
        raise FileNotFoundError(
            f"{path} holds FSDP shards written by Ray workers, not a transformers model. Convert it once with "
            f"`mmrl export {path.parent} <out_dir>` and use <out_dir>."
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"No model checkpoint at {path} (config.json missing). "
            f"Build a tiny one with `mmrl model init-tiny {path}`, or point model.path at a "
            "downloaded Qwen2.5-VL folder."
        )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device)


def load_processor(path: str | Path) -> ProcessorMixin:
    """The processor saved next to the weights: tokenizer, chat template and image processor."""
    return AutoProcessor.from_pretrained(Path(path))
