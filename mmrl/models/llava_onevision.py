"""LLaVA-OneVision (`llava_onevision`): a SigLIP tower seeing an image at any resolution, on a Qwen2 language model.

What differs from the Qwen line:

- Sizing: the tower takes squares of one base side (384 px released). An image becomes the base side's
  squash of the whole image plus a grid of base squares of it, the grid one of the config's
  `image_grid_pinpoints` (every 1..6 by 1..6 released) that `select_best_resolution` picks for its size.
  `pinpoint_canvas` resizes an image to such a grid of whole base squares (the one that picks itself),
  within the pixel budget: the crops then cover it without padding, the model's unpadding removes nothing,
  and the image's size is its grid's.
- Tokens: an image is `<image>` repeated for its features: the base square's patches, the grid's patches
  (bilinearly pooled when they pass the `anyres_max_9` budget) and an image-newline per row of them. The
  count is `LlavaOnevisionProcessor`'s own (`feature_count`).
- Pixels: an image's crops (base square first) padded with zero crops to (rows + 1) x (columns + 1), its
  grid `[rows + 1, columns + 1]` (`processors.anyres_inputs`): the grid's product is the image's rows of
  `pixel_values`, as every family's is, and it still tells a 2 x 1 grid from a 1 x 2 one, which the crop
  count alone would not. The model's own 5-D `pixel_values` are zero-padded along crops in the same way.
- Images are each tiled as `LlavaOnevisionProcessor` tiles an image passed in a flat list (the model's
  forward without `batch_num_images`); its nested-list mode, which shows each image of a multi-image
  prompt as one base square, is not used.
- Positions: one id per attended token, as a plain Qwen2 language model takes them.
- Saved names: transformers 5.19 saves LLaVA-OneVision under its original checkpoints' names
  (`language_model.model.`, `image_newline`, ...) but SigLIP without the `vision_model.` the released
  checkpoints hold it under, which vLLM 0.32's loader needs: folders mmrl writes and weight syncs use the
  released names (`checkpoint_tensors`).
- vLLM: each run of `<image>` is cut to one (`vllm_prompt_ids`) and vLLM's own any-resolution processor
  expands it again; on images sized to a grid (`pinpoint_canvas`) it gives the trainer's tokens exactly.

Video is refused for now: LLaVA-OneVision pools each frame's patches 2 x 2 and adds one newline per
video, a placeholder and encoding path mmrl does not write yet.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
)
from transformers.image_processing_utils import select_best_resolution
from transformers.modeling_outputs import BaseModelOutputWithPooling

from mmrl.models.family import Grid, register
from mmrl.models.llava import LlavaLayout, ReleasedSiglipNames
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.processors import PixelBudget, Video, VideoBudget

IMAGE, VIDEO = "<image>", "<video>"
GRID_SIDES = 6  # the released pinpoints: every grid of 1..6 by 1..6 base squares
TINY_BASE = 28  # the tiny SigLIP's input side: 2 x 2 patches of 14 px
TINY_PATCH = 14


def pinpoints(side: int) -> list[list[int]]:
    """Every grid of 1..`GRID_SIDES` by 1..`GRID_SIDES` squares of `side`, (height, width), as released."""
    return [[i * side, j * side] for i in range(1, GRID_SIDES + 1) for j in range(1, GRID_SIDES + 1)]


def pinpoint_canvas(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) of the grid of whole base squares (side `factor`) an image is resized to:
    transformers' `select_best_resolution` among the released grids whose area the pixel budget allows
    (the smallest grid when it allows none). An image of that size picks that grid again in the image
    processor and in the model, so its crops, features and tokens are the grid's exactly."""
    allowed = [p for p in pinpoints(factor) if min_pixels <= p[0] * p[1] <= max_pixels]
    return tuple(select_best_resolution((height, width), allowed or [[factor, factor]]))


