"""Pixel tensors for images that `fit_image` has already sized."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image


def pixel_inputs(images: list[Image.Image], image_processor: Any) -> dict[str, torch.Tensor]:
    """Normalise and patchify with the checkpoint's own image processor, never resizing again.

    Resizing here would let the processor and the prompt disagree on the token count, the
    classic "image features and image tokens do not match" failure. A processor that cuts images into
    tiles (`crop_to_patches`: GotOcr2's, which InternVL uses) is `tiled_inputs`'; one that cuts them into
    any-resolution grids (`image_grid_pinpoints`: LLaVA-OneVision's) is `anyres_inputs`'; one that pads
    images of their own sizes to one batch (`image_sizes`: Pixtral's) is `patch_inputs`'.
    """
    if hasattr(image_processor, "crop_to_patches"):
        return tiled_inputs(images, image_processor)
    if hasattr(image_processor, "image_grid_pinpoints"):
        return anyres_inputs(images, image_processor)
    out = image_processor(images=images, do_resize=False, return_tensors="pt")
    if "image_sizes" in out:
        return patch_inputs(out["pixel_values"], out["image_sizes"], image_processor.patch_size["height"])
    if "image_grid_thw" not in out:
        # One fixed square per image (Gemma 3's): one row of `pixel_values` each, its grid [1].
        return {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": torch.ones(len(images), 1, dtype=torch.long),
        }
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def tiled_inputs(images: list[Image.Image], image_processor: Any) -> dict[str, torch.Tensor]:
    """The tiles of images already sized to whole grids of tiles (`fit_image`), and each image's tile count
    (thumbnail included) as a one-column grid, whose product is its rows of `pixel_values` as a Qwen
    grid's is. Each image is cut into exactly the tiles it holds: with a range of counts the processor
    could pick a larger grid of the same shape (its tie-break), and the prompt's count would be wrong."""
    side = image_processor.size.height
    pixels, counts = [], []
    for image in images:
        tiles = (image.height // side) * (image.width // side)
        out = image_processor(
            images=[image], crop_to_patches=True, min_patches=tiles, max_patches=tiles, return_tensors="pt"
        )
        pixels.append(out["pixel_values"])
        counts += out["num_patches"]
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(counts)[:, None]}


def anyres_inputs(images: list[Image.Image], image_processor: Any) -> dict[str, torch.Tensor]:
    """The crops of images already sized to a grid of whole base squares (`fit_image`): the base square's
    squash of the image, then the grid's crops, then zero crops up to (rows + 1) x (columns + 1), and that
    two-column grid. Its product is the image's rows of `pixel_values`, as a Qwen grid's is, and it keeps
    rows and columns apart (the model needs the grid's shape; a crop count would not tell 2 x 1 from 1 x 2).
    Each image is processed alone, so each is tiled as a single image (the processor's multi-image mode
    shows one square per image)."""
    side = image_processor.size.height
    pixels, grids = [], []
    for image in images:
        rows, columns = image.height // side, image.width // side
        crops = image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        padding = (rows + 1) * (columns + 1) - len(crops)
        pixels.append(torch.cat([crops, crops.new_zeros(padding, *crops.shape[1:])]))
        grids.append([rows + 1, columns + 1])
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}


def patch_inputs(pixels: torch.Tensor, sizes: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """Images of their own sizes, which the processor zero-pads to the largest, as each one's patches row by
    row (one (3, patch, patch) row of `pixel_values` each) and its `[rows, columns]` grid of patches: the
    grid's product is the image's rows, as a Qwen grid's is, and no image carries another's padding."""
    blocks, grids = [], []
    for image, (height, width) in zip(pixels, sizes.tolist(), strict=True):
        rows, columns = height // patch, width // patch
        block = image[:, :height, :width].reshape(3, rows, patch, columns, patch).permute(1, 3, 0, 2, 4)
        blocks.append(block.reshape(rows * columns, 3, patch, patch))
        grids.append([rows, columns])
    return {"pixel_values": torch.cat(blocks), "image_grid_thw": torch.tensor(grids)}
