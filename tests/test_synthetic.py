"""Tests for the synthetic scene generator: labels must be true, splits disjoint, output reproducible."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmrl.data import synthetic
from mmrl.data.synthetic import BACKGROUND, COLOURS, NOISE, NUMBERS, TASKS, generate


def _records(out_dir: Path, split: str) -> list[dict[str, Any]]:
    lines = (out_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _files(out_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file()}


def _foreground(image: Image.Image) -> np.ndarray:
    """Pixels clearly off the noisy background: every palette colour differs by far more than NOISE."""
    diff = np.abs(np.asarray(image, dtype=np.int16) - np.array(BACKGROUND, dtype=np.int16))
    return diff.max(axis=2) > 5 * NOISE


def _components(mask: np.ndarray) -> int:
    """4-connected blobs by flood fill (scipy is not a dependency)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    blobs = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        blobs += 1
        seen[y, x] = True
        stack = [(y, x)]
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return blobs


def _nearest_colour(rgb: np.ndarray) -> str:
    return min(COLOURS, key=lambda name: float(np.linalg.norm(rgb - np.array(COLOURS[name]))))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = {}
    for task in TASKS:
        path = tmp_path_factory.mktemp(task)
        out[task] = (path, generate(path, task=task, n_train=120, n_val=30, seed=3))
    return out


def test_same_seed_same_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        generate(tmp_path / name, n_train=20, n_val=6, seed=seed)
    a, b, c = (_files(tmp_path / name) for name in "abc")
    assert len(a) == 20 + 6 + 3
    assert a == b
    assert a.keys() == c.keys()
    for name in ("train.jsonl", "val.jsonl", "images/train_000000.png", "images/val_000000.png"):
        assert a[name] != c[name], name


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_val_scenes_are_disjoint(datasets: dict, task: str) -> None:
    path, _ = datasets[task]
    keys = {
        split: [json.dumps(r["params"], sort_keys=True) for r in _records(path, split)]
        for split in ("train", "val")
    }
    assert all(keys["train"]) and len(keys["val"]) == 30
    assert not set(keys["train"]) & set(keys["val"])


def test_colliding_val_scenes_are_redrawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give val the very same stream as train: every val scene collides unless re-drawn."""
    monkeypatch.setattr(synthetic, "_split_rng", lambda seed, split: np.random.default_rng(seed))
    generate(tmp_path, n_train=40, n_val=40, seed=0)
    train, val = _records(tmp_path, "train"), _records(tmp_path, "val")
    assert [r["answer"] for r in train] == [r["answer"] for r in val]  # the streams really are shared
    train_keys = {json.dumps(r["params"], sort_keys=True) for r in train}
    assert not train_keys & {json.dumps(r["params"], sort_keys=True) for r in val}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_answers_balanced_and_in_answer_set(datasets: dict, task: str) -> None:
    path, meta = datasets[task]
    answers = TASKS[task].answers
    assert meta["answers"] == list(answers)
    for split in ("train", "val"):
        records = _records(path, split)
        counts = Counter(r["answer"] for r in records)
        assert set(counts) == set(answers)
        assert max(counts.values()) - min(counts.values()) <= 1
        assert meta["answer_histogram"][split] == {a: counts[a] for a in answers}
        assert all(r["choices"] == list(answers) for r in records)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_record_layout_and_meta(datasets: dict, task: str) -> None:
    path, meta = datasets[task]
    assert json.loads((path / "meta.json").read_text(encoding="utf-8")) == meta
    assert meta | {"answer_histogram": None} == {
        "task": task,
        "question": TASKS[task].question,
        "seed": 3,
        "image_size": 56,
        "image_format": "png",
        "n_train": 120,
        "n_val": 30,
        "answers": list(TASKS[task].answers),
        "answer_histogram": None,
    }
    for split, n in (("train", 120), ("val", 30)):
        records = _records(path, split)
        assert [r["id"] for r in records] == [f"{split}-{i:06d}" for i in range(n)]
        assert [r["images"] for r in records] == [[f"images/{split}_{i:06d}.png"] for i in range(n)]
        for r in records:
            assert r["problem"] == "<image>" + TASKS[task].question
            assert r["task"] == task
            assert (path / r["images"][0]).is_file()


@pytest.mark.parametrize("image_size", [28, 84])
def test_images_are_rgb_at_requested_size(tmp_path: Path, image_size: int) -> None:
    for task in TASKS:
        generate(tmp_path / task, task=task, n_train=12, n_val=4, image_size=image_size)
        for image_path in (tmp_path / task / "images").iterdir():
            with Image.open(image_path) as image:
                assert image.size == (image_size, image_size)
                assert image.mode == "RGB"


@pytest.mark.parametrize("task", ["color", "shape"])
def test_rendered_colour_is_the_labelled_colour(datasets: dict, task: str) -> None:
    path, _ = datasets[task]
    for r in _records(path, "train") + _records(path, "val"):
        with Image.open(path / r["images"][0]) as image:
            pixels = np.asarray(image)[_foreground(image)]
        assert len(pixels) > 0.05 * 56 * 56  # smallest shape: a triangle of side 20
        assert _nearest_colour(pixels.mean(axis=0)) == r["params"]["colour"]
        if task == "color":
            assert r["answer"] == r["params"]["colour"]


@pytest.mark.parametrize("task", ["color", "shape"])
def test_rendered_shape_is_the_labelled_shape(datasets: dict, task: str) -> None:
    """Fill ratio of the shape's bounding box: square 1, circle pi/4, triangle 1/2."""
    path, _ = datasets[task]
    expected = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}
    for r in _records(path, "train") + _records(path, "val"):
        with Image.open(path / r["images"][0]) as image:
            mask = _foreground(image)
        ys, xs = np.nonzero(mask)
        p = r["params"]
        assert (xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) == (
            p["x"],
            p["y"],
            p["size"],
            p["size"],
        )
        assert 0.35 * 56 <= p["size"] <= 0.70 * 56
        fill = mask.sum() / p["size"] ** 2
        assert min(expected, key=lambda s: abs(expected[s] - fill)) == p["shape"]
        if task == "shape":
            assert r["answer"] == p["shape"]