def feature_count(config: Any, height: int, width: int) -> int:
    """The image features (so `<image>` tokens) of an image of this size: `LlavaOnevisionProcessor`'s own
    count, run on the config's pinpoints, base side and token budget rather than on a processor's."""
    side = config.vision_config.image_size
    counter = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=config.image_grid_pinpoints),
        num_image_tokens=(side // config.vision_config.patch_size) ** 2,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )
    counter._get_unpadded_features = functools.partial(
        LlavaOnevisionProcessor._get_unpadded_features, counter
    )
    return LlavaOnevisionProcessor._get_number_of_features(counter, height, width, side, side)


@register
class LlavaOnevision(ReleasedSiglipNames, LlavaLayout):
    name = "llava_onevision"
    model_types = ("llava_onevision",)
    model_class = "LlavaOnevisionForConditionalGeneration"
    takes_video = False  # see the module docstring
    tiny_grid_factor = TINY_BASE
    image_size_rule = staticmethod(pinpoint_canvas)
    media_pads: ClassVar[tuple[str, str]] = (IMAGE, VIDEO)
    # transformers 5.19 saves LLaVA-OneVision under the names of its original (LLaVA-NeXT) checkpoints...
    saved_prefixes: ClassVar[dict[str, str]] = {
        **LlavaLayout.saved_prefixes,
        "model.image_newline": "image_newline",
    }
    # ...but for SigLIP's (`ReleasedSiglipNames`).
    tiny_special_tokens: ClassVar[tuple[str, ...]] = (IMAGE, VIDEO)
    tiny_chat_media: ClassVar[tuple[str, str]] = (IMAGE, VIDEO)

    # ------------------------------------------------------------------ media
    def grid(self) -> Grid:
        """Sides are multiples of the base square (`factor`), which stands where a patch does: 384 px is no whole
        number of SigLIP's 14 px patches (the tower drops the last 6 px), so a patch-times-merge grid cannot hold it."""
        return Grid(self.config.vision_config.image_size, 1, 1)

    def never_generated_ids(self) -> list[int]:
        """`<image>` and `<video>`: a sampled one would be a media slot to the next forward."""
        return [self.config.image_token_id, self.config.video_token_id]

    def image_placeholder(self, height: int, width: int, budget: PixelBudget) -> int | str:
        """The processor's feature count for an image sized to one of the config's grids (`pinpoint_canvas`);
        any other size would be padded and unpadded, which mmrl does not count for."""
        if [height, width] not in [list(p) for p in self.config.image_grid_pinpoints]:
            raise ValueError(
                f"a {width}x{height} image is not one of the model's image_grid_pinpoints; mmrl sizes images "
                "to them (pinpoint_canvas), which needs the released grids of 1..6 by 1..6 base squares"
            )
        return feature_count(self.config, height, width)

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        raise ValueError(f"{self.name} models take no video in mmrl yet (see mmrl/models/llava_onevision.py)")

    def crops(self, pixels: torch.Tensor, grids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each image's real crops (its zero padding cut off) and its size, (height, width) in pixels, as the
        model's `image_sizes`: the grid's rows and columns of base squares."""
        side = self.config.vision_config.image_size
        blocks = pixels.split(grids.prod(dim=-1).tolist())
        rows, columns = grids[:, 0] - 1, grids[:, 1] - 1
        real = [block[: 1 + int(r * c)] for block, r, c in zip(blocks, rows, columns, strict=True)]
        return real, torch.stack([rows, columns], dim=1) * side

    # ------------------------------------------------------------------ forward
    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        """Every image's crops through SigLIP and the projector, then the model's own packing (grid layout,
        pooling, newlines): one run of features per image."""
        device = next(model.parameters()).device
        crops, sizes = self.crops(pixels, grids)
        features = model.model.get_image_features(
            pixel_values=torch.cat(crops).to(device), image_sizes=sizes.to(device)
        ).pooler_output
        return BaseModelOutputWithPooling(pooler_output=tuple(features))

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The crops as the model's 5-D `pixel_values` (zero-padded along crops, as the processor batches
        them) and `image_sizes`; no `batch_num_images`, so every image is tiled as mmrl counted it."""
        if "pixel_values" not in vision:
            return {}
        crops, sizes = self.crops(vision["pixel_values"], vision["image_grid_thw"])
        most = max(len(c) for c in crops)
        padded = torch.stack([nn.functional.pad(c, (0, 0, 0, 0, 0, 0, 0, most - len(c))) for c in crops])
        return {"pixel_values": padded, "image_sizes": sizes}

    # ------------------------------------------------------------------ structure
    def freeze_vision(self, model: Any) -> None:
        """SigLIP, the projector and the image-newline embedding: what the language model reads images by."""
        super().freeze_vision(model)
        model.model.image_newline.requires_grad_(False)

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> LlavaOnevisionConfig:
        """A tiny SigLIP (28 px base squares, the released grids of them) on a tiny Qwen2, head untied."""
        text = tiny_text(tokenizer)
        text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        ids = tokenizer.convert_tokens_to_ids
        return LlavaOnevisionConfig(
            text_config=text,
            vision_config={
                "model_type": "siglip_vision_model",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": TINY_BASE,
                "patch_size": TINY_PATCH,
                "vision_use_head": False,
            },
            image_token_index=ids(IMAGE),
            video_token_index=ids(VIDEO),
            image_grid_pinpoints=pinpoints(TINY_BASE),
            tie_word_embeddings=False,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `LlavaOnevisionProcessor`: 28 px base squares in the released grids of them (the pixel
        budget picks among the grids when images are fitted, not here)."""
        base = {"height": TINY_BASE, "width": TINY_BASE}
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(
                size=base, image_grid_pinpoints=pinpoints(TINY_BASE)
            ),
            video_processor=LlavaOnevisionVideoProcessor(size=base),
            tokenizer=tokenizer,
            num_image_tokens=(TINY_BASE // TINY_PATCH) ** 2,
            vision_feature_select_strategy="full",
            chat_template=chat_template,
        )
