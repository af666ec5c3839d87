"""Loading any image users hand us, and the single rule that decides its size for the model."""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

# Qwen2.5-VL rejects images whose long side is more than 200 times the short side.
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image that cannot be used; the message says which and why, for the skip log."""


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image may have once resized, and the grid its sides snap to."""

    min_pixels: int = 28 * 28
    max_pixels: int = 1024 * 28 * 28
    patch_size: int = 14
    merge_size: int = 2

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def load_image(source: Any, base_dir: str | Path | None = None) -> Image.Image:
    """Open a path, bytes, `{"bytes"|"path": ...}` dict or PIL image as an upright RGB image.

    EXIF rotation is applied, palette/CMYK/16-bit/alpha images are converted, and anything
    unreadable raises `ImageError` naming the source, so the caller can skip and count it. PIL's
    warning about images past its decompression-bomb size is silenced: callers report those with
    `is_huge` in their own words, once, instead of a raw warning per image.
    """
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
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
            path = Path(source)
            if base_dir is not None and not path.is_absolute():
                path = Path(base_dir) / path
            image = Image.open(path)
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
    """The (height, width) the model sees: sides are multiples of the patch grid and the area
    lies in [min_pixels, max_pixels], keeping the aspect ratio as closely as the grid allows."""
    if height < 1 or width < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 of a {width}x{height} image "
            f"exceeds {MAX_ASPECT_RATIO}:1; crop or pad it"
        )
    f = budget.factor
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > budget.max_pixels:  # scale both sides by sqrt(max / area), rounded down onto the grid
        h = f * max(1, math.isqrt(budget.max_pixels * height // (f * f * width)))
        w = f * max(1, math.isqrt(budget.max_pixels * width // (f * f * height)))
        if h * w > budget.max_pixels:  # the short side is pinned at one grid cell: trim the long one
            if h >= w:
                h = max(f, budget.max_pixels // w // f * f)
            else:
                w = max(f, budget.max_pixels // h // f * f)
    elif h * w < budget.min_pixels:  # scale both sides by sqrt(min / area), rounded up onto the grid
        h = f * _ceil_sqrt(budget.min_pixels * height, f * f * width)
        w = f * _ceil_sqrt(budget.min_pixels * width, f * f * height)
        while h * w > budget.max_pixels:  # rounding up overshot a tight budget: shrink the long side
            if h >= w:
                h -= f
            else:
                w -= f
    if not budget.min_pixels <= h * w <= budget.max_pixels:
        return _closest_in_budget(height, width, budget) or (h, w)
    return h, w


def _ceil_sqrt(numerator: int, denominator: int) -> int:
    """The smallest n with n * n >= numerator / denominator, in integers: a float square root can
    land a hair under a whole number and lose a grid cell (10000 x 10000 at 12544 px came out 84 x 84)."""
    return math.isqrt(-(-numerator // denominator) - 1) + 1


def _closest_in_budget(height: int, width: int, budget: PixelBudget) -> tuple[int, int] | None:
    """The grid size within [min_pixels, max_pixels] whose aspect ratio is nearest the image's (the
    larger on a tie), for budgets so narrow (min near max) that snapping each side misses them; None
    when no grid size fits, and then `max_pixels` wins."""
    f = budget.factor
    least, most = -(-budget.min_pixels // (f * f)), budget.max_pixels // (f * f)
    ratio = width / height
    best: tuple[float, int, int, int] | None = None
    for rows in range(1, most + 1):
        low, high = -(-least // rows), most // rows
        if low > high:
            continue
        cols = min(max(round(rows * ratio), low), high)
        candidate = (abs(math.log(cols / rows / ratio)), -rows * cols, rows, cols)
        best = candidate if best is None else min(best, candidate)
    return None if best is None else (best[2] * f, best[3] * f)


def fit_image(image: Image.Image, budget: PixelBudget) -> Image.Image:
    """Resize to `smart_size`; the one place an image's model-input size is decided."""
    h, w = smart_size(image.height, image.width, budget)
    if (w, h) == image.size:
        return image
    return image.resize((w, h), Image.Resampling.BICUBIC)


def num_image_tokens(height: int, width: int, budget: PixelBudget) -> int:
    """Placeholder tokens for an image already fitted to the budget (one per merged patch)."""
    return (height // budget.patch_size) * (width // budget.patch_size) // budget.merge_size**2
