"""Seeded synthetic video tasks, written as mp4 clips (PyAV). In both the answer exists only across frames.

- `recolor`: what colour does the dot end as? It shows one colour in the first half of the clip and
  another in the second, so a model that pools the frames without their order sees both colours
  equally: only the time axis (temporal patches, mRoPE's time positions) tells them apart. The video
  quickstart's task; a tiny model learns it with GRPO about as fast as the image colour task.
- `motion`: which way does the dot move? Any single frame shows a dot somewhere; only the motion says
  left, right, up or down. Harder: the tiny random-init model must learn to compare positions across
  frames, which it does in a few hundred GRPO steps on some seeds and not on others.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.data.synthetic import BACKGROUND, COLOURS, PATCH_MULTIPLE, write_meta, write_rows

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
QUESTION = "Which direction does the dot move? Answer left, right, up or down."
DOT_COLOURS = ("red", "blue", "green", "purple")
RECOLOR_QUESTION = "The dot changes colour. What colour is it at the end? Answer red, blue, green or purple."


def render_clip(rng: np.random.Generator, size: int, frames: int, direction: str) -> np.ndarray:
    """(frames, size, size, 3) uint8: a disc of a random colour crossing the frame in `direction`."""
    radius = size // 5  # about three vision patches across: a tiny vision tower sees it at once
    travel = size - 2 * radius - 2  # from touching one edge to touching the opposite one
    dx, dy = DIRECTIONS[direction]
    start = rng.integers(radius + 1, size - radius - 1, 2).astype(float)
    start[0] = radius + 1 if dx > 0 else size - radius - 1 if dx < 0 else start[0]
    start[1] = radius + 1 if dy > 0 else size - radius - 1 if dy < 0 else start[1]
    colour = np.array(COLOURS[DOT_COLOURS[int(rng.integers(len(DOT_COLOURS)))]], dtype=np.uint8)
    yy, xx = np.mgrid[:size, :size]
    clip = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        x, y = start + np.array([dx, dy]) * travel * t / max(1, frames - 1)
        clip[t] = BACKGROUND
        clip[t][(xx - x) ** 2 + (yy - y) ** 2 <= radius**2] = colour
    return clip


def render_recolor_clip(rng: np.random.Generator, size: int, frames: int, final: str) -> np.ndarray:
    """(frames, size, size, 3) uint8: a still disc in another colour for the first half, `final` after.
    The disc is two thirds of the frame across: at a fifth (the motion task's dot) the tiny model's GRPO
    run was still at chance after 100 steps."""
    radius = size // 3
    x, y = rng.integers(radius + 1, size - radius - 1, 2)
    first = rng.choice([c for c in DOT_COLOURS if c != final])
    yy, xx = np.mgrid[:size, :size]
    disc = (xx - x) ** 2 + (yy - y) ** 2 <= radius**2
    clip = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        clip[t] = BACKGROUND
        clip[t][disc] = COLOURS[first if t < frames // 2 else final]
    return clip


# task -> (question, answers, the clip renderer)
VIDEO_TASKS = {
    "motion": (QUESTION, tuple(DIRECTIONS), render_clip),
    "recolor": (RECOLOR_QUESTION, DOT_COLOURS, render_recolor_clip),
}


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


def generate_video(
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 64,
    seed: int = 0,
    image_size: int = 112,
    frames: int = 4,
    fps: int = 2,
    task: str = "recolor",
) -> dict[str, Any]:
    """Write `videos/<split>_<index>.mp4`, `train.jsonl`, `val.jsonl` and `meta.json` (EasyR1 layout
    with a `videos` column) for video `task` (`VIDEO_TASKS`); answers are balanced in each split."""
    question, answers, render = VIDEO_TASKS[task]
    if image_size % PATCH_MULTIPLE:
        raise ValueError(f"image_size must be a multiple of {PATCH_MULTIPLE}, got {image_size}")
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    histogram = {}
    for index, (split, n) in enumerate((("train", n_train), ("val", n_val))):
        rng = np.random.default_rng([seed, index])
        labels = [answers[i % len(answers)] for i in range(n)]
        labels = [labels[i] for i in rng.permutation(n)]
        rows = []
        for i, answer in enumerate(labels):
            rel = f"videos/{split}_{i:06d}.mp4"
            write_mp4(out / rel, render(rng, image_size, frames, answer), fps)
            row = {
                "id": f"{split}-{i:06d}",
                "problem": f"<video>{question}",
                "answer": answer,
                "videos": [rel],
            }
            rows.append(row)
        write_rows(out / f"{split}.jsonl", rows)
        histogram[split] = dict(Counter(labels))
    meta = {
        "task": task,
        "question": question,
        "seed": seed,
        "image_size": image_size,
        "frames": frames,
        "fps": fps,
        "n_train": n_train,
        "n_val": n_val,
        "answers": list(answers),
        "answer_histogram": histogram,
    }
    write_meta(out, meta)
    return meta
