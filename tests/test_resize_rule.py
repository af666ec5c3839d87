"""Images and video frames are sized by each family's own transformers rule, and a row may size its own
media with qwen-vl-utils' message keys (`min_pixels`, `max_pixels`, `resized_height`, `resized_width`,
`fps`, `nframes`)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import Glm4vVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from mmrl.config import DataConfig
from mmrl.data.dataset import PromptDataset, PromptInputs, image_budget
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic_video import write_mp4
from mmrl.models import FAMILIES, family_of, load_config, load_processor
from mmrl.processors import (
    ImageError,
    PixelBudget,
    VideoBudget,
    fit_image,
    num_image_tokens,
    smart_size,
    video_frame_size,
)

# InternVL cuts images into tiles, Gemma 3 resizes every image to one square, LLaVA-OneVision to a grid of
# base squares and Mistral 3 within a longest edge instead of resizing them to a patch grid within a pixel
# budget: test_family_internvl.py, test_family_gemma3.py, test_family_llava_onevision.py and
# test_family_mistral3.py check their sizing against their image processors.
VL_FAMILIES = sorted(
    {
        f.name
        for f in FAMILIES.values()
        if f.takes_images and f.name not in ("internvl", "gemma3", "llava_onevision", "mistral3")
    }
)
# (width, height): 1x1-ish specks, 200:1 strips both ways, off-grid and ordinary photos.
SIZES = [
    (1, 1),
    (2, 3),
    (200, 1),
    (1, 200),
    (3000, 15),
    (28, 28),
    (29, 27),
    (57, 113),
    (640, 480),
    (480, 640),
]
# Too large to push through the image processor in a fast test: compared with its own patch count,
# which is how vLLM asks it for the placeholder count of an image it has not seen.
LARGE = [(4000, 3000), (10000, 10000), (10000, 9999)]


def _budgets(factor: int) -> dict[str, tuple[int, int]]:
    """(min_pixels, max_pixels) pairs: the config default, a small one, and min = max on the grid, off
    it (configs/quickstart.yaml's 112 x 112 on Qwen3's 32 px grid) and at a single grid cell."""
    return {
        "default": (28 * 28, 1024 * 28 * 28),
        "small": (4 * factor**2, 16 * factor**2),
        "min=max": (16 * factor**2, 16 * factor**2),
        "min=max off the grid": (12544, 12544),
        "min=max one cell": (factor**2, factor**2),
    }


@pytest.fixture(scope="module")
def families(tiny_family_dir) -> dict[str, tuple[Any, Any]]:
    """Each VL family's tiny checkpoint config and the processor saved with it."""
    return {
        name: (load_config(tiny_family_dir(name)), load_processor(tiny_family_dir(name)))
        for name in VL_FAMILIES
    }


