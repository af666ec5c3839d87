"""Chat messages with image parts, and prompt token ids with placeholders expanded."""

from __future__ import annotations

from typing import Any

IMAGE_MARKER = "<image>"
IMAGE_PAD = "<|image_pad|>"


def split_image_markers(text: str, num_images: int) -> list[dict[str, Any]]:
    """Content parts for one user turn: `<image>` markers become image parts, in order.

    Text without markers gets its images in front (the common single-image layout). A
    marker count that disagrees with the image count raises ValueError, because guessing
    would silently pair the wrong image with the wrong words.
    """
    pieces = text.split(IMAGE_MARKER)
    markers = len(pieces) - 1
    if markers == 0:
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        return [*parts, {"type": "text", "text": text}] if text else parts
    if markers != num_images:
        raise ValueError(f"prompt has {markers} {IMAGE_MARKER} markers but the row has {num_images} images")
    parts = []
    for i, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if i < markers:
            parts.append({"type": "image"})
    return parts


def build_messages(text: str, num_images: int, system: str | None = None) -> list[dict[str, Any]]:
    """A single-turn conversation, optionally with a system prompt."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": split_image_markers(text, num_images)})
    return messages


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], tokens_per_image: list[int]) -> list[int]:
    """Render the chat template and tokenise, expanding each image pad to its feature count."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chunks = text.split(IMAGE_PAD)
    if len(chunks) - 1 != len(tokens_per_image):
        raise ValueError(
            f"chat template produced {len(chunks) - 1} image pads for {len(tokens_per_image)} images"
        )
    expanded = chunks[0]
    for count, chunk in zip(tokens_per_image, chunks[1:], strict=True):
        expanded += IMAGE_PAD * count + chunk
    return tokenizer(expanded, add_special_tokens=False)["input_ids"]
