"""Tiny random-init models of every family, for CPU tests and the quickstart.

No hub is needed: `build_tokenizer` trains a byte-level BPE with Qwen's special tokens (and any a family
names besides, `Family.tiny_special_tokens`), and `build_tiny` writes a checkpoint folder in the exact
layout of a real one of the family (config, weights, tokenizer, processor), so loading serves tiny and
real models through one code path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2TokenizerFast

from mmrl.processors.chat import IMAGE_PART, VIDEO_PART

DEFAULT_FAMILY = "qwen2_5_vl"  # the quickstart's; see the README's supported-models table

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

# With `tools`, the system turn lists their schemas and the call format, as Qwen's templates do, in
# fewer words: the tiny tokenizer spells most English words in several tokens, and Qwen's full preamble
# would make every agent prompt several times longer than its question.
TOOLS_PREAMBLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call a tool as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
)


def chat_template(image: str = IMAGE_PART, video: str = VIDEO_PART) -> str:
    """Qwen's chat format, writing each image part as `image` and each video part as `video`."""
    return (
        TOOLS_PREAMBLE + "{% for message in messages %}"
        "{% if not (tools and loop.first and message['role'] == 'system') %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}"
        f"{{% elif part['type'] == 'video' %}}{video}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = chat_template()

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


def build_tokenizer(
    vocab_size: int = 1024,
    special_tokens: Sequence[str] = (),
    template: str = CHAT_TEMPLATE,
    added_tokens: Sequence[str] = (),
) -> Qwen2TokenizerFast:
    """Train a byte-level BPE with Qwen's special tokens, then `special_tokens` and `added_tokens` (a
    family's own, after all others, so every other id stays as it is), and a chat template (about a
    second)."""
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
    fast.add_tokens(list(special_tokens), special_tokens=True)
    fast.add_tokens(list(added_tokens))
    fast.chat_template = template
    return fast


def build_tiny(
    out_dir: str | Path,
    family: str = DEFAULT_FAMILY,
    seed: int = 0,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init tiny model of `family` (weights, tokenizer, processor) to `out_dir`.

    Pixel budgets default to 1 to 16 x 16 merged patches of the family's grid (28 px for Qwen2.5-VL,
    32 px for Qwen3-VL), the range the synthetic tasks draw from. `text` and `vision` replace
    entries of the tiny text and vision configs (a larger random-init model of the same family for
    benchmarks: `bench/vs_trl.py --shape realistic`)."""
    from mmrl.models.family import FAMILIES
    from mmrl.models.loading import save_model

    families = {f.name: f for f in FAMILIES.values()}
    if family not in families:
        raise ValueError(
            f"no tiny builder for family {family!r}; choose one of {', '.join(sorted(families))}"
        )
    cls = families[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        special_tokens=cls.tiny_special_tokens,
        template=chat_template(*cls.tiny_chat_media),
        added_tokens=cls.tiny_added_tokens,
    )
    processor = tokenizer
    if cls.takes_images:
        factor = cls.tiny_grid_factor
        processor = cls.tiny_processor(
            tokenizer, min_pixels or factor**2, max_pixels or (16 * factor) ** 2, tokenizer.chat_template
        )
    config = cls.tiny_config(tokenizer)
    text_config = config.get_text_config()
    for sub, sizes in ((text_config, text), (getattr(config, "vision_config", None), vision)):
        for key, value in (sizes or {}).items():
            setattr(sub, key, value)
    types = getattr(text_config, "layer_types", None)
    if types is not None and len(types) != text_config.num_hidden_layers:  # derived at construction
        text_config.layer_types = [types[i % len(types)] for i in range(text_config.num_hidden_layers)]
    torch.manual_seed(seed)
    model = cls.new_model(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_model(model, processor, out)
    (out / "mmrl_tiny.json").write_text(
        json.dumps({"seed": seed, "family": family, "built_by": "mmrl model init-tiny"})
    )
    return out
