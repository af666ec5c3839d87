"""Tests for the grounding graders: box parsing, frame mapping across resizes, IoU, matching and points."""

from __future__ import annotations

import re

import pytest

from mmrl.processors.image import PixelBudget, smart_size
from mmrl.rewards import GRADERS, ImageSize, RewardInput, RewardManager
from mmrl.rewards.boxes import Box, iou, match_ious, parse_ground_truth, parse_response
from mmrl.rewards.grounding import (
    format_json_box,
    grounding_iou,
    grounding_iou_threshold,
    grounding_multi,
    grounding_point,
)

GROUNDING = [
    "grounding_iou",
    "grounding_iou_threshold",
    "grounding_multi",
    "grounding_point",
    "format_json_box",
]


def _model_input(original: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) the repo's default pixel budget resizes an image of `original` size to."""
    height, width = smart_size(original[1], original[0], PixelBudget())
    return width, height


def _sample(
    response: str, truth: object = (0, 0, 10, 10), original: tuple[int, int] | None = (640, 480)
) -> RewardInput:
    sizes = [] if original is None else [ImageSize(original, _model_input(original))]
    return RewardInput(response=response, ground_truth=truth, image_sizes=sizes)


def _json(*boxes: tuple[float, ...]) -> str:
    return "[" + ", ".join(f'{{"bbox_2d": {list(box)}, "label": "obj"}}' for box in boxes) + "]"


def _corners(boxes: list[Box]) -> list[tuple[float, float, float, float]]:
    return [(b.x1, b.y1, b.x2, b.y2) for b in boxes]


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("response", "expected", "frame"),
    [
        ('[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}]', [(10, 20, 30, 40)], "model_input"),
        ('{"bbox_2d": [10.5, 20, 30, 40.25]}', [(10.5, 20, 30, 40.25)], "model_input"),
        (
            'Sure!\n```json\n[\n  {"bbox_2d": [1, 2, 3, 4], "label": "a"},\n  {"bbox_2d": [5, 6, 7, 8]}\n]\n```\nDone.',
            [(1, 2, 3, 4), (5, 6, 7, 8)],
            "model_input",
        ),
        ('[{"point_2d": [12, 34], "label": "dog"}]', [(12, 34, 12, 34)], "model_input"),
        ('{"objects": [{"bbox_2d": [1, 2, 3, 4]}]}', [(1, 2, 3, 4)], "model_input"),
        ('{"label": "cat", "bbox_2d": [1, 2, 3, 4]}', [(1, 2, 3, 4)], "model_input"),
        ('{"id": 7, "bbox_2d": [1, 2, 3, 4]}', [(1, 2, 3, 4)], "model_input"),  # via the plain-list fallback
        (
            "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>",
            [(100, 200, 300, 400)],
            "norm1000",
        ),
        (
            "<|box_start|>( 1 , 2 ),( 3 , 4 )<|box_end|> and <|box_start|>(5,6),(7,8)<|box_end|>",
            [(1, 2, 3, 4), (5, 6, 7, 8)],
            "norm1000",
        ),
        ("The box is [10, 20, 30, 40].", [(10, 20, 30, 40)], "model_input"),
        (
            "[[0.1, 0.2, 0.5, 0.6], [-1.5, .5, 2e1, 30]]",
            [(0.1, 0.2, 0.5, 0.6), (-1.5, 0.5, 20, 30)],
            "model_input",
        ),
        ("<think>maybe [0, 0, 5, 5]</think>It is [10, 20, 30, 40]", [(10, 20, 30, 40)], "model_input"),
        ("<think>[0, 0, 5, 5]</think><answer>[1, 2, 3, 4]</answer>", [(1, 2, 3, 4)], "model_input"),
        # Broken JSON: the complete item before the truncation still counts.
        ('[{"bbox_2d": [1, 2, 3, 4], "label": "a"}, {"bbox_2d": [5, 6', [(1, 2, 3, 4)], "model_input"),
        # A reversed box is dropped, the valid one after it is kept.
        ('[{"bbox_2d": [30, 40, 10, 20]}, {"bbox_2d": [1, 2, 3, 4]}]', [(1, 2, 3, 4)], "model_input"),
    ],
)
def test_parse_response_formats(response: str, expected: list, frame: str) -> None:
    boxes, got_frame = parse_response(response, "model_input")
    assert _corners(boxes) == expected
    assert got_frame == frame


