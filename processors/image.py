"""Loading any image users hand us, and sizing it for the model by the family's own library rule."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmrl.processors.files import local_path, read_media

# (height, width, factor, min_pixels, max_pixels) -> (height, width): transformers' `smart_resize`.
SizeRule = Callable[[int, int, int, int, int], tuple[int, int]]


class ImageError(ValueError):
    """An image that cannot be used; the message says which and why, for the skip log."""


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image may have once resized, the grid its sides snap to, and the rule
    that sizes it: the image processor's own, which `Family.image_size_rule` picks per family."""

    min_pixels: int = 28 * 28
    max_pixels: int = 1024 * 28 * 28
    patch_size: int = 14
    merge_size: int = 2
    rule: SizeRule = smart_resize

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


Budget = TypeVar("Budget")  # a PixelBudget or a VideoBudget: both bound pixels with min_pixels, max_pixels


def load_image(source: Any, base_dir: str | Path | None = None) -> Image.Image:
    """Open a path, bytes, `{"image"|"bytes"|"path": ...}` dict or PIL image as an upright RGB image.

    EXIF rotation is applied, palette/CMYK/16-bit/alpha images are converted, and anything
    unreadable raises `ImageError` naming the source, so the caller can skip and count it. PIL's
    warning about images past its decompression-bomb size is silenced: callers report those with
    `is_huge` in their own words, once, instead of a raw warning per image.
    """
    if isinstance(source, dict):
        source = source.get("image") or source.get("bytes") or source.get("path")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return _open(source, base_dir)


def _open(source: Any, base_dir: str | Path | None) -> Image.Image:
    try:
        if isinstance(source, Image.Image):
            image = source
        elif isinstance(source, (bytes, bytearray)):
            image = Image.open(io.BytesIO(source))
        elif isinstance(source, (str, Path)):
            path = local_path(source, base_dir)
            image = Image.open(io.BytesIO(read_media(path)))  # a FIFO or a hung mount must not block
        else:
            raise ImageError(f"unsupported image value of type {type(source).__name__}")
        image.load()
        image = ImageOps.exif_transpose(image)
        return _to_rgb(image)
    except ImageError:
        raise
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        name = source if isinstance(source, (str, Path)) else f"<{type(source).__name__}>"
        raise ImageError(f"cannot read image {name}: {err}") from err


def is_huge(image: Image.Image) -> bool:
    """Past the size PIL warns about as a possible decompression bomb (about 89 megapixels): usable,
    but decoding it costs far more time and memory than the model input it is shrunk to."""
    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and image.width * image.height > limit


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # Scale high-bit-depth greyscale into 8 bits instead of clipping it to white.
        import numpy as np

        arr = np.asarray(image, dtype=np.float64)
        top = arr.max() or 1.0
        image = Image.fromarray((arr / top * 255.0).astype("uint8"), mode="L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")


def smart_size(height: int, width: int, budget: PixelBudget) -> tuple[int, int]:
    """The (height, width) the model sees: the family's own library rule (`budget.rule`), so it is
    what the checkpoint's image processor would resize the image to.

    Sides are multiples of the patch grid and the area lies in [min_pixels, max_pixels] as far as
    the rule's rounding allows: a min = max budget can land a grid step off it, and a long strip
    pinned at one grid cell can pass max_pixels. An image without pixels, or one the rule refuses
    (aspect ratio past 200:1), raises `ImageError`, so the row is skipped as `bad_image`."""
    if height < 1 or width < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    try:
        return budget.rule(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
    except ValueError as err:
        raise ImageError(
            f"a {width}x{height} image cannot be sized for the model ({err}); crop or pad it"
        ) from err


def entry_keys(entry: Any, height: int, width: int, budget: Budget) -> tuple[int, int, Budget]:
    """The size to fit and the budget for a row's image or video entry, read as qwen-vl-utils'
    `fetch_image` reads a message's keys: `resized_height` and `resized_width` (both) stand in for
    the source size, still snapped by the rule within the run's budget; otherwise the entry's
    `min_pixels`/`max_pixels` replace the run's. A key that is absent or None (a field other rows
    of a parquet struct column have) changes nothing; a bad value raises ValueError."""
    if not isinstance(entry, dict):
        return height, width, budget
    resized = entry_int(entry, "resized_height"), entry_int(entry, "resized_width")
    if None not in resized:
        return resized[0], resized[1], budget
    low = entry_int(entry, "min_pixels") or budget.min_pixels
    high = entry_int(entry, "max_pixels") or budget.max_pixels
    if low > high:
        raise ValueError(f"min_pixels={low} exceeds max_pixels={high}; give the entry both, min <= max")
    return height, width, replace(budget, min_pixels=low, max_pixels=high)


def entry_int(entry: dict[str, Any], key: str) -> int | None:
    """The positive whole number under `key` (200704.0 from a nullable parquet column too), or None."""
    value = entry.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 1
        or not float(value).is_integer()
    ):
        raise ValueError(f"{key}={value!r}: use a positive whole number")
    return int(value)


def fit_image(image: Image.Image, budget: PixelBudget, entry: Any = None) -> Image.Image:
    """Resize to `smart_size`; the one place an image's model-input size is decided. `entry` is the
    row's value the image came from: a dict's qwen-vl-utils keys size this image (`entry_keys`)."""
    try:
        height, width, budget = entry_keys(entry, image.height, image.width, budget)
    except ValueError as err:
        raise ImageError(f"image entry: {err}") from None
    h, w = smart_size(height, width, budget)
    if (w, h) == image.size:
        return image
    return image.resize((w, h), Image.Resampling.BICUBIC)


def num_image_tokens(height: int, width: int, budget: PixelBudget) -> int:
    """Placeholder tokens for an image already fitted to the budget (one per merged patch)."""
    return (height // budget.patch_size) * (width // budget.patch_size) // budget.merge_size**2
