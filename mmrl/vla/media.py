"""Episodes as an animated GIF: the quickest way to see what a policy does (Pillow only, no codecs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

_BORDER = 3
_SUCCESS, _FAILURE, _RUNNING = (40, 200, 60), (220, 40, 40), (255, 255, 255)


def episodes_gif(
    frames: list[list[np.ndarray]], success: list[bool], path: Path, scale: int = 2, fps: int = 10
) -> Path:
    """Episodes side by side, each framed white while running and green or red once it has ended;
    an episode that ended early holds its last frame."""
    if not frames:
        raise ValueError("no episodes to draw")
    length = max(map(len, frames))
    sheets = []
    for t in range(length):
        tiles = []
        for episode, ok in zip(frames, success, strict=True):
            frame = episode[min(t, len(episode) - 1)]
            ended = t >= len(episode) - 1
            colour = (_SUCCESS if ok else _FAILURE) if ended else _RUNNING
            tiles.append(np.pad(frame, ((_BORDER, _BORDER), (_BORDER, _BORDER), (0, 0)), constant_values=0))
            tiles[-1][:_BORDER], tiles[-1][-_BORDER:] = colour, colour
            tiles[-1][:, :_BORDER], tiles[-1][:, -_BORDER:] = colour, colour
        sheet = Image.fromarray(np.concatenate(tiles, axis=1))
        sheets.append(sheet.resize((sheet.width * scale, sheet.height * scale), Image.NEAREST))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheets[0].save(path, save_all=True, append_images=sheets[1:], duration=1000 // fps, loop=0)
    return path