def test_labels_are_read_from_json_and_box_tokens() -> None:
    boxes, _ = parse_response('[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}, {"point_2d": [5, 6]}]', "norm1")
    assert [b.label for b in boxes] == ["cat", None]
    tokens = "<|object_ref_start|> a dog <|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
    assert parse_response(tokens, "original")[0][0].label == "a dog"


MALFORMED = [
    "",
    "There is no cat in this image.",
    '[{"bbox_2d": [10, 20, 30], "label": "cat"}]',
    '[{"bbox_2d": [NaN, 20, 30, 40]}]',
    '[{"bbox_2d": [10, 20, Infinity, 40]}]',
    "[1e999, 0, 10, 10]",
    '{"bbox_2d": [30, 40, 10, 20]}',
    "[300, 200, 50, 40]",
    '[{"bbox_2d": [10, 20, 30, 40',
    '{"bbox_2d": "10, 20, 30, 40"}',
    '{"bbox_2d": [true, 0, 1, 1]}',
    '{"bbox_2d": [' + "1" * 401 + ", 0, 1, 1]}",
    '{"bbox_2d": [' + "1" * 5000 + ", 0, 1, 1]}",
    '{"bbox_2d": {"x1": 1}}',
    '{"point_2d": [1, 2, 3]}',
    "[" * 5000,
    '{"a": ' * 3000,
    '{"label": "cat", "bbox_2d": [1, 2, ' * 3000,  # a degenerate, never-closed repetition
    "<|box_start|>(100,100),(50,50)<|box_end|>",
    "<|box_start|>(100,100)<|box_end|>",
    "<think>[0, 0, 640, 480]</think>I cannot tell.",
]


@pytest.mark.parametrize("response", MALFORMED)
def test_malformed_responses_score_zero_without_raising(response: str) -> None:
    assert parse_response(response, "model_input")[0] == []
    sample = _sample(response, truth=[0, 0, 640, 480])
    for name in GROUNDING:
        score = GRADERS[name](sample)
        assert (score["overall"] if isinstance(score, dict) else score) == 0.0, name


# ---------------------------------------------------------------- ground truth and frames


