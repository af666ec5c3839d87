"""Seeded synthetic vision tasks with verifiable answers.

The CPU quickstart trains a tiny random-init Qwen2.5-VL with RL in minutes, so it needs data whose
visual signal is learnable by a tiny model, whose answers are checkable by string match, and whose
prompts are short enough for a tokenizer trained on a small corpus. Each task renders a PIL scene
from a numpy ``Generator`` and returns the answer plus the ``params`` that fully describe the scene,
which is what lets ``generate`` prove train and val never share a scene.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["BACKGROUND", "COLOURS", "PATCH_MULTIPLE", "SHAPES", "TASKS", "Task", "generate"]

# Qwen2.5-VL: ViT patch 14 x spatial merge 2, so each image side must be a multiple of 28.
PATCH_MULTIPLE = 28
BACKGROUND = (200, 200, 200)
# Far apart in RGB (and from the background) so a tiny model can separate them despite the noise.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (210, 0, 0),
    "green": (0, 160, 0),
    "blue": (0, 60, 230),
    "yellow": (235, 225, 0),
    "purple": (130, 0, 200),
    "orange": (250, 120, 0),
}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("one", "two", "three", "four")
NOISE = 8  # per-pixel, per-channel uniform noise amplitude: keeps pixels from being trivially constant
_MAX_REDRAWS = 1000

Params = dict[str, Any]


def _check_image_size(image_size: int) -> None:
    """Reject sizes the vision tower cannot tile without padding or resizing."""
    if (
        isinstance(image_size, bool)
        or not isinstance(image_size, int)
        or image_size <= 0
        or image_size % PATCH_MULTIPLE
    ):
        raise ValueError(
            f"image_size must be a positive multiple of {PATCH_MULTIPLE} "
            f"(ViT patch 14 x spatial merge 2), got {image_size!r}"
        )


def _choice(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def _sample_shape(rng: np.random.Generator, size: int, shape: str, colour: str) -> Params:
    """One shape whose side is 35–70% of the image, placed fully inside it."""
    side = int(rng.integers(math.ceil(0.35 * size), math.floor(0.70 * size) + 1))
    x = int(rng.integers(0, size - side + 1))
    y = int(rng.integers(0, size - side + 1))
    return {"shape": shape, "colour": colour, "x": x, "y": y, "size": side}


def _paint_shape(draw: ImageDraw.ImageDraw, params: Params) -> None:
    x, y, side = params["x"], params["y"], params["size"]
    box = (x, y, x + side - 1, y + side - 1)
    fill = COLOURS[params["colour"]]
    if params["shape"] == "circle":
        draw.ellipse(box, fill=fill)
    elif params["shape"] == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x, y + side - 1), (x + side - 1, y + side - 1), (x + (side - 1) / 2, y)], fill=fill)


def _sample_colour(rng: np.random.Generator, size: int, answer: str) -> Params:
    return _sample_shape(rng, size, _choice(rng, SHAPES), answer)


def _sample_shape_task(rng: np.random.Generator, size: int, answer: str) -> Params:
    return _sample_shape(rng, size, answer, _choice(rng, COLOUR_NAMES))


def _sample_count(rng: np.random.Generator, size: int, answer: str) -> Params:
    """Non-overlapping small circles with a visible gap, so each one is its own blob."""
    n = NUMBERS.index(answer) + 1
    r_lo = max(2, round(0.06 * size))
    r_hi = max(r_lo, round(0.11 * size))
    gap = max(3, size // 20)
    while True:  # rejection sampling; restarting a crowded scene keeps it unbiased and terminating
        circles: list[Params] = []
        for _ in range(100 * n):
            r = int(rng.integers(r_lo, r_hi + 1))
            cx = int(rng.integers(r, size - r))
            cy = int(rng.integers(r, size - r))
            if all(math.hypot(cx - c["x"], cy - c["y"]) >= r + c["r"] + gap for c in circles):
                circles.append({"x": cx, "y": cy, "r": r, "colour": _choice(rng, COLOUR_NAMES)})
                if len(circles) == n:
                    # Sorted so the same scene always has the same params, whatever the draw order.
                    return {"circles": sorted(circles, key=lambda c: (c["x"], c["y"], c["r"], c["colour"]))}


def _paint_count(draw: ImageDraw.ImageDraw, params: Params) -> None:
    for c in params["circles"]:
        x, y, r = c["x"], c["y"], c["r"]
        draw.ellipse((x - r, y - r, x + r, y + r), fill=COLOURS[c["colour"]])


@dataclass(frozen=True)
class Task:
    """A question with a closed answer set and a seeded scene renderer.

    ``sample`` draws scene params for a target answer and ``paint`` draws them; they are separate so
    ``generate`` can check params for train/val collisions before spending time on pixels.
    """

    name: str
    question: str
    answers: tuple[str, ...]
    sample: Callable[[np.random.Generator, int, str], Params]
    paint: Callable[[ImageDraw.ImageDraw, Params], None]

    def draw(self, rng: np.random.Generator, size: int, params: Params) -> Image.Image:
        """Paint ``params`` on a light-grey canvas and add mild per-pixel noise from ``rng``."""
        image = Image.new("RGB", (size, size), BACKGROUND)
        self.paint(ImageDraw.Draw(image), params)
        pixels = np.asarray(image, dtype=np.int16) + rng.integers(-NOISE, NOISE + 1, (size, size, 3))
        return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")

    def render(
        self, rng: np.random.Generator, size: int, answer: str | None = None
    ) -> tuple[Image.Image, str, Params]:
        """Render one scene; ``answer`` fixes the label (random if None) so callers can balance."""
        _check_image_size(size)
        if answer is None:
            answer = _choice(rng, self.answers)
        elif answer not in self.answers:
            raise ValueError(f"answer {answer!r} is not one of {self.name} answers {self.answers}")
        params = self.sample(rng, size, answer)
        return self.draw(rng, size, params), answer, params


TASKS: dict[str, Task] = {
    "color": Task("color", "What colour is the shape?", COLOUR_NAMES, _sample_colour, _paint_shape),
    "shape": Task("shape", "What shape is it?", SHAPES, _sample_shape_task, _paint_shape),
    "count": Task("count", "How many circles?", NUMBERS, _sample_count, _paint_count),
}

# PNG at zlib level 1: the same pixels, written faster than PIL's default level (a dataset of thousands of
# small images is generated before many runs and tests).
_FORMATS = {"png": ("PNG", "png"), "jpeg": ("JPEG", "jpg")}
SAVE_OPTIONS = {"PNG": {"compress_level": 1}, "JPEG": {}}


def _split_rng(seed: int, split: str) -> np.random.Generator:
    """Independent stream per split, so val stays put when ``n_train`` changes (bar re-drawn collisions)."""
    return np.random.default_rng([seed, ("train", "val").index(split)])


def _key(params: Params) -> str:
    return json.dumps(params, sort_keys=True)


def _write_split(
    out_dir: Path,
    task: Task,
    split: str,
    n: int,
    seed: int,
    size: int,
    image_format: str,
    taken: set[str],
) -> tuple[list[str], list[str]]:
    """Write one split's images and jsonl; re-draw any scene whose params are in ``taken``.

    Returns the params keys written (so the next split can be kept disjoint) and the answers.
    """
    rng = _split_rng(seed, split)
    # Cycle through the answer set then shuffle: per-split counts differ by at most one.
    labels = [task.answers[i % len(task.answers)] for i in range(n)]
    labels = [labels[i] for i in rng.permutation(n)]
    pil_format, ext = _FORMATS[image_format]
    keys: list[str] = []
    rows: list[dict[str, Any]] = []
    for index, answer in enumerate(labels):
        for _ in range(_MAX_REDRAWS):
            params = task.sample(rng, size, answer)
            key = _key(params)
            if key not in taken:
                break
        else:
            raise RuntimeError(
                f"could not draw a {split} scene for answer {answer!r} unseen in earlier splits after "
                f"{_MAX_REDRAWS} tries; use a larger image_size or fewer samples"
            )
        keys.append(key)
        rel = f"images/{split}_{index:06d}.{ext}"
        task.draw(rng, size, params).save(out_dir / rel, format=pil_format, **SAVE_OPTIONS[pil_format])
        record = {
            "id": f"{split}-{index:06d}",
            "problem": f"<image>{task.question}",
            "answer": answer,
            "images": [rel],
            "choices": list(task.answers),
            "task": task.name,
            "params": params,
        }
        rows.append(record)
    write_rows(out_dir / f"{split}.jsonl", rows)
    return keys, labels


def check_request(image_size: int, image_format: str, n_train: int, n_val: int) -> None:
    """A synthetic task's size, format and split sizes, refused with what is allowed."""
    _check_image_size(image_size)
    if image_format not in _FORMATS:
        raise ValueError(f"image_format must be one of {sorted(_FORMATS)}, got {image_format!r}")
    for name, n in (("n_train", n_train), ("n_val", n_val)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {n!r}")


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    """What was generated (`meta.json`): the task, its seed and sizes, the answers' counts per split."""
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A split's rows as jsonl, one JSON object a line (the EasyR1 layout `mmrl train` reads)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def generate(
    out_dir: str | Path,
    task: str = "color",
    n_train: int = 512,
    n_val: int = 64,
    seed: int = 0,
    image_size: int = 56,
    image_format: str = "png",
) -> dict[str, Any]:
    """Write a balanced, deterministic train/val dataset in the EasyR1 jsonl layout; return its meta.

    Files: ``images/<split>_<index:06d>.<ext>`` (index from 0), ``train.jsonl``, ``val.jsonl`` and
    ``meta.json``. Val scenes never repeat a train scene's params, so val measures generalisation.
    """
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known tasks: {', '.join(sorted(TASKS))}")
    check_request(image_size, image_format, n_train, n_val)
    spec = TASKS[task]
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    seen, train_labels = _write_split(out, spec, "train", n_train, seed, image_size, image_format, set())
    _, val_labels = _write_split(out, spec, "val", n_val, seed, image_size, image_format, set(seen))

    histogram: dict[str, dict[str, int]] = {}
    for split, labels in (("train", train_labels), ("val", val_labels)):
        counts = Counter(labels)
        histogram[split] = {a: counts[a] for a in spec.answers}
    meta: dict[str, Any] = {
        "task": task,
        "question": spec.question,
        "seed": seed,
        "image_size": image_size,
        "image_format": image_format,
        "n_train": n_train,
        "n_val": n_val,
        "answers": list(spec.answers),
        "answer_histogram": histogram,
    }
    write_meta(out, meta)
    return meta
