"""Seeded synthetic geometry problems with exact answers, for CPU tests and demos of the geometry recipe.

Real geometry sets (Geometry3K) need a download and a model that can read diagrams; these figures are
drawn here from a numpy ``Generator``, labelled like textbook diagrams, and their answers are computed
with integers only, so they are exact strings the ``geometry`` grader understands: ``47``, ``25\\pi``,
``2\\sqrt{13}``. Four kinds:

* ``triangle``: two angles labelled in degrees, find the third (``x``); each is 30 to 110 degrees.
* ``circle``: the radius labelled, find the area (``r^2 \\pi``) or the circumference (``2r \\pi``).
* ``right_triangle``: the legs labelled, find the hypotenuse as a simplified surd.
* ``line``: two or three angles on a straight line, one of them ``x``.

Rows use the EasyR1 layout of ``mmrl.data.synthetic`` (``problem`` with ``<image>``, ``answer``, ``images``),
plus ``kind`` and ``params``, which describe the figure fully and keep val figures out of train.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.data.synthetic import (
    _FORMATS,
    _MAX_REDRAWS,
    SAVE_OPTIONS,
    _key,
    _split_rng,
    check_request,
    write_meta,
    write_rows,
)

__all__ = ["DEFAULT_IMAGE_SIZE", "KINDS", "generate_geometry", "sqrt_text", "times_pi"]

DEFAULT_IMAGE_SIZE = 224  # labels stay legible; 64 image tokens per figure
INK = (0, 0, 0)
PAPER = (255, 255, 255)
Params = dict[str, Any]
Point = tuple[float, float]


def sqrt_text(n: int) -> str:
    """The square root of a positive integer, exactly: ``5`` for 25, ``2\\sqrt{13}`` for 52."""
    outside, inside = 1, n
    factor = 2
    while factor * factor <= inside:
        while inside % (factor * factor) == 0:
            inside //= factor * factor
            outside *= factor
        factor += 1
    if inside == 1:
        return str(outside)
    return f"\\sqrt{{{inside}}}" if outside == 1 else f"{outside}\\sqrt{{{inside}}}"


def times_pi(k: int) -> str:
    """``k\\pi``, written ``\\pi`` for k = 1."""
    return "\\pi" if k == 1 else f"{k}\\pi"


# ---- sampling: params that fully describe a figure -------------------------------------------------


def _sample_triangle(rng: np.random.Generator) -> Params:
    """Every angle from 30 to 110 degrees, so the triangle is not a sliver and each label fits its corner."""
    a = int(rng.integers(30, 111))
    b = int(rng.integers(max(30, 70 - a), min(110, 150 - a) + 1))
    return {"kind": "triangle", "angles": [a, b], "rotation": 30 * int(rng.integers(12))}


def _sample_circle(rng: np.random.Generator) -> Params:
    ask = ("area", "circumference")[int(rng.integers(2))]
    return {
        "kind": "circle",
        "radius": int(rng.integers(1, 21)),
        "ask": ask,
        "direction": 15 * int(rng.integers(24)),
    }


def _sample_right_triangle(rng: np.random.Generator) -> Params:
    """Legs within a factor of 3 of each other, so neither is drawn too thin to label."""
    a = int(rng.integers(2, 21))
    b = int(rng.integers(math.ceil(a / 3), min(20, 3 * a) + 1))
    return {"kind": "right_triangle", "legs": [a, b], "rotation": 30 * int(rng.integers(12))}


def _sample_line(rng: np.random.Generator) -> Params:
    """Two or three angles of at least 20 degrees along a line; `unknown` is the one labelled x."""
    if rng.integers(2):
        first = int(rng.integers(20, 141))
        angles = [first, int(rng.integers(20, 161 - first))]
    else:
        angles = [int(rng.integers(20, 161))]
    angles.append(180 - sum(angles))
    return {"kind": "line", "angles": angles, "unknown": int(rng.integers(len(angles)))}


def _answer(params: Params) -> str:
    kind = params["kind"]
    if kind == "triangle":
        return str(180 - sum(params["angles"]))
    if kind == "circle":
        r = params["radius"]
        return times_pi(r * r if params["ask"] == "area" else 2 * r)
    if kind == "right_triangle":
        a, b = params["legs"]
        return sqrt_text(a * a + b * b)
    return str(params["angles"][params["unknown"]])


def _question(params: Params) -> str:
    kind = params["kind"]
    if kind == "triangle":
        return "<image>Two angles of the triangle are given in degrees. Find x."
    if kind == "circle":
        return f"<image>The radius of the circle is shown. Find its {params['ask']} in terms of \\pi."
    if kind == "right_triangle":
        return "<image>The legs of the right triangle are shown. Find the hypotenuse x, exactly."
    return "<image>The angles lie on a straight line and are given in degrees. Find x."


# ---- drawing ---------------------------------------------------------------------------------------


class _Canvas:
    """A white square image with helpers for lines and centred labels in pixel coordinates."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.image = Image.new("RGB", (size, size), PAPER)
        self.draw = ImageDraw.Draw(self.image)
        self.font_size = max(8, size // 14)
        self.font = ImageFont.load_default(size=self.font_size)
        self.width = max(1, size // 112)

    def line(self, *points: Point) -> None:
        self.draw.line(points, fill=INK, width=self.width)

    def label(self, at: Point, text: str) -> None:
        """Text centred on `at` (computed from its box: bitmap fonts take no anchor)."""
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=self.font)
        self.draw.text(
            (at[0] - (left + right) / 2, at[1] - (top + bottom) / 2), text, fill=INK, font=self.font
        )


def _rotate(points: list[Point], degrees: float) -> list[Point]:
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def _fit(points: list[Point], size: int, margin: float) -> list[Point]:
    """Math coordinates (y up) scaled into the square image (y down), centred, `margin` pixels clear."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = (size - 2 * margin) / max(max(xs) - min(xs), max(ys) - min(ys))
    cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    return [(size / 2 + (x - cx) * scale, size / 2 - (y - cy) * scale) for x, y in points]


def _toward(a: Point, b: Point, distance: float) -> Point:
    """The point `distance` pixels from `a` in the direction of `b`."""
    length = math.dist(a, b) or 1.0
    return (a[0] + (b[0] - a[0]) * distance / length, a[1] + (b[1] - a[1]) * distance / length)


def _beside(p: Point, q: Point, inside: Point, distance: float) -> Point:
    """The point `distance` pixels from the middle of side pq, square to it, on the side away from `inside`."""
    mid = ((p[0] + q[0]) / 2, (p[1] + q[1]) / 2)
    normal = (p[1] - q[1], q[0] - p[0])
    if normal[0] * (inside[0] - mid[0]) + normal[1] * (inside[1] - mid[1]) > 0:
        normal = (-normal[0], -normal[1])
    return _toward(mid, (mid[0] + normal[0], mid[1] + normal[1]), distance)


def _corner_label(canvas: _Canvas, vertex: Point, inside: Point, angle: float, text: str) -> None:
    """A label inside the corner at `vertex`: further in for sharp corners, never past `inside`."""
    distance = canvas.font_size * 0.8 / math.sin(math.radians(angle) / 2)
    canvas.label(_toward(vertex, inside, min(distance, 0.6 * math.dist(vertex, inside))), text)


def _draw_triangle(canvas: _Canvas, params: Params) -> None:
    a, b = params["angles"]
    c = 180 - a - b
    apex_distance = math.sin(math.radians(b)) / math.sin(math.radians(c))  # law of sines, base 1
    apex = (apex_distance * math.cos(math.radians(a)), apex_distance * math.sin(math.radians(a)))
    corners = _fit(
        _rotate([(0.0, 0.0), (1.0, 0.0), apex], params["rotation"]), canvas.size, 2.0 * canvas.font_size
    )
    canvas.line(*corners, corners[0])
    centroid = (sum(p[0] for p in corners) / 3, sum(p[1] for p in corners) / 3)
    for corner, angle, text in zip(corners, (a, b, c), (f"{a}°", f"{b}°", "x°"), strict=True):
        _corner_label(canvas, corner, centroid, angle, text)


def _draw_circle(canvas: _Canvas, params: Params) -> None:
    middle = canvas.size / 2
    radius = 0.36 * canvas.size
    canvas.draw.ellipse((middle - radius,) * 2 + (middle + radius,) * 2, outline=INK, width=canvas.width)
    dot = max(2, canvas.width * 2)
    canvas.draw.ellipse((middle - dot, middle - dot, middle + dot, middle + dot), fill=INK)
    theta = math.radians(params["direction"])
    end = (middle + radius * math.cos(theta), middle - radius * math.sin(theta))
    canvas.line((middle, middle), end)
    # Beside the radius's midpoint, on its counter-clockwise side.
    offset = 0.9 * canvas.font_size
    mid = (middle + radius / 2 * math.cos(theta), middle - radius / 2 * math.sin(theta))
    canvas.label(
        (mid[0] - offset * math.sin(theta), mid[1] - offset * math.cos(theta)), str(params["radius"])
    )


def _draw_right_triangle(canvas: _Canvas, params: Params) -> None:
    a, b = params["legs"]
    right, foot, top = _fit(
        _rotate([(0.0, 0.0), (float(a), 0.0), (0.0, float(b))], params["rotation"]),
        canvas.size,
        2.0 * canvas.font_size,
    )
    canvas.line(right, foot, top, right)
    mark = 0.12 * min(math.dist(right, foot), math.dist(right, top))
    along_a, along_b = _toward(right, foot, mark), _toward(right, top, mark)
    corner = (along_a[0] + along_b[0] - right[0], along_a[1] + along_b[1] - right[1])
    canvas.line(along_a, corner, along_b)
    for side, opposite, text in (
        ((right, foot), top, str(a)),
        ((right, top), foot, str(b)),
        ((foot, top), right, "x"),
    ):
        canvas.label(_beside(*side, opposite, 0.9 * canvas.font_size), text)


def _draw_line(canvas: _Canvas, params: Params) -> None:
    middle = canvas.size / 2
    margin = canvas.font_size
    canvas.line((margin, middle + canvas.size / 5), (canvas.size - margin, middle + canvas.size / 5))
    origin = (middle, middle + canvas.size / 5)
    ray = 0.42 * canvas.size
    start = 0
    for index, angle in enumerate(params["angles"]):
        end = start + angle
        if end < 180:
            theta = math.radians(end)
            canvas.line(origin, (origin[0] + ray * math.cos(theta), origin[1] - ray * math.sin(theta)))
        bisector = math.radians(start + angle / 2)
        reach = canvas.font_size * 0.9 / math.sin(math.radians(angle) / 2)
        reach = min(max(reach, 1.6 * canvas.font_size), 0.3 * canvas.size)
        text = "x°" if index == params["unknown"] else f"{angle}°"
        canvas.label((origin[0] + reach * math.cos(bisector), origin[1] - reach * math.sin(bisector)), text)
        start = end


KINDS: dict[str, tuple[Callable[[np.random.Generator], Params], Callable[[_Canvas, Params], None]]] = {
    "triangle": (_sample_triangle, _draw_triangle),
    "circle": (_sample_circle, _draw_circle),
    "right_triangle": (_sample_right_triangle, _draw_right_triangle),
    "line": (_sample_line, _draw_line),
}


def render(params: Params, size: int) -> Image.Image:
    """The figure that `params` describes, `size` pixels square."""
    canvas = _Canvas(size)
    KINDS[params["kind"]][1](canvas, params)
    return canvas.image


# ---- writing a dataset -----------------------------------------------------------------------------


def _sample_unseen(rng: np.random.Generator, kind: str, taken: set[str], split: str) -> Params:
    sample = KINDS[kind][0]
    for _ in range(_MAX_REDRAWS):
        params = sample(rng)
        if _key(params) not in taken:
            return params
    raise RuntimeError(
        f"could not draw a {split} {kind} figure unseen in earlier splits after {_MAX_REDRAWS} tries; "
        "use fewer samples"
    )


def _write_split(
    out_dir: Path, split: str, n: int, seed: int, size: int, image_format: str, taken: set[str]
) -> tuple[list[str], list[str]]:
    """One split's images and jsonl, kinds balanced; returns the figures' keys and kinds."""
    rng = _split_rng(seed, split)
    names = list(KINDS)
    kinds = [names[i] for i in rng.permutation([i % len(names) for i in range(n)])]
    pil_format, ext = _FORMATS[image_format]
    keys: list[str] = []
    rows: list[dict[str, Any]] = []
    for index, kind in enumerate(kinds):
        params = _sample_unseen(rng, kind, taken, split)
        keys.append(_key(params))
        rel = f"images/{split}_{index:06d}.{ext}"
        render(params, size).save(out_dir / rel, format=pil_format, **SAVE_OPTIONS[pil_format])
        record = {
            "id": f"{split}-{index:06d}",
            "problem": _question(params),
            "answer": _answer(params),
            "images": [rel],
            "task": "geometry",
            "kind": kind,
            "params": params,
        }
        rows.append(record)
    write_rows(out_dir / f"{split}.jsonl", rows)
    return keys, kinds


def generate_geometry(
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 64,
    seed: int = 0,
    image_size: int = DEFAULT_IMAGE_SIZE,
    image_format: str = "png",
) -> dict[str, Any]:
    """Write train/val geometry problems as ``mmrl.data.synthetic.generate`` writes its tasks; return the meta.

    Files: ``images/<split>_<index:06d>.<ext>``, ``train.jsonl``, ``val.jsonl``, ``meta.json``. Kinds are
    balanced per split and no val figure repeats a train figure.
    """
    check_request(image_size, image_format, n_train, n_val)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    seen, train_kinds = _write_split(out, "train", n_train, seed, image_size, image_format, set())
    _, val_kinds = _write_split(out, "val", n_val, seed, image_size, image_format, set(seen))
    meta: dict[str, Any] = {
        "task": "geometry",
        "seed": seed,
        "image_size": image_size,
        "image_format": image_format,
        "n_train": n_train,
        "n_val": n_val,
        "kinds": {"train": dict(Counter(train_kinds)), "val": dict(Counter(val_kinds))},
    }
    write_meta(out, meta)
    return meta
