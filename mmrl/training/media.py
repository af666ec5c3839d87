"""A micro-batch's images and videos through the vision tower, each prompt's once."""

from __future__ import annotations

from typing import Any

from mmrl.data.sample import PromptSample, vision_inputs
from mmrl.models import Family


class PromptMedia:
    """The vision tower's output for some prompts' images and videos, each distinct prompt's encoded once,
    from which each forward takes the items it shows, in its order, repeats allowed.

    The n responses of a prompt share its media, so the vision tower runs once per prompt instead of
    once per response; reusing the features also sums their gradients, which is exactly what n
    separate encodings would give."""

    def __init__(self, family: Family, model: Any, prompts: list[PromptSample], rows: list[int]) -> None:
        self.family = family
        self.encoded: dict[str, Any] = {}
        self.ranges: dict[str, dict[int, range]] = {}
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            distinct = sorted({i for i in rows if getattr(prompts[i], pixels) is not None})
            if not distinct:
                continue
            inputs = vision_inputs([prompts[i] for i in distinct])
            self.encoded[kind] = family.encode_media(model, inputs[pixels], inputs[grid], kind == "video")
            self.ranges[kind], cursor = {}, 0
            for i in distinct:
                count = len(getattr(prompts[i], grid))
                self.ranges[kind][i] = range(cursor, cursor + count)
                cursor += count

    def items(self, kind: str, prompt: int) -> range:
        """Where prompt `prompt`'s items of `kind` lie in the encoding (empty if it has none)."""
        return self.ranges.get(kind, {}).get(prompt, range(0))

    def take(self, picks: dict[str, list[int]]) -> dict[str, Any]:
        """The listed items of each kind, as the model's forward takes them (`mm_encoder_outputs`)."""
        return {
            kind: self.family.select_media(self.encoded[kind], items)
            for kind, items in picks.items()
            if items
        }

    def of_rows(self, rows: list[int]) -> dict[str, Any]:
        """Every item of each row's prompt, row after row."""
        return self.take({kind: [j for i in rows for j in self.items(kind, i)] for kind in self.encoded})
