"""Boxes for grounding rewards: reading them from responses and ground truth, moving them between the frames
they may be written in, and scoring overlap.

A box is [x1, y1, x2, y2] with (x1, y1) the top-left corner. A box whose corners are swapped (x2 < x1 or
y2 < y1) is rejected, not reordered: swapped corners are how an [x, y, w, h] box usually reads when taken
for corners, so reordering would silently score a misread box. Zero-area boxes are kept (they score IoU 0)
and a point is stored as a zero-area box, so points and boxes share the frame mapping.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from mmrl.rewards.types import ImageSize

# Coordinate frames. "model_input": pixels of the resized image the model saw (Qwen2.5-VL answers in these);
# "original": pixels of the stored image (what datasets such as RefCOCO annotate); "norm1000" and "norm1":
# fractions of the image's width and height times 1000 (Qwen2-VL box tokens, Qwen3-VL) or times 1.
FRAMES = ("original", "model_input", "norm1000", "norm1")
_NORMALISED_EXTENT = {"norm1000": 1000.0, "norm1": 1.0}

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_THINK_END = "</think>"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_TOKENS = re.compile(
    rf"(?:<\|object_ref_start\|>(?P<label>(?:(?!<\|).)*)<\|object_ref_end\|>\s*)?"
    rf"<\|box_start\|>\s*\(\s*(?P<x1>{_NUMBER})\s*,\s*(?P<y1>{_NUMBER})\s*\)\s*,"
    rf"\s*\(\s*(?P<x2>{_NUMBER})\s*,\s*(?P<y2>{_NUMBER})\s*\)\s*<\|box_end\|>",
    re.DOTALL,
)
_PLAIN_LIST = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")
# Decoding is only tried where an object opens with a key Qwen2.5-VL writes, and gives up after a few
# failures: each failed attempt may read to the end of the text, so degenerate output (a repeated, never
# closed prefix) would otherwise cost time quadratic in its length.
_JSON_OBJECT_START = re.compile(r'\{\s*"(?:bbox_2d|point_2d|label)"\s*:')
_MAX_FAILED_DECODES = 16
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Box:
    """An axis-aligned box with x1 <= x2 and y1 <= y2, and the label the model or dataset gave it."""

    x1: float
    y1: float
    x2: float
    y2: float
    label: str | None = None

    @property
    def area(self) -> float:
        return (self.x2 - self.x1) * (self.y2 - self.y1)

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x1 + self.x2) / 2, (self.y1 + self.y2) / 2

    def contains(self, x: float, y: float) -> bool:
        """Edges count as inside: a point on the boundary touches the object."""
        return self.x1 <= x <= self.x2 and self.y1 <= y <= self.y2

    def scaled(self, fx: float, fy: float) -> Box:
        return Box(self.x1 * fx, self.y1 * fy, self.x2 * fx, self.y2 * fy, self.label)


def _finite(value: object) -> float | None:
    """`value` as a finite float, or None; bools are not coordinates even though Python counts them as
    ints, and an int too large for a float is not a coordinate either."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def make_box(values: object, label: object = None) -> Box | None:
    """A Box from four coordinates, or None unless they are four finite numbers in corner order."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != 4:
        return None
    coords = [_finite(v) for v in values]
    if any(c is None for c in coords):
        return None
    x1, y1, x2, y2 = coords
    if x2 < x1 or y2 < y1:
        return None
    return Box(x1, y1, x2, y2, label if isinstance(label, str) else None)


def make_point(values: object, label: object = None) -> Box | None:
    """A point [x, y] as a zero-area Box, or None unless it is two finite numbers."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != 2:
        return None
    return make_box([values[0], values[1], values[0], values[1]], label)


def answer_region(text: str) -> str:
    """The part of a response that holds its answer: the last <answer> block, else what follows the
    reasoning. Boxes written while thinking are drafts, not answers."""
    if not isinstance(text, str):
        return ""
    if answers := _ANSWER_TAG.findall(text):
        return answers[-1]
    return text.rsplit(_THINK_END, 1)[-1]


def _json_box_objects(text: str) -> Iterator[dict[str, Any]]:
    """Each JSON object in `text` holding "bbox_2d" or "point_2d", in order. Objects are decoded one by one
    rather than as a whole list, so a truncated or broken item does not hide the complete ones before it.
    An object whose first key is another one is left to the plain-list fallback."""
    pos = failures = 0
    while failures < _MAX_FAILED_DECODES and (match := _JSON_OBJECT_START.search(text, pos)):
        try:
            value, end = _DECODER.raw_decode(text, match.start())
        except (ValueError, RecursionError):
            value = None
            failures += 1
        if isinstance(value, dict) and ("bbox_2d" in value or "point_2d" in value):
            yield value
            pos = end
        else:  # step inside: a complete box object may be nested in this one
            pos = match.start() + 1


def _json_boxes(text: str) -> list[Box]:
    boxes = []
    for item in _json_box_objects(text):
        label = item.get("label")
        box = make_box(item["bbox_2d"], label) if "bbox_2d" in item else make_point(item["point_2d"], label)
        if box is not None:
            boxes.append(box)
    return boxes