def test_count_task_has_that_many_circles(datasets: dict) -> None:
    path, _ = datasets["count"]
    for r in _records(path, "train") + _records(path, "val"):
        with Image.open(path / r["images"][0]) as image:
            blobs = _components(_foreground(image))
        assert blobs == NUMBERS.index(r["answer"]) + 1 == len(r["params"]["circles"])


def test_palette_is_well_separated() -> None:
    for a, b in itertools.combinations(COLOURS.values(), 2):
        assert math.dist(a, b) > 100
    for rgb in COLOURS.values():
        assert max(abs(c - g) for c, g in zip(rgb, BACKGROUND, strict=True)) > 10 * NOISE


def test_render_honours_answer_and_seed() -> None:
    task = TASKS["shape"]
    image, answer, params = task.render(np.random.default_rng(1), 56, answer="triangle")
    again = task.render(np.random.default_rng(1), 56, answer="triangle")
    assert answer == params["shape"] == "triangle"
    assert again[1:] == (answer, params)
    assert again[0].tobytes() == image.tobytes()
    assert task.render(np.random.default_rng(2), 28)[1] in task.answers
    with pytest.raises(ValueError, match="hexagon"):
        task.render(np.random.default_rng(1), 56, answer="hexagon")


@pytest.mark.parametrize("image_size", [0, -28, 27, 50, 57, 56.0])
def test_bad_image_size_is_rejected(tmp_path: Path, image_size: Any) -> None:
    with pytest.raises(ValueError, match=r"image_size must be a positive multiple of 28"):
        generate(tmp_path, image_size=image_size)
    assert not (tmp_path / "train.jsonl").exists()


