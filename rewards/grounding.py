"""Grounding graders: score boxes and points a model gives for objects in an image against ground truth.

The model's coordinates and the ground truth's may be in different frames (see mmrl.rewards.boxes.FRAMES):
Qwen2.5-VL answers in pixels of the resized image it saw (`response_frame="model_input"`), datasets store
boxes in pixels of the original image (`gt_frame="original"`). Predictions are mapped into the ground-truth
frame with `sample.image_sizes[image_index]`; a sample without sizes when frames differ is a configuration
error and raises ValueError. A response without a parseable box scores 0 and never raises.
"""

from __future__ import annotations

import itertools
import json
import re

from mmrl.rewards.boxes import (
    Box,
    answer_region,
    check_frame,
    iou,
    make_box,
    match_ious,
    parse_ground_truth,
    parse_response,
    scale_factors,
)
from mmrl.rewards.graders import register_grader
from mmrl.rewards.types import ImageSize, RewardInput

_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _image_size(sample: RewardInput, image_index: int) -> ImageSize | None:
    return sample.image_sizes[image_index] if 0 <= image_index < len(sample.image_sizes) else None


def _boxes(
    sample: RewardInput, response_frame: str, gt_frame: str, image_index: int
) -> tuple[list[Box], list[Box]]:
    """Predicted and ground-truth boxes, both in the ground-truth frame. Configuration and ground-truth
    errors raise before the response is looked at, so they surface on every sample, not only on those
    with a parseable box."""
    check_frame(response_frame)
    check_frame(gt_frame)
    size = _image_size(sample, image_index)
    factors = scale_factors(response_frame, gt_frame, size)
    truth = parse_ground_truth(sample.ground_truth)
    pred, frame = parse_response(sample.response, response_frame)
    if frame != response_frame:  # box tokens carry their own frame
        factors = scale_factors(frame, gt_frame, size)
    return [box.scaled(*factors) for box in pred], truth


@register_grader("grounding_iou")
def grounding_iou(
    sample: RewardInput, response_frame: str = "model_input", gt_frame: str = "original", image_index: int = 0
) -> float:
    """IoU of the first predicted box with the first ground-truth box: a dense reward for single-object
    referring expressions."""
    pred, truth = _boxes(sample, response_frame, gt_frame, image_index)
    return iou(pred[0], truth[0]) if pred else 0.0


@register_grader("grounding_iou_threshold")
def grounding_iou_threshold(
    sample: RewardInput,
    threshold: float = 0.5,
    response_frame: str = "model_input",
    gt_frame: str = "original",
    image_index: int = 0,
) -> float:
    """1.0 if `grounding_iou` reaches `threshold`, else 0.0: the Acc@0.5 metric RefCOCO results report."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    return float(grounding_iou(sample, response_frame, gt_frame, image_index) >= threshold)


@register_grader("grounding_multi")
def grounding_multi(
    sample: RewardInput,
    extra_box_penalty: float = 0.1,
    match_labels: bool = False,
    response_frame: str = "model_input",
    gt_frame: str = "original",
    image_index: int = 0,
) -> dict[str, float]:
    """Several objects: predictions and ground truth are paired one-to-one to maximise total IoU, and the
    score is the matched IoU summed over ground-truth objects divided by their number (a missed object
    counts 0), minus `extra_box_penalty` per predicted box beyond the number of ground-truth boxes,
    floored at 0. Without the penalty, listing many boxes would cost nothing, as unmatched predictions
    lower no IoU; the default 0.1 makes a spare box cost what a loose fit (IoU 0.9) of a lone object does,
    and ten spare boxes zero the score. With `match_labels`, boxes whose labels differ (both labelled)
    cannot pair."""
    if extra_box_penalty < 0:
        raise ValueError(f"extra_box_penalty must be >= 0, got {extra_box_penalty}")
    pred, truth = _boxes(sample, response_frame, gt_frame, image_index)
    mean_iou = sum(match_ious(pred, truth, match_labels)) / len(truth)
    extra = max(len(pred) - len(truth), 0)
    return {
        "overall": max(mean_iou - extra_box_penalty * extra, 0.0),
        "mean_iou": mean_iou,
        "num_pred": float(len(pred)),
        "num_gt": float(len(truth)),
    }


@register_grader("grounding_point")
def grounding_point(
    sample: RewardInput, response_frame: str = "model_input", gt_frame: str = "original", image_index: int = 0
) -> float:
    """1.0 if the first predicted point (a "point_2d", or a box's centre) lies inside any ground-truth box,
    edges included: pointing at any one of the referred objects is a correct answer."""
    pred, truth = _boxes(sample, response_frame, gt_frame, image_index)
    if not pred:
        return 0.0
    x, y = pred[0].centre
    return float(any(box.contains(x, y) for box in truth))


def _is_json_box(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    box = make_box(item.get("bbox_2d"))
    return box is not None and box.x1 < box.x2 and box.y1 < box.y2


@register_grader("format_json_box")
def format_json_box(sample: RewardInput) -> float:
    """1.0 if the answer is exactly a non-empty Qwen2.5-VL JSON list of boxes (optionally in a ```json
    fence), each item with a "bbox_2d" of four finite numbers and positive width and height, else 0.0.
    Stricter than the parsers behind the IoU graders, which also accept text around the boxes."""
    text = answer_region(sample.response).strip()
    if fenced := _FENCE.fullmatch(text):
        text = fenced.group(1)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return 0.0
    return float(isinstance(value, list) and bool(value) and all(_is_json_box(item) for item in value))


_ZOOM_BOX = re.compile(r'"bbox_2d"\s*:\s*(\[[^\]]*\])')


@register_grader("zoom_hit")
def zoom_hit(sample: RewardInput, key: str = "target_box", min_fill: float = 0.25) -> float:
    """1.0 if one of the agent's `image_zoom` calls framed the target: its box holds the centre of the
    row's `extra[key]` ([x1, y1, x2, y2] in the coordinates the model saw) and the target fills at least
    `min_fill` of the box's area (0.25: the target spans half the zoom's width), so a box around the
    whole image, which holds every target but enlarges none, is no hit. Only a zoom that happened counts:
    its turn is answered by a tool turn that shows an image (a garbled call's box in the text is no hit).
    The rate of useful zooms of an agent run (`mmrl.agent`; the turns are in `extra["agent_turns"]`); with
    weight 0 it is only logged."""
    target = make_box(sample.extra.get(key))
    if target is None:
        raise ValueError(f"zoom_hit needs the row's target box in column {key!r} as [x1, y1, x2, y2]")
    cx, cy = (target.x1 + target.x2) / 2, (target.y1 + target.y2) / 2
    target_area = (target.x2 - target.x1) * (target.y2 - target.y1)
    turns = sample.extra.get("agent_turns", [])
    for turn, reply in itertools.pairwise(turns):
        if turn["role"] != "assistant" or reply["role"] == "assistant" or not reply["images"]:
            continue
        for found in _ZOOM_BOX.findall(turn["text"]):
            try:
                values = json.loads(found)
                xs, ys = sorted(values[0::2]), sorted(values[1::2])  # corners in either order, as image_zoom
                box = make_box([xs[0], ys[0], xs[-1], ys[-1]]) if len(values) == 4 else None
            except (ValueError, TypeError, KeyError, RecursionError):
                continue
            if box is None or not (box.x1 <= cx <= box.x2 and box.y1 <= cy <= box.y2):
                continue
            if target_area >= min_fill * (box.x2 - box.x1) * (box.y2 - box.y1):
                return 1.0
    return 0.0
