"""A seeded synthetic video task: which way does the dot move? Clips are written as mp4 (PyAV).

The answer exists only across frames: any single frame shows a dot somewhere, and only its motion
over time says left, right, up or down. That makes it a real test of the temporal path (frame
sampling, temporal patches, mRoPE's time axis), and a tiny model can learn it on a CPU in minutes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.synthetic import BACKGROUND, COLOURS, PATCH_MULTIPLE

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
QUESTION = "Which direction does the dot move? Answer left, right, up or down."


def render_clip(rng: np.random.Generator, size: int, frames: int, direction: str) -> np.ndarray:
    """(frames, size, size, 3) uint8: a disc of a random colour crossing the frame in `direction`."""
    radius = size // 5  # about three vision patches across: a tiny vision tower sees it at once
    travel = size - 2 * radius - 2  # from touching one edge to touching the opposite one
    dx, dy = DIRECTIONS[direction]
    start = rng.integers(radius + 1, size - radius - 1, 2).astype(float)
    start[0] = radius + 1 if dx > 0 else size - radius - 1 if dx < 0 else start[0]
    start[1] = radius + 1 if dy > 0 else size - radius - 1 if dy < 0 else start[1]
    colour = np.array(COLOURS[("red", "blue", "green", "purple")[int(rng.integers(4))]], dtype=np.uint8)
    yy, xx = np.mgrid[:size, :size]
    clip = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        x, y = start + np.array([dx, dy]) * travel * t / max(1, frames - 1)
        clip[t] = BACKGROUND
        clip[t][(xx - x) ** 2 + (yy - y) ** 2 <= radius**2] = colour
    return clip


def write_mp4(path: Path, clip: np.ndarray, fps: int) -> None:
    """H.264 at near-lossless quality, so the colours a tiny model reads survive the encoding."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = clip.shape[2], clip.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10"}
        for frame in clip:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def generate_motion(
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 64,
    seed: int = 0,
    image_size: int = 112,
    frames: int = 4,
    fps: int = 2,
) -> dict[str, Any]:
    """Write `videos/<split>_<index>.mp4`, `train.jsonl`, `val.jsonl` and `meta.json` (EasyR1 layout
    with a `videos` column); answers are balanced across the four directions in each split."""
    if image_size % PATCH_MULTIPLE:
        raise ValueError(f"image_size must be a multiple of {PATCH_MULTIPLE}, got {image_size}")
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    histogram = {}
    for index, (split, n) in enumerate((("train", n_train), ("val", n_val))):
        rng = np.random.default_rng([seed, index])
        labels = [list(DIRECTIONS)[i % len(DIRECTIONS)] for i in range(n)]
        labels = [labels[i] for i in rng.permutation(n)]
        lines = []
        for i, answer in enumerate(labels):
            rel = f"videos/{split}_{i:06d}.mp4"
            write_mp4(out / rel, render_clip(rng, image_size, frames, answer), fps)
            row = {
                "id": f"{split}-{i:06d}",
                "problem": f"<video>{QUESTION}",
                "answer": answer,
                "videos": [rel],
            }
            lines.append(json.dumps(row) + "\n")
        (out / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
        histogram[split] = dict(Counter(labels))
    meta = {
        "task": "motion",
        "question": QUESTION,
        "seed": seed,
        "image_size": image_size,
        "frames": frames,
        "fps": fps,
        "n_train": n_train,
        "n_val": n_val,
        "answers": list(DIRECTIONS),
        "answer_histogram": histogram,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta
