"""A corpus of broken and awkward rows through a real training run: every row is either used correctly
or skipped under a counted reason, the run completes, and the skip counts are exactly the bad rows.

Decided per case (and documented in docs/reliability.md):
- used, converted: CMYK, palette (P), 16-bit grey (I;16, scaled to 8 bits, not clipped), LA images
  become RGB; an EXIF-rotated photo is turned upright; a 1x1 image is scaled up to the pixel budget;
  a 2000x20 strip (100:1) is resized within the budget.
- used as written: a prompt without `<image>` markers gets its image in front; answers that are lists
  (acceptable answers) or dicts (structured truths for custom rewards) reach rewards unchanged; valid
  UTF-8 beyond ASCII; a jsonl file that starts with a byte-order mark.
- skipped: truncated JPEG/PNG, zero-byte file, a missing file, a null image, a 20000x20 strip (1000:1,
  beyond the 200:1 Qwen2.5-VL accepts): `bad_image`. Missing/null/empty answer: `missing_answer`.
  Missing/null/non-text prompt: `missing_prompt`. A line that is not UTF-8, not JSON, or not a JSON
  object: `bad_row`. A prompt far over `data.max_prompt_length`: `prompt_too_long`. More `<image>`
  markers than images, or fewer (but some): `image_marker_mismatch`.

A recording reward writes down what each used row looked like to the reward (and so to the model).

Data that cannot be trained on at all (no usable row, an empty file, a validation set with no usable
row) stops `mmrl train` with one line and exit code 2, before anything is trained.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultkit import CONFIG, overrides, raw_records
from PIL import Image

from mmrl.cli import main
from mmrl.processors import PixelBudget, smart_size

BUDGET = PixelBudget(min_pixels=12544, max_pixels=12544)  # configs/quickstart.yaml: 112 x 112
RED, BLUE = (210, 0, 0), (0, 60, 230)
DROP = object()  # a column left out of a row
EXPECTED_SKIPS = {
    "bad_image": 6,
    "missing_answer": 3,
    "missing_prompt": 3,
    "bad_row": 3,
    "prompt_too_long": 1,
    "image_marker_mismatch": 2,
}

RECORDER = """
import json

