"""Data preparation: the example converters read tiny files in the public Geometry3K and RefCOCO layouts
and write data the loader accepts; the synthetic geometry generator's answers are exact."""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmrl.cli import main as mmrl_main
from mmrl.config import DataConfig
from mmrl.data.dataset import PromptDataset, PromptInputs, read_rows
from mmrl.data.synthetic_geometry import KINDS, generate_geometry, render, sqrt_text, times_pi
from mmrl.models import load_processor
from mmrl.processors import PixelBudget
from mmrl.rewards.grounding import grounding_iou
from mmrl.rewards.types import RewardInput

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "data"
BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=112 * 112)


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"prep_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_processor(tiny_model_dir)


def _samples(spec: str, processor: Any) -> tuple[list[Any], PromptDataset]:
    inputs = PromptInputs(processor.tokenizer, processor.image_processor, BUDGET)
    dataset = PromptDataset(read_rows([spec]), DataConfig(max_prompt_length=512), inputs)
    return dataset.prepare_all(), dataset


@pytest.mark.parametrize("name", ["geometry3k", "refcoco"])
def test_scripts_have_help(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / f"{name}.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "usage:" in done.stdout and "parquet" in done.stdout


def _geometry3k_release(root: Path) -> Path:
    """The Inter-GPS release layout: <split>/<id>/data.json + img_diagram.png."""
    problems = {
        "train": [
            (2, "Find x.", ["3", "6", "9", "12"], "B"),
            (10, "Find the area of the circle.", ["25\\pi", "10\\pi", "5\\pi", "50\\pi"], "A"),
            (11, "Find y.", ["1", "2"], "E"),  # a letter with no choice: left out, counted
        ],
        "test": [(2401, "Find AB.", ["2\\sqrt{13}", "7", "8", "9"], "A")],
    }
    for split, items in problems.items():
        for pid, text, choices, answer in items:
            folder = root / split / str(pid)
            folder.mkdir(parents=True)
            record = {"id": pid, "problem_text": text, "choices": choices, "answer": answer}
            (folder / "data.json").write_text(json.dumps(record))
            Image.new("RGB", (90, 60), (pid % 255, 0, 0)).save(folder / "img_diagram.png")
    (root / "train" / "12").mkdir()  # a problem folder without files
    return root


def test_geometry3k_release_to_easyr1_parquet(tmp_path: Path, processor: Any, capsys) -> None:
    release = _geometry3k_release(tmp_path / "geometry3k")
    out = tmp_path / "out"
    assert _script("geometry3k").main([str(release), str(out)]) == 0
    report = capsys.readouterr().out
    assert "'rows': 2" in report and "answer is not one of the choice letters" in report

    samples, dataset = _samples(f"{out}@train", processor)
    assert dataset.format == "easyr1" and not dataset.skipped
    assert [s.ground_truth for s in samples] == ["6", "25\\pi"]  # id order: 2 before 10
    assert [s.prompt_text for s in samples] == ["<image>Find x.", "<image>Find the area of the circle."]
    assert samples[0].extra == {"choices": ["3", "6", "9", "12"], "answer_letter": "B", "id": "2"}
    assert samples[0].image_sizes[0].original == (90, 60)
    (test,), _ = _samples(f"{out}@test", processor)
    assert test.ground_truth == "2\\sqrt{13}"


def test_geometry3k_choices_in_prompt_and_bad_root(tmp_path: Path, capsys) -> None:
    release = _geometry3k_release(tmp_path / "geometry3k")
    module = _script("geometry3k")
    module.convert(release, tmp_path / "out", choices_in_prompt=True)
    (row, _), _ = read_rows([f"{tmp_path / 'out'}@train"])
    assert row["problem"] == "<image>Find x.\nChoices: (A) 3 (B) 6 (C) 9 (D) 12"
    assert row["images"][0]["path"] is None and row["images"][0]["bytes"].startswith(b"\x89PNG")
    assert module.main([str(tmp_path), str(tmp_path / "out2")]) == 2
    assert "train/, val/ and test/" in capsys.readouterr().err


def _refcoco_release(root: Path, refs_format: str) -> tuple[Path, Path, Path]:
    images = root / "train2014"
    images.mkdir(parents=True)
    coco_images = [
        {"id": 1, "file_name": "COCO_train2014_000000000001.jpg", "width": 200, "height": 100},
        {"id": 2, "file_name": "COCO_train2014_000000000002.jpg", "width": 120, "height": 160},
        {"id": 3, "file_name": "COCO_train2014_000000000003.jpg", "width": 50, "height": 50},  # not on disk
    ]
    for image in coco_images[:2]:
        Image.new("RGB", (image["width"], image["height"]), (0, 90, 0)).save(images / image["file_name"])
    instances = {
        "images": coco_images,
        "annotations": [
            {"id": 11, "image_id": 1, "bbox": [103.93, 20.0, 50.22, 40.5], "category_id": 1},
            {"id": 12, "image_id": 2, "bbox": [0, 10, 60, 80], "category_id": 3},
            {"id": 13, "image_id": 3, "bbox": [1, 1, 10, 10], "category_id": 3},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}],
    }
    refs = [
        {
            "ref_id": 0,
            "ann_id": 11,
            "image_id": 1,
            "split": "train",
            "file_name": "COCO_train2014_000000000001_11.jpg",
            "sentences": [
                {"sent": "man on the right", "sent_id": 100},
                {"sent": "right guy", "sent_id": 101},
            ],
        },
        {
            "ref_id": 1,
            "ann_id": 12,
            "image_id": 2,
            "split": "testA",
            "sentences": [{"sent": "red car", "sent_id": 102}],
        },
        {
            "ref_id": 2,
            "ann_id": 13,
            "image_id": 3,
            "split": "train",
            "sentences": [{"sent": "gone", "sent_id": 103}],
        },
    ]
    (root / "instances.json").write_text(json.dumps(instances))
    refs_path = root / ("refs(unc).p" if refs_format == "pickle" else "refs.json")
    if refs_format == "pickle":
        refs_path.write_bytes(pickle.dumps(refs, protocol=2))
    else:
        refs_path.write_text(json.dumps(refs))
    return root / "instances.json", refs_path, images