def _processed_size(image_processor: Any, width: int, height: int, low: int, high: int) -> tuple[int, int]:
    """(width, height) the family's image processor resizes a `width` x `height` image to."""
    out = image_processor(
        images=np.zeros((height, width, 3), np.uint8),
        size={"shortest_edge": low, "longest_edge": high},
        input_data_format="channels_last",  # a 1-pixel side would otherwise be taken for the channels
        return_tensors="pt",
    )
    _, rows, cols = out["image_grid_thw"][0].tolist()
    return cols * image_processor.patch_size, rows * image_processor.patch_size


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_images_are_sized_as_the_familys_image_processor_sizes_them(families, name: str) -> None:
    config, processor = families[name]
    image_processor = processor.image_processor
    patch = image_processor.patch_size
    for label, (low, high) in _budgets(family_of(config).grid().factor).items():
        budget = image_budget(SimpleNamespace(min_pixels=low, max_pixels=high), config)
        for w, h in SIZES:
            fitted = fit_image(Image.new("RGB", (w, h)), budget)
            assert fitted.size == _processed_size(image_processor, w, h, low, high), f"{label}: {w}x{h}"
        for w, h in LARGE:
            rh, rw = smart_size(h, w, budget)
            # Qwen's processors read the bounds as min_pixels/max_pixels, GLM's as size.
            bounds = {
                "min_pixels": low,
                "max_pixels": high,
                "size": {"shortest_edge": low, "longest_edge": high},
            }
            patches = image_processor.get_number_of_image_patches(h, w, bounds)
            assert (rh // patch) * (rw // patch) == patches, f"{label}: {w}x{h}"
        rh, rw = smart_size(10000, 10000, budget)
        assert rh * rw <= high, f"{label}: 10000x10000 became {rw}x{rh}, over max_pixels={high}"


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_what_the_image_processor_refuses_is_a_bad_image(families, name: str) -> None:
    config, processor = families[name]
    budget = image_budget(SimpleNamespace(min_pixels=28 * 28, max_pixels=1024 * 28 * 28), config)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.image_processor(images=np.zeros((1, 201, 3), np.uint8), input_data_format="channels_last")
    with pytest.raises(ImageError, match=r"aspect ratio.*crop or pad it"):
        fit_image(Image.new("RGB", (201, 1)), budget)
    with pytest.raises(ImageError, match="no pixels"):
        smart_size(0, 10, budget)


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_video_frames_are_sized_as_the_familys_video_processor_sizes_them(families, name: str) -> None:
    """Qwen2/2.5-VL's video processor bounds each frame's pixels, the Qwen3 line's and GLM's a whole clip's."""
    config, processor = families[name]
    family, video_processor = family_of(config), processor.video_processor
    grid = family.grid()
    f = grid.factor
    budget = VideoBudget(
        max_frames=8,
        min_pixels=2 * f * f,
        max_pixels=16 * f * f,
        max_total_pixels=64 * f * f,
        patch_size=grid.patch,
        merge_size=grid.merge,
        temporal_patch_size=grid.temporal,
        rule=family.video_size_rule,
    )
    per_clip = isinstance(video_processor, (Qwen3VLVideoProcessor, Glm4vVideoProcessor))  # frames x pixels
    for frames in (2, 8):
        share = min(budget.max_pixels, budget.max_total_pixels // frames)
        scale = frames if per_clip else 1
        size = {"shortest_edge": budget.min_pixels * scale, "longest_edge": share * scale}
        for h, w in [(10, 12), (48, 64), (3, 500), (720, 1280)]:
            out = video_processor(
                videos=[np.zeros((frames, h, w, 3), np.uint8)],
                size=size,
                do_sample_frames=False,
                input_data_format="channels_last",
                return_tensors="pt",
            )
            _, rows, cols = out["video_grid_thw"][0].tolist()
            assert video_frame_size(h, w, frames, budget) == (rows * grid.patch, cols * grid.patch), (
                f"{frames} frames of {w}x{h}"
            )


# --- a row's own keys -------------------------------------------------------------------------------

RUN = PixelBudget(min_pixels=56 * 56, max_pixels=224 * 224)


def _png(size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 0, 0)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_processor(tiny_model_dir)


def _prepare(processor: Any, images: list[Any], folder: Path) -> tuple[PromptSample | None, PromptDataset]:
    """One row with `images` (entries as the `images` column holds them), prepared under `RUN`."""
    row = {"problem": "<image>" * len(images) + "What colour?", "answer": "red", "images": images}
    inputs = PromptInputs(processor.tokenizer, processor.image_processor, RUN)
    dataset = PromptDataset([(row, folder)], DataConfig(max_prompt_length=512), inputs)
    return dataset.prepare(0), dataset


def test_an_image_entrys_max_pixels_gives_fewer_tokens(processor, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png((224, 224)))
    plain = _prepare(processor, ["a.png"], tmp_path)[0]
    small = _prepare(processor, [{"image": "a.png", "max_pixels": 56 * 56}], tmp_path)[0]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert plain.prompt_ids.count(pad) == num_image_tokens(224, 224, RUN) == 64
    assert small.images[0].size == (56, 56) and small.prompt_ids.count(pad) == 4
    assert small.image_grid_thw.tolist() == [[1, 4, 4]]


def test_an_image_entrys_min_pixels_raises_the_runs_floor(processor, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png((56, 56)))
    sample = _prepare(processor, [{"path": "a.png", "min_pixels": 112 * 112}], tmp_path)[0]
    assert sample.images[0].size == (112, 112)


def test_resized_height_and_width_are_snapped_to_the_grid(processor, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png((300, 200)))
    entry = {"image": "a.png", "resized_height": 100, "resized_width": 150, "max_pixels": 56 * 56}
    sample = _prepare(processor, [entry], tmp_path)[0]
    # qwen-vl-utils snaps the asked size with smart_resize (100 x 150 -> 112 x 140) and ignores the
    # entry's pixel bounds then; the run's bounds still hold.
    assert sample.images[0].size == (140, 112)
    assert sample.image_sizes[0].original == (300, 200) and sample.image_sizes[0].model_input == (140, 112)
    big = _prepare(processor, [{"image": "a.png", "resized_height": 1000, "resized_width": 1000}], tmp_path)[
        0
    ]
    assert big.images[0].width * big.images[0].height <= RUN.max_pixels


def test_an_entry_with_null_fields_is_sized_by_the_run(processor) -> None:
    """A parquet struct column fills the fields a row lacks with None: those change nothing."""
    entry = {"bytes": _png((300, 200)), "path": None, "min_pixels": None, "max_pixels": None}
    entry |= {"resized_height": None, "resized_width": 150}  # one of the two is no size
    sample = _prepare(processor, [entry], Path("."))[0]
    assert sample.images[0].size == fit_image(Image.new("RGB", (300, 200)), RUN).size


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"max_pixels": -5}, "max_pixels=-5: use a positive whole number"),
        ({"max_pixels": "big"}, "max_pixels='big'"),
        ({"resized_height": 2.5, "resized_width": 10}, r"resized_height=2\.5"),
        ({"min_pixels": 300 * 300}, "min_pixels=90000 exceeds max_pixels=50176"),
    ],
)
def test_a_bad_image_key_skips_the_row_as_bad_image(processor, keys: dict, match: str) -> None:
    sample, dataset = _prepare(processor, [{"bytes": _png((60, 50)), **keys}], Path("."))
    assert sample is None and dataset.skipped == {"bad_image": 1}
    with pytest.raises(ImageError, match=match):
        fit_image(Image.new("RGB", (60, 50)), RUN, keys)


