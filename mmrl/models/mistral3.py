"""Mistral 3 (`mistral3`): a Pixtral tower seeing each image at its own size, on a Mistral language model.

What differs from the Qwen line:

- Sizing: `PixtralImageProcessor` never upscales; it scales an image down to fit a longest edge, then rounds
  each side up to a whole number of merged patches (`pixtral_size`, its own function). mmrl's longest edge
  is the largest multiple of patch x merge within the square root of `max_pixels`, so a fitted image is one
  the processor leaves as it is; `min_pixels` has no say, as in the processor.
- Tokens: an image is a row of `[IMG]` per row of merged patches, each row closed by `[IMG_BREAK]`, the
  last by `[IMG_END]` instead: the text `PixtralProcessor` (which transformers uses for `mistral3`) puts
  where the chat template writes `[IMG]`.
- Pixels: an image's tower patches, row by row, one (3, patch, patch) row of `pixel_values` each, its grid
  `[rows, columns]` of patches (`processors.patch_inputs`): the grid's product is the image's rows of
  `pixel_values`, as every family's is, without padding images of different sizes to one. The model's own
  `pixel_values` (images zero-padded to the largest) and `image_sizes` are rebuilt from them.
- Tower: Pixtral attends within each image through its own block mask, with 2-D RoPE over the image's
  patch grid; the projector merges 2 x 2 patches into one feature.
- Positions: one id per attended token, as a plain Mistral language model takes them. Mistral Small 3.1's
  text model has no sliding window, nor has the tiny one, so the shared-prompt and packed forwards are exact;
  a checkpoint with a window shorter than its rows would need the packed forward refused, as Gemma 3's is.
- Saved names: transformers 5.19 saves Mistral 3 under its original LLaVA checkpoints' names, as InternVL.
- vLLM: each image's run is cut back to one `[IMG]` (`vllm_prompt_ids`), which vLLM's Pixtral processor
  expands again, rows, breaks and end included; the break and end ids come from the tokenizer, since a
  Mistral 3 config names only `[IMG]`. No video options reach vLLM (the processor has no video processor).

Video is refused: Mistral 3 takes no video.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor
from transformers.image_utils import ChannelDimension
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

from mmrl.models.family import Grid, cut_runs, register
from mmrl.models.llava import LlavaLayout
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.processors import PixelBudget, Video, VideoBudget
from mmrl.processors.chat import VIDEO_PAD

IMAGE, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
TINY_PATCH = 14  # the tiny Pixtral's patch; merged 2 x 2, sides are multiples of 28 as Qwen2.5-VL's


def pixtral_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """`PixtralImageProcessor`'s size for an image, its longest edge the largest multiple of `factor` within
    the square root of `max_pixels`: scaled down to fit (never up), sides rounded up to multiples of
    `factor`. A strip scaled to under a pixel across has no size: refused, as the processor would fail."""
    longest = max(factor, math.isqrt(max_pixels) // factor * factor)
    if max(height, width) > longest and min(height, width) * longest < max(height, width):
        raise ValueError(f"its short side would be under a pixel once the long side fits {longest} px")
    shape = np.broadcast_to(np.zeros((), np.uint8), (height, width, 3))  # the function reads only the size
    return get_resize_output_image_size(
        shape, size=(longest, longest), patch_size=(factor, factor), input_data_format=ChannelDimension.LAST
    )


@register
class Mistral3(LlavaLayout):
    name = "mistral3"
    model_types = ("mistral3",)
    model_class = "Mistral3ForConditionalGeneration"
    takes_video = False
    image_size_rule = staticmethod(pixtral_size)
    media_pads: ClassVar[tuple[str, str]] = (IMAGE, VIDEO_PAD)
    tiny_special_tokens: ClassVar[tuple[str, ...]] = (IMAGE, BREAK, END)
    tiny_chat_media: ClassVar[tuple[str, str]] = (IMAGE, VIDEO_PAD)

    # ------------------------------------------------------------------ media
    def grid(self) -> Grid:
        """The merge is the projector's: `spatial_merge_size` sits at the config's top level, not the tower's."""
        return Grid(self.config.vision_config.patch_size, self.config.spatial_merge_size, 1)

    def image_placeholder(self, height: int, width: int, budget: PixelBudget) -> int | str:
        """`PixtralProcessor`'s text for an image of this size: `[IMG]` per merged patch, rows closed by
        `[IMG_BREAK]`, the last by `[IMG_END]`."""
        rows, columns = height // self.grid().factor, width // self.grid().factor
        return ((IMAGE * columns + BREAK) * rows)[: -len(BREAK)] + END

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        raise ValueError(f"{self.name} models take no video")

    def vllm_prompt_ids(self, prompt_ids: Sequence[int], tokenizer: Any) -> list[int]:
        """One `[IMG]` per image: each run, from its first `[IMG]` through its `[IMG_END]`, cut to its first
        token (images written back to back stay apart, as each run ends at its own `[IMG_END]`)."""
        image = self.config.image_token_index
        return cut_runs(prompt_ids, image, tokenizer.convert_tokens_to_ids(END), image)

    def unpatched(self, pixels: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """Each image, (3, height, width), from its patch rows (`processors.patch_inputs`)."""
        patch = pixels.shape[-1]
        blocks = pixels.split(grids.prod(dim=-1).tolist())
        return [
            block.reshape(rows, columns, 3, patch, patch).permute(2, 0, 3, 1, 4).reshape(3, rows * patch, -1)
            for block, (rows, columns) in zip(blocks, grids.tolist(), strict=True)
        ]

    def images(self, pixels: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's `pixel_values` (the images zero-padded to the largest, as `PixtralImageProcessor`
        batches them) and `image_sizes`, (height, width) in pixels."""
        images = self.unpatched(pixels, grids)
        sizes = torch.tensor([image.shape[1:] for image in images])
        tall, wide = sizes.max(dim=0).values.tolist()
        padded = [nn.functional.pad(i, (0, wide - i.shape[2], 0, tall - i.shape[1])) for i in images]
        return torch.stack(padded), sizes

    # ------------------------------------------------------------------ forward
    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        """Each image through Pixtral and the patch merger on its own: one run of features per image. Pixtral
        runs a batch as one sequence under a dense block mask, whose size grows with the square of the
        batch's patches (tens of GB for a few full-size images); alone, each image's is its own square."""
        device = next(model.parameters()).device
        features = []
        for image in self.unpatched(pixels, grids):
            size = torch.tensor([image.shape[1:]], device=device)
            encoded = model.model.get_image_features(pixel_values=image[None].to(device), image_sizes=size)
            features += encoded.pooler_output
        return BaseModelOutputWithPooling(pooler_output=tuple(features))

    def tower_passes(self, grids: torch.Tensor) -> int:
        """One pass per image (`encode_media`)."""
        return len(grids)

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The images as the model's padded `pixel_values` and `image_sizes`."""
        if "pixel_values" not in vision:
            return {}
        images, sizes = self.images(vision["pixel_values"], vision["image_grid_thw"])
        return {"pixel_values": images, "image_sizes": sizes}

    # ------------------------------------------------------------------ structure
    def vision_layers(self, model: Any) -> nn.ModuleList:
        return model.model.vision_tower.transformer.layers

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Mistral3Config:
        """A tiny Pixtral (14 px patches, merged 2 x 2) on a tiny Mistral without a sliding window, head untied."""
        text = tiny_text(tokenizer)
        text.update(
            model_type="mistral",
            head_dim=32,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        return Mistral3Config(
            text_config=text,
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "head_dim": 16,
                "image_size": 1024,  # the 2-D RoPE's reach: up to 73 patches a side
                "patch_size": TINY_PATCH,
            },
            image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
            spatial_merge_size=2,
            tie_word_embeddings=False,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `PixtralProcessor`, its longest edge the pixel budget's (`pixtral_size`)."""
        factor = 2 * TINY_PATCH
        return PixtralProcessor(
            image_processor=PixtralImageProcessor(
                size={"longest_edge": max(factor, math.isqrt(max_pixels) // factor * factor)},
                patch_size={"height": TINY_PATCH, "width": TINY_PATCH},
            ),
            tokenizer=tokenizer,
            patch_size=TINY_PATCH,
            spatial_merge_size=2,
            chat_template=chat_template,
        )
