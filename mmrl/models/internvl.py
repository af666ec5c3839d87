"""InternVL3 / InternVL3.5 in transformers' format (`internvl`): tiled images on a plain 1-D-position language model.

What differs from the Qwen line:

- Sizing: an image is cut into 1..max tiles of the vision tower's input side (448 px released), the grid
  of tiles whose aspect ratio is closest to the image's (transformers' `get_optimal_tiled_canvas`, which
  `GotOcr2ImageProcessor.crop_to_patches` tiles by), plus a thumbnail of the whole image when there is
  more than one tile. `tiled_canvas` sizes an image to its grid of whole tiles, so the processor's own
  tiling of the fitted image keeps that grid, and the pixel budget bounds the tiles' area:
  `data.min_pixels`/`max_pixels` over the tile's area are the processor's min and max tiles.
- Tokens: each tile is pixel-shuffled to a fixed `image_seq_length` tokens (256 released), and an image
  is `<img>` + that many `<IMG_CONTEXT>` per tile + `</img>`; the chat template writes `<IMG_CONTEXT>`
  alone for an image, as `InternVLProcessor` expects.
- Pixels: (tiles, 3, side, side) with a tile count per image, which the sample keeps as each image's
  one-column grid (`processors.pixel_inputs`), so the data path and the engines are the Qwen families'.
- Positions: one id per attended token, as a plain Qwen3 language model takes them (no mRoPE).
- Saved names: transformers 5.19 saves InternVL under its original checkpoints' names
  (`language_model.model.`, `vision_tower.`, ...), which vLLM's loader maps.
- vLLM: each image's `<img>`...`</img>` run is cut to one `<IMG_CONTEXT>` (`vllm_prompt_ids`), which vLLM's
  processor expands again, told each prompt's tile counts (`vllm_processor_options`).

Video is refused: transformers' InternVL writes a video's frames as image tokens that nothing but the
text `FrameN:` tells apart from an image's, and mmrl places each kind's features by kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

from mmrl.models.family import Grid, cut_runs, register
from mmrl.models.llava import LlavaLayout
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.processors import PixelBudget, Video, VideoBudget

START, END, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
# InternVL's tokenizer names its media tokens so; `InternVLProcessor` reads them by these names.
NAMED_TOKENS = {
    "start_image_token": START,
    "end_image_token": END,
    "context_image_token": CONTEXT,
    "video_token": VIDEO,
}
TINY_TILE = 56  # the tiny vision tower's input side: 4 x 4 patches of 14 px
TINY_TILE_TOKENS = 4  # (56 / 14 x 0.5) ** 2: the 4 x 4 patches pixel-shuffled to 2 x 2


def tile_range(tile: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The fewest and most tiles of side `tile` a pixel budget allows: the image processor's
    `min_patches` and `max_patches`."""
    low = max(1, -(-min_pixels // tile**2))
    return low, max(low, max_pixels // tile**2)


def tiled_canvas(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) of the whole tiles (side `factor`) an image is cut into: transformers'
    choice of tile grid, within the tile counts the pixel budget allows."""
    columns, rows = get_optimal_tiled_canvas(
        (height, width), (factor, factor), *tile_range(factor, min_pixels, max_pixels)
    )
    return rows * factor, columns * factor


def tiny_vision() -> dict[str, Any]:
    """The tiny InternViT: depth 2, hidden 64, 56 px tiles of 14 px patches (a learned 4 x 4 position grid)."""
    return {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "image_size": TINY_TILE,
        "patch_size": 14,
    }


@register
class InternVL(LlavaLayout):
    name = "internvl"
    model_types = ("internvl",)
    model_class = "InternVLForConditionalGeneration"
    takes_video = False  # see the module docstring
    tiny_grid_factor = TINY_TILE
    image_size_rule = staticmethod(tiled_canvas)
    media_pads: ClassVar[tuple[str, str]] = (CONTEXT, VIDEO)
    tiny_special_tokens: ClassVar[tuple[str, ...]] = tuple(NAMED_TOKENS.values())
    tiny_chat_media: ClassVar[tuple[str, str]] = (CONTEXT, VIDEO)

    # ------------------------------------------------------------------ media
    def grid(self) -> Grid:
        """Sides are multiples of the tile (`factor`): patches per tile side stand where Qwen's merge does."""
        vision = self.config.vision_config
        patch = vision.patch_size[0]
        return Grid(patch, vision.image_size[0] // patch, 1)

    def never_generated_ids(self) -> list[int]:
        """`<IMG_CONTEXT>` alone: `<img>` and `</img>` are text to the model, and sampling one moves no slot."""
        return [self.config.image_token_id]

    def image_placeholder(self, height: int, width: int, budget: PixelBudget) -> int | str:
        """`<img>`, `image_seq_length` `<IMG_CONTEXT>` per tile and the thumbnail (when tiled), `</img>`."""
        tiles = (height // budget.factor) * (width // budget.factor)
        tiles += tiles > 1
        return START + CONTEXT * (tiles * self.config.image_seq_length) + END

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        raise ValueError(f"{self.name} models take no video in mmrl yet (see mmrl/models/internvl.py)")

    def vllm_prompt_ids(self, prompt_ids: Sequence[int], tokenizer: Any) -> list[int]:
        """One `<IMG_CONTEXT>` per image: vLLM writes `<img>`, the tiles' `<IMG_CONTEXT>`s and `</img>` back
        in place of it, so each image's run from `<img>` through `</img>` is cut to one."""
        start, end = tokenizer.convert_tokens_to_ids([START, END])
        context = self.config.image_token_id
        return cut_runs(prompt_ids, start, end, context, then=context)  # a written `<img>` stays

    def vllm_processor_options(self, images: Sequence[Any]) -> dict[str, Any]:
        """The tile range that makes vLLM's processor cut each image into the tiles it was fitted to (its
        saved range could pick others): the images' own counts. Within a range the processor may take a
        larger grid of an image's shape (its tie-break, as `processors.tiled_inputs` says), so images of
        different counts in one prompt must each be the processor's pick within the range of them all (a
        prompt where one is not stops the run when it is sampled, naming the way out)."""
        if not images:
            return {}
        side = self.grid().factor
        grids = [(image.height // side, image.width // side) for image in images]
        low, high = min(r * c for r, c in grids), max(r * c for r, c in grids)
        for rows, columns in grids:
            picked = get_optimal_tiled_canvas((rows * side, columns * side), (side, side), low, high)
            if picked != (columns, rows):
                raise ValueError(
                    f"vLLM's InternVL processor takes one tile range per prompt, and within {low}..{high} tiles "
                    f"it would cut a {rows} x {columns}-tile image into another grid than the trainer's: give "
                    "this prompt's images one size, or set rollout.engine=hf"
                )
        return {"images_kwargs": {"crop_to_patches": True, "min_patches": low, "max_patches": high}}

    # ------------------------------------------------------------------ forward
    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        """Every tile through InternViT and the projector, then each image's tiles as one run of features
        (`grids` holds each image's tile count)."""
        device = next(model.parameters()).device
        tiles = model.model.get_image_features(pixel_values=pixels.to(device)).pooler_output
        per_image = tiles.split(grids[:, 0].tolist())
        return BaseModelOutputWithPooling(pooler_output=tuple(t.flatten(0, 1) for t in per_image))

    def token_inputs(self, model: Any, input_ids: torch.Tensor, media: dict[str, Any]) -> dict[str, Any]:
        """The model's forward takes one tensor of image features: the selected images', in order."""
        tokens = super().token_inputs(model, input_ids, media)
        if media:
            features = torch.cat(media["image"].pooler_output)
            tokens["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=features)}
        return tokens

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The tiles alone: the model finds each image's features by its `<IMG_CONTEXT>` tokens."""
        return {"pixel_values": vision["pixel_values"]} if "pixel_values" in vision else {}

    # ------------------------------------------------------------------ structure
    def vision_layers(self, model: Any) -> nn.ModuleList:
        """InternViT's blocks (`layer`, not `layers`)."""
        return model.model.vision_tower.encoder.layer

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> InternVLConfig:
        """A tiny InternViT on a tiny Qwen3 (InternVL3.5's language model), head untied as released."""
        text = tiny_text(tokenizer)
        text.update(
            model_type="qwen3", head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
        return InternVLConfig(
            text_config=text,
            vision_config=tiny_vision(),
            image_token_id=tokenizer.convert_tokens_to_ids(CONTEXT),
            image_seq_length=TINY_TILE_TOKENS,
            tie_word_embeddings=False,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `InternVLProcessor`: 56 px tiles, as many as the pixel budget allows (`tile_range`), the
        image processor tiling whenever it is called (as the processor asks it to), and the tokenizer's
        media tokens named as InternVL's tokenizer names them."""
        tokenizer._set_model_specific_special_tokens(NAMED_TOKENS)  # transformers' own naming of them
        low, high = tile_range(TINY_TILE, min_pixels, max_pixels)
        tile = {"height": TINY_TILE, "width": TINY_TILE}
        return InternVLProcessor(
            image_processor=GotOcr2ImageProcessor(
                size=tile, crop_to_patches=True, min_patches=low, max_patches=high
            ),
            video_processor=InternVLVideoProcessor(size=tile),
            tokenizer=tokenizer,
            image_seq_length=TINY_TILE_TOKENS,
            chat_template=chat_template,
        )