@pytest.mark.parametrize(
    ("truth", "expected"),
    [
        ([1, 2, 3, 4], [(1, 2, 3, 4)]),
        ((1.5, 2, 3, 4), [(1.5, 2, 3, 4)]),
        ([[1, 2, 3, 4], [5, 6, 7, 8]], [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ({"bbox": [1, 2, 3, 4]}, [(1, 2, 3, 4)]),
        ({"bbox_2d": [1, 2, 3, 4], "label": "cat"}, [(1, 2, 3, 4)]),
        ([{"bbox_2d": [1, 2, 3, 4]}, {"bbox": [5, 6, 7, 8]}], [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ("[[1, 2, 3, 4], [5, 6, 7, 8]]", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ('{"bbox": [1, 2, 3, 4]}', [(1, 2, 3, 4)]),
    ],
)
def test_ground_truth_forms(truth: object, expected: list) -> None:
    assert _corners(parse_ground_truth(truth)) == expected


@pytest.mark.parametrize(
    ("truth", "message"),
    [
        (None, "holds no boxes"),
        ([], "holds no boxes"),
        ("not json", "not JSON"),
        ([1, 2, 3], "box [1, 2, 3] is not [x1, y1, x2, y2]"),
        ([100, 100, 20, 30], "[x, y, width, height]"),
        ([[1, 2, 3, 4], [1, 2, float("nan"), 4]], "finite"),
    ],
)
def test_bad_ground_truth_is_a_data_error(truth: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        grounding_iou(_sample("[1, 2, 3, 4]", truth=truth))


@pytest.mark.parametrize("original", [(640, 480), (1920, 1080), (300, 900), (1000, 1000), (4000, 3000)])
def test_model_input_answers_map_back_across_resizes(original: tuple[int, int]) -> None:
    width, height = original
    truth = [round(0.2 * width), round(0.3 * height), round(0.6 * width), round(0.7 * height)]
    in_w, in_h = _model_input(original)
    answer = [round(v * s) for v, s in zip(truth, (in_w / width, in_h / height) * 2, strict=True)]
    sample = _sample(_json(tuple(answer)), truth=truth, original=original)
    assert grounding_iou(sample) > 0.95
    assert grounding_iou_threshold(sample, threshold=0.95) == 1.0
    assert grounding_multi(sample)["overall"] > 0.95
    assert grounding_point(sample) == 1.0


def test_forgetting_the_resize_mapping_is_caught() -> None:
    """A 1920x1080 image reaches the model as 1176x672: an answer in those pixels read as original pixels
    lands far from the object."""
    truth = [1500, 700, 1800, 1000]
    answer = (919, 436, 1102, 622)  # truth scaled by 1176/1920 and 672/1080, as Qwen2.5-VL answers
    sample = _sample(_json(answer), truth=truth, original=(1920, 1080))
    assert sample.image_sizes[0].model_input == (1176, 672)
    assert grounding_iou(sample) > 0.95
    assert grounding_iou(sample, response_frame="original") < 0.3
    assert grounding_point(sample, response_frame="original") == 0.0


def test_normalised_frames() -> None:
    truth = [64, 48, 320, 240]  # in a 640x480 original: 10%..50% of each side
    tokens = "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,100),(500,500)<|box_end|>"
    assert grounding_iou(_sample(tokens, truth=truth)) == pytest.approx(1.0)
    per_mille = _sample("[100, 100, 500, 500]", truth=truth)
    assert grounding_iou(per_mille, response_frame="norm1000") == pytest.approx(1.0)
    fraction = _sample("[0.1, 0.1, 0.5, 0.5]", truth=truth)
    assert grounding_iou(fraction, response_frame="norm1") == pytest.approx(1.0)
    # Two normalised frames map into each other without image sizes.
    no_sizes = _sample("[0.1, 0.1, 0.5, 0.5]", truth=[100, 100, 500, 500], original=None)
    assert grounding_iou(no_sizes, response_frame="norm1", gt_frame="norm1000") == pytest.approx(1.0)


def test_missing_image_sizes_is_a_configuration_error_whatever_the_response() -> None:
    for response in ("[1, 2, 3, 4]", "garbage"):
        with pytest.raises(ValueError, match=r"image_sizes"):
            grounding_iou(_sample(response, original=None))
    with pytest.raises(ValueError, match=r"image_sizes"):
        grounding_iou(_sample("[1, 2, 3, 4]"), image_index=1)
    # Box tokens are 0-1000 whatever response_frame says, so they need sizes even when the frames agree.
    tokens = _sample("<|box_start|>(1,2),(3,4)<|box_end|>", original=None)
    with pytest.raises(ValueError, match=r"image_sizes"):
        grounding_iou(tokens, response_frame="original")
    # The same frame on both sides needs no sizes.
    assert grounding_iou(_sample("[0, 0, 10, 10]", original=None), response_frame="original") == 1.0


@pytest.mark.parametrize("kwargs", [{"response_frame": "pixels"}, {"gt_frame": "norm100"}])
def test_unknown_frame_is_refused(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="unknown coordinate frame"):
        grounding_iou(_sample("[0, 0, 10, 10]"), **kwargs)


# ---------------------------------------------------------------- IoU


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 0, 10, 10), (0, 0, 10, 10), 1.0),
        ((0, 0, 10, 10), (5, 5, 15, 15), 25 / 175),
        ((0, 0, 10, 10), (0, 0, 10, 5), 0.5),
        ((0, 0, 10, 10), (2, 2, 4, 4), 4 / 100),
        ((0, 0, 4, 2), (1, -1, 3, 5), 4 / 16),  # a cross: 2x2 overlap of 8 + 12 area
        ((0, 0, 10, 10), (20, 20, 30, 30), 0.0),  # disjoint
        ((0, 0, 10, 10), (10, 0, 20, 10), 0.0),  # sharing an edge
        ((0, 0, 10, 10), (5, 0, 5, 10), 0.0),  # zero width
        ((3, 3, 3, 3), (3, 3, 3, 3), 0.0),  # two identical points: no area, no overlap to measure
    ],
)
def test_iou_against_hand_computed_values(a: tuple, b: tuple, expected: float) -> None:
    assert iou(Box(*a), Box(*b)) == pytest.approx(expected)
    assert iou(Box(*b), Box(*a)) == pytest.approx(expected)


def test_grounding_iou_scores_the_first_box_against_the_first_truth() -> None:
    truth = [[0, 0, 10, 10], [5, 5, 15, 15]]
    sample = _sample(_json((5, 5, 15, 15), (0, 0, 10, 10)), truth=truth, original=None)
    assert grounding_iou(sample, response_frame="original") == pytest.approx(25 / 175)


def test_iou_threshold() -> None:
    half = _sample("[0, 0, 10, 5]", original=None)
    assert grounding_iou_threshold(half, response_frame="original") == 1.0  # IoU exactly 0.5
    assert grounding_iou_threshold(half, threshold=0.51, response_frame="original") == 0.0
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="threshold"):
            grounding_iou_threshold(half, threshold=bad, response_frame="original")


# ---------------------------------------------------------------- several objects


def _multi(response: str, truth: object, **kwargs: object) -> dict[str, float]:
    return grounding_multi(_sample(response, truth=truth, original=None), response_frame="original", **kwargs)


def test_hungarian_beats_greedy_matching() -> None:
    """Two overlapping objects. Greedy takes the best pair first (P1-T1, 0.625) and leaves P2 with T2
    (1/15); the optimal pairing P1-T2 (0.56) + P2-T1 (0.6) is better."""
    t1, t2 = (0, 0, 10, 10), (5, 0, 15, 10)
    p1, p2 = (2.5, 0, 12, 10), (0, 0, 6, 10)
    pairs = {(p1, t1): 0.625, (p1, t2): 0.56, (p2, t1): 0.6, (p2, t2): 1 / 15}
    for (p, t), value in pairs.items():
        assert iou(Box(*p), Box(*t)) == pytest.approx(value)
    greedy = (0.625 + 1 / 15) / 2
    result = _multi(_json(p1, p2), [t1, t2])
    assert result["overall"] == pytest.approx((0.56 + 0.6) / 2)
    assert result["overall"] > greedy + 0.2


def test_extra_boxes_are_penalised_and_missing_boxes_lower_the_mean() -> None:
    truth = [[0, 0, 10, 10], [20, 20, 30, 30]]
    exact = [(0, 0, 10, 10), (20, 20, 30, 30)]
    assert _multi(_json(*exact), truth) == {"overall": 1.0, "mean_iou": 1.0, "num_pred": 2.0, "num_gt": 2.0}
    one_extra = _json(*exact, (50, 50, 60, 60))
    assert _multi(one_extra, truth)["overall"] == pytest.approx(0.9)
    assert _multi(one_extra, truth, extra_box_penalty=0.25)["overall"] == pytest.approx(0.75)
    spam = _multi(_json(*exact, *[(50, 50, 60, 60)] * 20), truth)
    assert spam["overall"] == 0.0 and spam["mean_iou"] == 1.0 and spam["num_pred"] == 22.0
    assert _multi(_json(exact[1]), truth)["overall"] == pytest.approx(0.5)
    assert _multi("nothing", truth)["overall"] == 0.0
    with pytest.raises(ValueError, match="extra_box_penalty"):
        _multi(_json(*exact), truth, extra_box_penalty=-0.1)


def test_label_aware_matching() -> None:
    truth = [{"bbox": [0, 0, 10, 10], "label": "cat"}, {"bbox": [20, 0, 30, 10], "label": "dog"}]
    swapped = '[{"bbox_2d": [0, 0, 10, 10], "label": "Dog"}, {"bbox_2d": [20, 0, 30, 10], "label": "cat"}]'
    right = '[{"bbox_2d": [20, 0, 30, 10], "label": " DOG "}, {"bbox_2d": [0, 0, 10, 10], "label": "cat"}]'
    unlabelled = "[[0, 0, 10, 10], [20, 0, 30, 10]]"
    assert _multi(swapped, truth)["overall"] == 1.0
    assert _multi(swapped, truth, match_labels=True)["overall"] == 0.0
    assert _multi(right, truth, match_labels=True)["overall"] == 1.0
    assert _multi(unlabelled, truth, match_labels=True)["overall"] == 1.0


def test_match_ious_is_one_to_one() -> None:
    truth = [Box(0, 0, 10, 10)]
    assert match_ious([Box(0, 0, 10, 10), Box(0, 0, 10, 10)], truth) == [1.0]
    assert match_ious([], truth) == []


# ---------------------------------------------------------------- points and format


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ('[{"point_2d": [5, 5]}]', 1.0),
        ('[{"point_2d": [10, 0]}]', 1.0),  # on the edge
        ('[{"point_2d": [11, 5]}]', 0.0),
        ("[0, 0, 8, 8]", 1.0),  # centre (4, 4)
        ("[8, 8, 30, 30]", 0.0),  # overlaps, but its centre (19, 19) is outside
        ('[{"point_2d": [25, 25]}, {"point_2d": [5, 5]}]', 0.0),  # only the first counts
        ('[{"point_2d": [105, 5]}]', 1.0),  # inside the second object
    ],
)
def test_grounding_point(response: str, expected: float) -> None:
    sample = _sample(response, truth=[[0, 0, 10, 10], [100, 0, 110, 10]], original=None)
    assert grounding_point(sample, response_frame="original") == expected