def record(sample, **kwargs):
    with open({log!r}, "a") as fh:
        fh.write(json.dumps({{
            "id": sample.extra["id"],
            "prompt": sample.prompt,
            "truth": sample.ground_truth,
            "modes": [im.mode for im in sample.images],
            "original": [list(s.original) for s in sample.image_sizes],
            "model_input": [list(s.model_input) for s in sample.image_sizes],
            "top": [list(im.getpixel((im.width // 2, 2))) for im in sample.images],
            "bottom": [list(im.getpixel((im.width // 2, im.height - 3))) for im in sample.images],
            "left": [list(im.getpixel((2, im.height // 2))) for im in sample.images],
            "right": [list(im.getpixel((im.width - 3, im.height // 2))) for im in sample.images],
        }}) + "\\n")
    return 0.5
"""


def _images(folder: Path) -> None:
    """Every image the corpus names, good and broken."""
    folder.mkdir(parents=True)
    Image.new("RGB", (56, 56), RED).save(folder / "good.png")
    Image.new("CMYK", (56, 56), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    Image.new("RGB", (56, 56), BLUE).convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png")
    ramp = np.tile(np.linspace(1000, 60000, 56, dtype=np.uint16), (56, 1))  # dark left, bright right
    Image.fromarray(ramp).save(folder / "gray16.png")
    Image.new("LA", (56, 56), (128, 255)).save(folder / "la.png")
    upright = Image.new("RGB", (56, 112), BLUE)
    upright.paste(Image.new("RGB", (56, 56), RED), (0, 0))  # red on top when shown upright
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: stored rotated, turn 90 degrees clockwise to display
    upright.transpose(Image.Transpose.ROTATE_90).save(folder / "exif.jpg", exif=exif, quality=95)
    Image.new("RGB", (1, 1), RED).save(folder / "tiny.png")
    Image.new("RGB", (2000, 20), RED).save(folder / "wide.png")
    Image.new("RGB", (20000, 20), RED).save(folder / "extreme.png")
    for name, fmt in (("truncated.jpg", "JPEG"), ("truncated.png", "PNG")):
        buffer = io.BytesIO()
        Image.effect_noise((112, 112), 64).convert("RGB").save(buffer, format=fmt)
        (folder / name).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (folder / "empty.png").write_bytes(b"")


def _corpus(folder: Path) -> tuple[list[str], list[str]]:
    """Two jsonl files (the second with a byte-order mark); returns them and the ids of the good rows,
    in file order. Every good row has an `id`; the bad ones are counted, not identified."""
    _images(folder / "img")
    ask = "<image>What colour is the shape?"
    lines: list[bytes] = []
    good: list[str] = []

    def row(row_id: str, ok: bool, **fields: Any) -> None:
        """A row asking about good.png unless `fields` say otherwise; a field set to DROP is left out."""
        record = {"id": row_id, "problem": ask, "answer": "red", "images": ["img/good.png"], **fields}
        kept = {key: value for key, value in record.items() if value is not DROP}
        lines.append(json.dumps(kept, ensure_ascii=False).encode())
        if ok:
            good.append(row_id)

    for name in ("good.png", "cmyk.jpg", "palette.png", "gray16.png", "la.png", "exif.jpg", "tiny.png"):
        row(name, True, images=[f"img/{name}"])
    for name in ("truncated.jpg", "truncated.png", "empty.png", "extreme.png", "missing.png"):
        row(name, False, images=[f"img/{name}"])
    row("wide.png", True, images=["img/wide.png"])
    row("null image", False, images=[None])
    row("no answer", False, answer=DROP)
    row("null answer", False, answer=None)
    row("empty answer", False, answer=" ")
    row("no marker", True, problem="What colour?")
    row("text only", True, problem="How many sides has a square?", answer="four", images=DROP)
    row("answer list", True, answer=["red", "crimson"])
    row("answer dict", True, answer={"colour": "red"})
    row("no prompt", False, problem=DROP)
    row("null prompt", False, problem=None)
    row("number prompt", False, problem=42)
    row("unicode", True, problem="<image>Quelle couleur ? 颜色？")
    lines.append('{"id": "latin-1", "problem": "Caf\xe9 or tea?", "answer": "tea"}'.encode("latin-1"))
    lines.append(b'{"id": "not json", "problem": ')
    lines.append(b'["a", "JSON", "list"]')
    row("far too long", False, problem=ask + " Think hard." * 500)
    row("markers > images", False, problem="<image> and <image>: which is red?")
    row("images > markers", False, images=["img/good.png", "img/tiny.png"])
    row("plain 1", True)
    row("plain 2", True)
    first = folder / "train.jsonl"
    first.write_bytes(b"\n".join(lines) + b"\n")
    second = folder / "bom.jsonl"
    bom_row = {"id": "after BOM", "problem": ask, "answer": "red", "images": ["img/good.png"]}
    second.write_bytes(b"\xef\xbb\xbf" + json.dumps(bom_row).encode() + b"\n")
    good.append("after BOM")
    return [str(first), str(second)], good


@pytest.mark.timeout(300)
def test_every_bad_row_is_skipped_and_counted_and_every_awkward_row_is_used_correctly(
    tmp_path, tiny_model_dir, caplog
) -> None:
    files, good = _corpus(tmp_path / "corpus")
    assert len(good) % 4 == 0  # whole steps of 4 prompts end exactly at the last (good) row
    seen_log = tmp_path / "seen.jsonl"
    recorder = tmp_path / "recorder.py"
    recorder.write_text(RECORDER.format(log=str(seen_log)))
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="mmrl.data.dataset"):
        code = main(
            [
                "train",
                CONFIG,
                f"model.path={tiny_model_dir}",
                f"data.train_files=[{', '.join(files)}]",
                "data.val_files=[]",
                "data.shuffle=false",
                "data.train_batch_size=4",
                f"trainer.total_steps={len(good) // 4}",
                f"trainer.output_dir={run}",
                f"reward.functions=[{{name: {recorder}:record}}]",
                "reward.isolation=inline",  # the recorder logs rows in the order they reach it
                "rollout.n=2",
                "actor.mini_batch_size=4",
                "warmup.steps=0",
                "trainer.val_every=0",
                "trainer.save_every=0",
                "trainer.progress=false",
                "trainer.loggers=[jsonl]",
            ]
        )
    assert code == 0
    records = raw_records(run)
    skipped = {k.removeprefix("data/skipped/"): v for k, v in records[-1].items() if "skipped/" in k}
    assert skipped == EXPECTED_SKIPS
    logged = {
        r.getMessage().split("(")[1].split(")")[0] for r in caplog.records if "skipping row" in r.getMessage()
    }
    assert logged == set(EXPECTED_SKIPS), "the first row of each reason is logged with why"

    seen: dict[str, dict[str, Any]] = {}
    for line in seen_log.read_text().splitlines():
        entry = json.loads(line)
        seen[entry["id"]] = entry
    assert list(seen) == good, "exactly the good rows reached the model, in file order"
    assert sum(len(r["data/rows"]) for r in records) == len(good)
    _check_used_rows(seen)


def _close(pixel: list[int], colour: tuple[int, ...], tolerance: int = 40) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True))


def _fitted(width: int, height: int) -> list[int]:
    h, w = smart_size(height, width, BUDGET)
    return [w, h]


def _check_used_rows(seen: dict[str, dict[str, Any]]) -> None:
    """What the model saw of each awkward row that was kept."""
    assert all(mode == "RGB" for entry in seen.values() for mode in entry["modes"])
    assert _close(seen["cmyk.jpg"]["top"][0], (255, 0, 0))  # C=0 M=100% Y=100% K=0 is pure red
    assert _close(seen["palette.png"]["top"][0], BLUE)
    left, right = seen["gray16.png"]["left"][0], seen["gray16.png"]["right"][0]
    assert left[0] < 60 and right[0] > 200, "16-bit grey is scaled into 8 bits, not clipped to white"
    assert _close(seen["la.png"]["top"][0], (128, 128, 128), tolerance=2)
    exif = seen["exif.jpg"]
    assert exif["original"] == [[56, 112]], "EXIF orientation applied: the image stands upright"
    assert exif["model_input"] == [_fitted(56, 112)]
    assert _close(exif["top"][0], RED) and _close(exif["bottom"][0], BLUE)
    assert seen["tiny.png"]["original"] == [[1, 1]]
    assert seen["tiny.png"]["model_input"] == [_fitted(1, 1)]
    wide_w, wide_h = seen["wide.png"]["model_input"][0]
    # transformers' rule (each image processor's own) pins the strip's short side at one grid cell and
    # keeps its shape, which takes more than max_pixels here: 1120 x 28 at a 12544 px budget.
    assert [wide_w, wide_h] == _fitted(2000, 20) == [1120, 28]
    assert wide_w > 10 * wide_h, "resized keeping the strip a strip"
    assert seen["no marker"]["model_input"] == [[112, 112]] and seen["text only"]["modes"] == []
    assert seen["answer list"]["truth"] == ["red", "crimson"]
    assert seen["answer dict"]["truth"] == {"colour": "red"}
    assert "颜色" in seen["unicode"]["prompt"]
    assert Counter(len(e["modes"]) for e in seen.values()) == Counter({1: len(seen) - 1, 0: 1})


def _train(tmp_path: Path, task: dict[str, Path], *extra: str) -> int:
    """One step of the tiny model on the colour task, with `extra` overrides last."""
    return main(
        [
            "train",
            CONFIG,
            *overrides(task["model"], task["train"], tmp_path / "run", task["reward"], 1),
            *extra,
        ]
    )


def _one_line(text: str) -> str:
    """Rich wraps long messages at the console width; compare text with whitespace collapsed."""
    return " ".join(text.split())


def _rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def task(colour_task: dict[str, Path], tiny_model_dir: Path) -> dict[str, Path]:
    return {**colour_task, "model": tiny_model_dir}


def test_data_of_another_layout_stops_with_skip_counts_and_the_keys_to_set(tmp_path, task, capsys) -> None:
    rows = [{"question": "<image>What colour?", "image": "a.png", "label": "red"}] * 3
    data = _rows(tmp_path / "other.jsonl", rows)
    assert _train(tmp_path, task, f"data.train_files={data}") == 2
    err = capsys.readouterr().err
    line = _one_line(err)
    assert "Traceback" not in err and "--resume" not in line and "engine" not in line.lower()
    assert (
        f"data.train_files ({data}): no usable row; all 3 rows read were skipped (missing_prompt 3)" in line
    )
    assert "'problem' (data.prompt_key)" in line and "['image', 'label', 'question']" in line
    assert "point data.prompt_key and data.answer_key at the right columns" in line


def test_an_empty_data_file_returns_2_naming_it(tmp_path, task, capsys) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    assert _train(tmp_path, task, f"data.train_files={data}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"data.train_files ({data}) is empty" in _one_line(err)


def test_a_validation_set_with_no_usable_row_is_refused_at_start(tmp_path, task, capsys) -> None:
    val = _rows(tmp_path / "val.jsonl", [{"problem": "What colour?"}, {"problem": "And now?"}])
    assert _train(tmp_path, task, f"data.val_files={val}", "trainer.val_before_train=true") == 2
    line = _one_line(capsys.readouterr().err)
    assert f"data.val_files ({val}): no usable row; all 2 rows read were skipped (missing_answer 2)" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_validation_skips_and_huge_images_are_counted_in_the_metrics(
    tmp_path, task, caplog, monkeypatch
) -> None:
    good = json.loads(task["val"].read_text().splitlines()[0])
    good["images"] = [str(task["val"].parent / image) for image in good["images"]]
    val = _rows(tmp_path / "val.jsonl", [good, {"problem": "What colour?"}])
    # The colour task's 56 x 56 images count as huge (past PIL's decompression-bomb size) under this limit.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mmrl.data.dataset"):
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        code = _train(tmp_path, task, f"data.val_files={val}", "trainer.val_before_train=true")
    assert code == 0
    first, step = raw_records(tmp_path / "run")
    assert first["step"] == 0 and first["val/skipped/missing_answer"] == 1
    assert step["data/huge_images"] == 4  # one image in each of the step's 4 prompts
    huge = [r.getMessage() for r in caplog.records if "far larger than the model sees" in r.getMessage()]
    assert len(huge) == 2, "logged once per data set, in mmrl's words"
    assert [m.split(" (")[0] for m in huge] == ["data.val_files", "data.train_files"]
    assert all("56x56 image" in m and "data/huge_images" in m for m in huge)