@pytest.mark.parametrize("refs_format", ["pickle", "json"])
def test_refcoco_to_grounding_rows(tmp_path: Path, processor: Any, capsys, refs_format: str) -> None:
    instances, refs, images = _refcoco_release(tmp_path / "refcoco", refs_format)
    out = tmp_path / "out"
    argv = ["--instances", str(instances), "--refs", str(refs), "--images", str(images), "--out", str(out)]
    assert _script("refcoco").main(argv) == 0
    assert "'image missing': 1" in capsys.readouterr().out

    samples, dataset = _samples(f"{out}@train", processor)
    assert not dataset.skipped
    assert [s.prompt_text for s in samples] == [
        '<image>Locate "man on the right" and output its bbox_2d in JSON.',
        '<image>Locate "right guy" and output its bbox_2d in JSON.',
    ]
    assert samples[0].ground_truth == [103.93, 20.0, 154.15, 60.5]  # corners, original pixels
    assert samples[0].extra == {
        "ref_id": 0,
        "ann_id": 11,
        "image_id": 1,
        "sent_id": 100,
        "width": 200,
        "height": 100,
    }
    size = samples[0].image_sizes[0]
    assert size.original == (200, 100) and size.model_input != size.original
    # A model that answers the right box in the pixels it saw scores 1 under the default frames.
    fx, fy = size.model_input[0] / 200, size.model_input[1] / 100
    box = [103.93 * fx, 20.0 * fy, 154.15 * fx, 60.5 * fy]
    response = json.dumps([{"bbox_2d": box, "label": "man"}])
    sample = RewardInput(response=response, ground_truth=samples[0].ground_truth, image_sizes=[size])
    assert grounding_iou(sample) == pytest.approx(1.0)
    (car,), _ = _samples(f"{out}@testA", processor)
    assert car.ground_truth == [0.0, 10.0, 60.0, 90.0]


def test_refcoco_refuses_pickles_that_hold_objects(tmp_path: Path) -> None:
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps([OrderedDict(ref_id=0)]))
    with pytest.raises(pickle.UnpicklingError, match=r"collections\.OrderedDict"):
        _script("refcoco").load_refs(path)


def test_refcoco_missing_input_returns_2(tmp_path: Path, capsys) -> None:
    argv = [
        "--instances",
        str(tmp_path / "none.json"),
        "--refs",
        "x",
        "--images",
        "y",
        "--out",
        str(tmp_path / "o"),
    ]
    assert _script("refcoco").main(argv) == 2
    assert "--instances" in capsys.readouterr().err


