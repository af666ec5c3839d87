"""A micro-batch's images and videos through the vision tower, each prompt's once.

Under FSDP every vision block is a unit of its own (`mmrl.workers.fsdp`), so a pass through the tower is a
sequence of collectives (an all-gather per block forward, a reduce-scatter per block backward) that every
rank of the group must make alike. Ranks whose micro-batches hold other media (a text-only row on one, a
video on another, Mistral 3's one pass per image) would make different numbers of passes and wait on each
other until the process group's timeout. So on a sharded model each micro-batch's passes are counted
across the group, and a rank short of the most makes the rest on a blank image (`keep_blank_image`),
whose output joins the forward's result at weight zero (`PromptMedia.tied`): gradients and values are
exactly those without it, and every rank's collectives pair up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from mmrl.data.sample import PromptSample, vision_inputs
from mmrl.models import Family, family_of
from mmrl.processors import PixelBudget, fit_image, pixel_inputs

BLANK_IMAGE = "mmrl_blank_image"  # a sharded model's attribute: one small image as its tower reads it


def keep_blank_image(model: Any, processor: Any, budget: PixelBudget) -> None:
    """Give sharded `model` the smallest image `budget` allows, prepared by `processor` as the data's are:
    the input of its padding passes (`PromptMedia`). A text-only model has none to keep."""
    if not family_of(model).takes_images:
        return
    inputs = pixel_inputs([fit_image(Image.new("RGB", (28, 28)), budget)], processor.image_processor)
    setattr(model, BLANK_IMAGE, (inputs["pixel_values"], inputs["image_grid_thw"]))


def _most_passes(model: Any, passes: int) -> int:
    """The most vision-tower passes any rank of sharded `model`'s group makes for this micro-batch."""
    if not isinstance(model, FSDPModule) or not dist.is_initialized() or dist.get_world_size() == 1:
        return passes
    most = torch.tensor([passes])  # a CPU tensor: the group runs gloo for those (`process_group_backend`)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


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
        kinds = {}
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            distinct = sorted({i for i in rows if getattr(prompts[i], pixels) is not None})
            if distinct:
                kinds[kind] = (distinct, vision_inputs([prompts[i] for i in distinct]), pixels, grid)
        # counted across the group before any pass: a pass is itself a run of collectives
        passes = sum(family.tower_passes(inputs[grid]) for _, inputs, _, grid in kinds.values())
        missing = _most_passes(model, passes) - passes if family.takes_images else 0
        for kind, (distinct, inputs, pixels, grid) in kinds.items():
            self.encoded[kind] = family.encode_media(model, inputs[pixels], inputs[grid], kind == "video")
            self.ranges[kind], cursor = {}, 0
            for i in distinct:
                count = len(getattr(prompts[i], grid))
                self.ranges[kind][i] = range(cursor, cursor + count)
                cursor += count
        blank = getattr(model, BLANK_IMAGE, None)
        self.padding = [family.encode_media(model, *blank, False) for _ in range(missing)]

    def tied(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden`, with the padding passes' outputs added at weight zero, so their backward runs (and with
        it the tower's reduce-scatters) on this rank too; the values are `hidden`'s exactly."""
        if not self.padding:
            return hidden
        leaves = tree_leaves([dict(out) for out in self.padding])
        zero = sum(t.float().sum() for t in leaves if isinstance(t, torch.Tensor)) * 0.0
        return hidden + zero.to(hidden.dtype)

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
