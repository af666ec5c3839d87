"""Chat messages with image and video parts, and prompt token ids with placeholders expanded."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# How Qwen's chat templates write an image and a video: each pad between the vision delimiters.
IMAGE_PART = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"
VIDEO_PART = f"<|vision_start|>{VIDEO_PAD}<|vision_end|>"
_KINDS = {IMAGE_MARKER: "image", VIDEO_MARKER: "video"}


def split_image_markers(text: str, num_images: int) -> list[dict[str, Any]]:
    """Content parts for one user turn: `<image>` markers become image parts, in order.

    Text without markers gets its images in front (the common single-image layout). A
    marker count that disagrees with the image count raises ValueError, because guessing
    would silently pair the wrong image with the wrong words.
    """
    return _split_markers(text, {IMAGE_MARKER: num_images})


def split_media_markers(text: str, num_images: int, num_videos: int) -> list[dict[str, Any]]:
    """Content parts for a turn with images and videos: `<image>` and `<video>` markers, in order.

    Each kind is checked on its own, as in `split_image_markers`; a kind without markers puts
    its parts in front, images before videos.
    """
    return _split_markers(text, {IMAGE_MARKER: num_images, VIDEO_MARKER: num_videos})


def _split_markers(text: str, counts: dict[str, int]) -> list[dict[str, Any]]:
    pieces = re.split(f"({'|'.join(map(re.escape, counts))})", text)
    parts: list[dict[str, Any]] = []
    for marker, count in counts.items():
        found = pieces.count(marker)
        if found == 0:
            parts += [{"type": _KINDS[marker]} for _ in range(count)]
        elif found != count:
            raise ValueError(f"prompt has {found} {marker} markers but the row has {count} {_KINDS[marker]}s")
    for piece in pieces:
        if piece in counts:
            parts.append({"type": _KINDS[piece]})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def build_messages(
    text: str, num_images: int, system: str | None = None, *, num_videos: int | None = None
) -> list[dict[str, Any]]:
    """A single-turn conversation, optionally with a system prompt.

    `num_videos=None` (rows without a video column) leaves `<video>` as plain text, as before
    videos were supported; a count, even 0, makes `<video>` a marker that must match it.
    """
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    if num_videos is None:
        content = split_image_markers(text, num_images)
    else:
        content = split_media_markers(text, num_images, num_videos)
    messages.append({"role": "user", "content": content})
    return messages


def encode_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tokens_per_image: Sequence[int | str],
    tokens_per_video: Sequence[int | str] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    pads: tuple[str, str] = (IMAGE_PAD, VIDEO_PAD),
) -> list[int]:
    """Render the chat template and tokenise, expanding each image and video pad to its feature count.

    An image's or video's entry is its pad count, or the whole text that replaces its pad where the family puts
    text between frames (Qwen3-VL's timestamps: `mmrl.processors.video.timestamped_video_text`). `tools`
    (JSON schemas) go to the template, which describes them and the call format in the system turn.
    `pads` are the image and video tokens as the template writes them (Qwen's unless the family's differ)."""
    extra = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    if tools and not all(json.dumps(t["function"]["name"]) in text for t in tools):
        # A template without a tools block (some Qwen-VL checkpoints) ignores `tools`: describe them in
        # the system turn as Qwen's tool-calling templates do, or the model never learns it has them.
        text = tokenizer.apply_chat_template(
            with_tools_described(messages, tools), tokenize=False, add_generation_prompt=True
        )
    return expand_pads(tokenizer, text, tokens_per_image, tokens_per_video, pads)


def with_tools_described(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` whose system turn lists `tools` and the `<tool_call>` format, in Qwen's words."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>"
        "\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def expand_pads(
    tokenizer: Any,
    text: str,
    tokens_per_image: Sequence[int | str],
    tokens_per_video: Sequence[int | str] = (),
    pads: tuple[str, str] = (IMAGE_PAD, VIDEO_PAD),
) -> list[int]:
    """Token ids of chat text whose image and video `pads` are expanded to their feature counts."""
    pieces = re.split(f"({'|'.join(map(re.escape, pads))})", text)
    image, video = pads
    counts = {image: list(tokens_per_image), video: list(tokens_per_video)}
    for pad, kind in ((image, "image"), (video, "video")):
        found = pieces.count(pad)
        if found != len(counts[pad]):
            raise ValueError(f"chat template produced {found} {kind} pads for {len(counts[pad])} {kind}s")
    queues = {pad: iter(per_item) for pad, per_item in counts.items()}
    expanded = "".join(_expand(piece, next(queues[piece])) if piece in queues else piece for piece in pieces)
    return tokenizer(expanded, add_special_tokens=False)["input_ids"]


def _expand(pad: str, item: int | str) -> str:
    return item if isinstance(item, str) else pad * item


def user_turn_text(parts: Sequence[str | None]) -> str:
    """The chat text of a user turn after an assistant turn (an environment's observation), up to the next
    assistant turn's header; None stands for an image (one pad, expanded by `expand_pads`)."""
    body = "".join(IMAGE_PART if part is None else part for part in parts)
    return f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def tool_response_text(parts: Sequence[str | None]) -> str:
    """The chat text of one tool-result turn after an assistant turn, up to the next assistant turn's
    header, in the Qwen format every supported family uses: a user turn of `<tool_response>` blocks.
    `parts` are one result each; None stands for an image (one pad, expanded by `expand_pads`)."""
    body = "\n".join(
        f"<tool_response>\n{IMAGE_PART if part is None else part}\n</tool_response>" for part in parts
    )
    return f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