def test_grounding_point_maps_frames() -> None:
    # (1000, 500) in the 1176x672 model input of a 1920x1080 image is (1632.7, 803.6) in the original.
    sample = _sample('{"point_2d": [1000, 500]}', truth=[1600, 780, 1660, 830], original=(1920, 1080))
    assert grounding_point(sample) == 1.0
    assert grounding_point(sample, response_frame="original") == 0.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ('[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]', 1.0),
        ('[{"bbox_2d": [1.5, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8], "label": "dog"}]', 1.0),
        ('```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]\n```', 1.0),
        ('<think>look left</think>\n[{"bbox_2d": [1, 2, 3, 4]}]', 1.0),
        ('<think>hm</think><answer>[{"bbox_2d": [1, 2, 3, 4]}]</answer>', 1.0),
        ('{"bbox_2d": [1, 2, 3, 4]}', 0.0),  # not a list
        ("[]", 0.0),
        ("[[1, 2, 3, 4]]", 0.0),
        ('[{"bbox_2d": [1, 2, 1, 4]}]', 0.0),  # no width
        ('[{"bbox_2d": [3, 4, 1, 2]}]', 0.0),
        ('[{"bbox_2d": [1, 2, 3, NaN]}]', 0.0),
        ('[{"bbox_2d": [1, 2, 3]}]', 0.0),
        ('[{"bbox_2d": [false, 0, true, 1]}]', 0.0),
        ('[{"point_2d": [1, 2]}]', 0.0),
        ('[{"bbox_2d": [1, 2, 3, 4]}, {"label": "cat"}]', 0.0),
        ('Here: [{"bbox_2d": [1, 2, 3, 4]}]', 0.0),
        ('[{"bbox_2d": [1, 2, 3, 4]}', 0.0),
    ],
)
def test_format_json_box(response: str, expected: float) -> None:
    assert format_json_box(RewardInput(response=response)) == expected


def test_graders_are_registered_and_log_extra_keys() -> None:
    assert GRADERS["grounding_iou"] is grounding_iou
    with RewardManager([{"name": name} for name in GROUNDING]) as manager:
        result = manager.score([_sample(_json((0, 0, 10, 10)), original=(644, 476))])
    assert result.components["grounding_multi/num_pred"] == [1.0]
    assert result.components["format_json_box"] == [1.0]
    assert result.overall == [pytest.approx(5.0)]