def test_unknown_task_lists_known_tasks(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="hexagons") as err:
        generate(tmp_path, task="hexagons")
    assert all(name in str(err.value) for name in TASKS)


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"n_train": -1}, "n_train"), ({"image_format": "gif"}, "image_format")]
)
def test_bad_counts_and_formats_are_rejected(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        generate(tmp_path, **kwargs)


@pytest.mark.parametrize("places", [4, 2, 1])
def test_the_zoom_tasks_mark_is_grey_at_the_policys_budget_and_its_stripes_wide_in_its_boxs_zoom(
    places: int,
) -> None:
    """The zoom task's premise: without the tool every answer looks alike; zoomed onto the mark's place
    (`boxes`, what the warm-up draws from) the stripes are several pixels wide, in their pure colours."""
    from mmrl.agent import SeenImage, image_zoom
    from mmrl.data.synthetic_zoom import ANSWERS, MARK, PAIRS, boxes, draw
    from mmrl.processors import PixelBudget, fit_image

    budget = PixelBudget(112 * 112, 112 * 112)
    rng = np.random.default_rng(0)
    means = {}
    for answer in ANSWERS:
        seen = []
        for place in range(places):
            original, params = draw(rng, answer, place, places)
            view = np.asarray(fit_image(original, budget), dtype=float)
            x, y = params["x"] // 4, params["y"] // 4
            seen.append(view[y + 1 : y + MARK // 4 - 1, x + 1 : x + MARK // 4 - 1].reshape(-1, 3).mean(0))
            zoomed = fit_image(
                image_zoom(boxes(places)[place], [SeenImage(original, view.shape[1::-1])]), budget
            )
            pixels = np.asarray(zoomed, dtype=int)
            first = np.abs(pixels - PAIRS[answer][0]).max(axis=2) < 40
            second = np.abs(pixels - PAIRS[answer][1]).max(axis=2) < 40
            assert first.sum() > 400 and second.sum() > 400, (answer, place)  # both colours, nearly pure
            # wide stripes: a pure pixel's right neighbour is mostly of the same colour (never, 1 px wide)
            same = (first[:, :-1] & first[:, 1:]).sum() + (second[:, :-1] & second[:, 1:]).sum()
            assert same > 0.3 * (first[:, :-1].sum() + second[:, :-1].sum()), (answer, place)
        means[answer] = np.mean(seen, axis=0)
    spread = np.ptp(np.stack(list(means.values())), axis=0)
    assert (spread < 1.0).all(), means


def test_the_zoom_tasks_stripes_reach_the_zoomed_view_in_one_phase_whatever_the_jitter() -> None:
    """Where every jittered mark covers the crop, scenes of one answer zoom to the same pixels: the tower
    meets one pattern per colour pair (with a flipping phase the tiny model never learned to read it)."""
    from mmrl.agent import SeenImage, image_zoom
    from mmrl.data.synthetic_zoom import ANSWERS, JITTER, MARK, boxes, draw
    from mmrl.processors import PixelBudget, fit_image

    budget = PixelBudget(112 * 112, 112 * 112)
    rng = np.random.default_rng(0)
    box = boxes(1)[0]
    scale = 112 / ((box[2] - box[0]) * 4)  # the crop's pixels per original pixel
    # the columns and rows that every mark covers, in the zoomed view (a pixel's margin for resampling)
    lo, hi = round((2 * JITTER) * scale) + 2, round(MARK * scale) - 2
    for answer in ANSWERS:
        crops, xs = [], set()
        for _ in range(12):
            original, params = draw(rng, answer, 0, places=1)
            xs.add(params["x"])
            zoomed = fit_image(image_zoom(box, [SeenImage(original, (112, 112))]), budget)
            crops.append(np.asarray(zoomed, dtype=int)[lo:hi, lo:hi])
        assert len(xs) > 2, "the mark should move between scenes"
        assert all(np.abs(c - crops[0]).max() < 40 for c in crops), answer


def test_the_two_place_zoom_task_shows_its_mark_inside_one_patch_of_the_policys_view() -> None:
    """Two places sit on 14-px patch centres, so the mark darkens one patch the vision tower reads by tens
    of grey levels, where a mark on a patch corner (the quadrants' centres) spreads a dent of a few over four."""
    from mmrl.data.synthetic_zoom import draw
    from mmrl.processors import PixelBudget, fit_image

    budget = PixelBudget(112 * 112, 112 * 112)
    rng = np.random.default_rng(0)

    def darkest_patch_dent(places: int, place: int) -> float:
        original, _ = draw(rng, "red", place, places)
        view = np.asarray(fit_image(original, budget), dtype=float).mean(axis=2)
        patches = view.reshape(8, 14, 8, 14).mean(axis=(1, 3))
        return float(np.median(patches) - patches.min())

    assert all(darkest_patch_dent(2, place) > 30 for place in range(2))
    assert all(darkest_patch_dent(4, place) < 20 for place in range(4))
