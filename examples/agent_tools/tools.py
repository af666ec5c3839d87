"""Your own agent tools: plain functions, named in the config as `examples/agent_tools/tools.py:NAME`.

A tool takes its JSON arguments as keyword arguments, and `images` (every image of the trajectory so
far, `mmrl.agent.SeenImage`: the full-size original and its size as the model saw it) when it declares
that parameter. It returns text, a PIL image, or a list of both. Raising `ToolError` (or any exception)
tells the model what went wrong and the run goes on; tools from files run in worker processes, so
one that hangs past `agent.tool_timeout_s` or crashes costs only that call.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps

from mmrl.agent import SeenImage, ToolError


def region_colour(bbox_2d: list[float], images: list[SeenImage], image_index: int = 0) -> str:
    """The mean colour of a box of an image (coordinates as the model saw it), as text."""
    if not 0 <= image_index < len(images):
        raise ToolError(f"image_index {image_index}: there are {len(images)} images")
    seen = images[image_index]
    sx, sy = seen.original.width / seen.model_size[0], seen.original.height / seen.model_size[1]
    x1, y1, x2, y2 = bbox_2d
    crop = seen.original.crop((int(x1 * sx), int(y1 * sy), max(int(x2 * sx), 1), max(int(y2 * sy), 1)))
    r, g, b = np.asarray(crop.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(axis=0)
    return f"mean colour: red {r:.0f}, green {g:.0f}, blue {b:.0f}"


def high_contrast(images: list[SeenImage], image_index: int = 0) -> Image.Image:
    """The image with its contrast stretched: a tool that returns a new image."""
    if not 0 <= image_index < len(images):
        raise ToolError(f"image_index {image_index}: there are {len(images)} images")
    return ImageOps.autocontrast(images[image_index].original.convert("RGB"), cutoff=2)