def test_exact_answer_strings() -> None:
    assert [sqrt_text(n) for n in (25, 52, 2, 72, 1, 200)] == [
        "5",
        "2\\sqrt{13}",
        "\\sqrt{2}",
        "6\\sqrt{2}",
        "1",
        "10\\sqrt{2}",
    ]
    assert [times_pi(k) for k in (1, 2, 25)] == ["\\pi", "2\\pi", "25\\pi"]


def _surd(text: str) -> tuple[int, int]:
    """`k\\sqrt{m}` as (k, m); a plain integer k as (k, 1)."""
    outside, inside = re.fullmatch(r"(\d*)(?:\\sqrt\{(\d+)\})?", text).groups()
    return int(outside or 1), int(inside or 1)


def _check_answer(record: dict[str, Any]) -> None:
    """The answer follows from the figure's params, by a route other than the generator's."""
    p, answer = record["params"], record["answer"]
    if p["kind"] == "triangle":
        assert sum(p["angles"]) + int(answer) == 180 and all(
            30 <= a <= 110 for a in [*p["angles"], int(answer)]
        )
    elif p["kind"] == "line":
        assert sum(p["angles"]) == 180 and int(answer) == p["angles"][p["unknown"]] >= 20
    elif p["kind"] == "circle":
        k = int(answer.removesuffix("\\pi") or 1)
        assert k == (p["radius"] ** 2 if p["ask"] == "area" else 2 * p["radius"])
        assert p["ask"] in record["problem"]
    else:
        a, b = p["legs"]
        outside, inside = _surd(answer)
        assert outside * outside * inside == a * a + b * b
        assert all(inside % (f * f) for f in range(2, math.isqrt(inside) + 1))  # simplified: m square-free


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_geometry_answers_are_exact(tmp_path: Path, seed: int) -> None:
    meta = generate_geometry(tmp_path, n_train=24, n_val=8, seed=seed, image_size=112)
    assert meta["kinds"] == {"train": dict.fromkeys(KINDS, 6), "val": dict.fromkeys(KINDS, 2)}
    records = [
        json.loads(line) for split in ("train", "val") for line in (tmp_path / f"{split}.jsonl").open()
    ]
    assert {r["kind"] for r in records} == set(KINDS)
    for record in records:
        _check_answer(record)
        with Image.open(tmp_path / record["images"][0]) as image:
            assert image.size == (112, 112)
    train_keys = {json.dumps(r["params"], sort_keys=True) for r in records if r["id"].startswith("train")}
    assert not train_keys & {
        json.dumps(r["params"], sort_keys=True) for r in records if r["id"].startswith("val")
    }


def test_synthetic_geometry_is_seeded_and_drawn(tmp_path: Path) -> None:
    for name, seed in (("a", 4), ("b", 4), ("c", 5)):
        generate_geometry(tmp_path / name, n_train=8, n_val=4, seed=seed, image_size=112)
    a, b, c = ((tmp_path / n / "train.jsonl").read_text() for n in "abc")
    assert a == b != c
    assert (tmp_path / "a" / "images" / "val_000003.png").read_bytes() == (
        tmp_path / "b" / "images" / "val_000003.png"
    ).read_bytes()
    params = json.loads(a.splitlines()[0])["params"]
    dark = int((np.asarray(render(params, 112).convert("L")) < 128).sum())
    assert dark > 100  # lines and labels are drawn


def test_cli_synth_geometry_loads_as_easyr1(tmp_path: Path, processor: Any, capsys) -> None:
    out = tmp_path / "geo"
    assert mmrl_main(["data", "synth", str(out), "--task", "geometry", "--n-train", "4", "--n-val", "4"]) == 0
    assert "4 train / 4 val rows of task 'geometry'" in " ".join(capsys.readouterr().out.split())
    samples, dataset = _samples(f"{out}@val", processor)
    assert len(samples) == 4 and not dataset.skipped
    assert all(s.image_sizes[0].original == (224, 224) for s in samples)
    assert {s.extra["kind"] for s in samples} == set(KINDS)
    with pytest.raises(SystemExit):
        mmrl_main(["data", "synth", str(tmp_path / "x"), "--task", "hexagons"])