def _token_boxes(text: str) -> list[Box]:
    boxes = []
    for m in _BOX_TOKENS.finditer(text):
        label = m["label"].strip() if m["label"] is not None else None
        box = make_box([float(m[k]) for k in ("x1", "y1", "x2", "y2")], label)
        if box is not None:
            boxes.append(box)
    return boxes


def _plain_boxes(text: str) -> list[Box]:
    boxes = (make_box([float(v) for v in m.groups()]) for m in _PLAIN_LIST.finditer(text))
    return [box for box in boxes if box is not None]


def parse_response(text: str, frame: str) -> tuple[list[Box], str]:
    """Predicted boxes (points as zero-area boxes) in a response's answer, in order, and their frame.

    Formats are tried in turn and the first that yields a valid box wins: Qwen2-VL box tokens (always
    0-1000, whatever `frame` says), then Qwen2.5-VL JSON objects with "bbox_2d" or "point_2d", then plain
    [x1, y1, x2, y2] lists anywhere in the text; the last two are in `frame`. The plain-list fallback also
    recovers the boxes of broken JSON. Never raises: malformed output just yields no boxes.
    """
    region = answer_region(text)
    if boxes := _token_boxes(region):
        return boxes, "norm1000"
    return _json_boxes(region) or _plain_boxes(region), frame


def _truth_box(item: object) -> Box:
    coords, label = item, None
    if isinstance(item, dict):
        coords, label = item.get("bbox_2d", item.get("bbox")), item.get("label")
    box = make_box(coords, label)
    if box is None:
        raise ValueError(
            f"ground-truth box {item!r} is not [x1, y1, x2, y2] with finite numbers, x1 <= x2 and y1 <= y2; "
            "COCO-style [x, y, width, height] boxes must be converted to corners first"
        )
    return box


def _is_single(value: object) -> bool:
    """One box (a dict, or a flat list of coordinates) rather than a list of boxes."""
    if isinstance(value, dict):
        return True
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and not any(isinstance(v, (list, tuple, dict)) for v in value)
    )


def parse_ground_truth(value: object) -> list[Box]:
    """Ground-truth boxes: [x1, y1, x2, y2], a dict with "bbox_2d" or "bbox" (and optionally "label"), a
    list of either, or a JSON string of any of these. Bad ground truth is a data error, unlike a bad
    response, so it raises ValueError instead of scoring 0."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"ground truth {value!r} is a string but not JSON: {err}") from err
    items = [value] if _is_single(value) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(
            f"ground truth {value!r} holds no boxes; expected [x1, y1, x2, y2] or a list of boxes"
        )
    return [_truth_box(item) for item in items]


def check_frame(frame: str) -> None:
    if frame not in FRAMES:
        raise ValueError(f"unknown coordinate frame {frame!r}; use one of {', '.join(FRAMES)}")


def _extent(frame: str, size: ImageSize | None) -> tuple[float, float]:
    """The whole image's width and height in `frame`'s units."""
    if frame in _NORMALISED_EXTENT:
        return _NORMALISED_EXTENT[frame], _NORMALISED_EXTENT[frame]
    if size is None:
        raise ValueError(
            f"boxes in the {frame!r} frame can only be compared with another frame given the image's sizes: "
            "fill RewardInput.image_sizes[image_index] (original and model-input (width, height); mmrl's "
            "data pipeline does), or set response_frame and gt_frame to the same frame"
        )
    return size.original if frame == "original" else size.model_input


def scale_factors(src: str, dst: str, size: ImageSize | None) -> tuple[float, float]:
    """Multipliers taking x and y coordinates from frame `src` to frame `dst`. Every frame is a per-axis
    scaling of every other, so IoU and point-in-box are the same in any frame once both sides share one."""
    if src == dst:
        return 1.0, 1.0
    (sw, sh), (dw, dh) = _extent(src, size), _extent(dst, size)
    return dw / sw, dh / sh


def iou(a: Box, b: Box) -> float:
    """Intersection over union; 0.0 when the union has no area (two points), where overlap is undefined."""
    width = min(a.x2, b.x2) - max(a.x1, b.x1)
    height = min(a.y2, b.y2) - max(a.y1, b.y1)
    inter = max(width, 0.0) * max(height, 0.0)
    union = a.area + b.area - inter
    return inter / union if union > 0 else 0.0


def _same_label(a: Box, b: Box) -> bool:
    """Labels differ only when both boxes carry one and they differ beyond case and spacing."""
    if a.label is None or b.label is None:
        return True
    return " ".join(a.label.casefold().split()) == " ".join(b.label.casefold().split())


def match_ious(pred: list[Box], truth: list[Box], match_labels: bool = False) -> list[float]:
    """IoUs of the one-to-one pairing of predictions with ground truth that maximises their total
    (Hungarian). Greedy best-pair-first matching can lose total IoU when objects overlap. With
    `match_labels`, boxes whose labels differ cannot pair."""
    if not pred or not truth:
        return []
    table = np.array(
        [[iou(p, t) if not match_labels or _same_label(p, t) else 0.0 for t in truth] for p in pred]
    )
    from scipy.optimize import linear_sum_assignment  # scipy takes ~1 s to import: only when boxes are graded

    rows, cols = linear_sum_assignment(table, maximize=True)
    return table[rows, cols].tolist()