def test_keys_size_each_image_of_a_row_on_its_own(processor) -> None:
    images = [{"bytes": _png((224, 224)), "max_pixels": 56 * 56}, _png((224, 224))]
    sample = _prepare(processor, images, Path("."))[0]
    assert [im.size for im in sample.images] == [(56, 56), (224, 224)]
    assert sample.image_grid_thw.tolist() == [[1, 4, 4], [1, 16, 16]]


def test_a_video_rows_entry_keys_reach_the_model_inputs(processor, tmp_path: Path) -> None:
    write_mp4(tmp_path / "clip.mp4", np.zeros((16, 56, 56, 3), np.uint8), fps=4)  # 4 s
    row = {"problem": "<video>Which way?", "answer": "left", "videos": [{"video": "clip.mp4", "nframes": 4}]}
    budget = VideoBudget(min_pixels=28 * 28, max_pixels=56 * 56, max_total_pixels=32 * 56 * 56)
    inputs = PromptInputs(
        processor.tokenizer,
        processor.image_processor,
        RUN,
        video_budget=budget,
        video_processor=processor.video_processor,
    )
    dataset = PromptDataset([(row, tmp_path)], DataConfig(max_prompt_length=512), inputs)
    sample = dataset.prepare(0)
    assert len(sample.videos[0].frames) == 4  # 8 at the run's 2 fps
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]]
