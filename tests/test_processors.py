"""The sizing rule, placeholder expansion and mRoPE positions agree with the real model (that the rule
is each family's image processor's own is tests/test_resize_rule.py)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from PIL import Image

from mmrl.models import load_policy, load_processor
from mmrl.processors import (
    ImageError,
    PixelBudget,
    VideoBudget,
    VideoError,
    build_messages,
    encode_prompt,
    fit_image,
    load_image,
    mrope_position_ids,
    num_image_tokens,
    pixel_inputs,
    read_video,
    smart_size,
)

BUDGET = PixelBudget(min_pixels=28 * 28, max_pixels=64 * 28 * 28)
SIZES = [(1, 1), (5, 300), (300, 5), (28, 28), (29, 27), (57, 113), (640, 480), (4000, 3000), (20, 3000)]


@pytest.fixture(scope="module")
def model_and_processor(tiny_model_dir):
    return load_policy(tiny_model_dir).eval(), load_processor(tiny_model_dir)


@pytest.mark.parametrize(("w", "h"), SIZES)
def test_smart_size_respects_grid_budget_and_aspect(w: int, h: int) -> None:
    """transformers' rule keeps the area within the budget, but a strip whose short side is pinned
    at one grid cell keeps the long side the area allows it (20x3000 becomes 28 x 2716, over
    max_pixels), as the image processor does; the old hand-written rule trimmed it."""
    rh, rw = smart_size(h, w, BUDGET)
    assert rh % 28 == 0 and rw % 28 == 0
    assert BUDGET.min_pixels <= rh * rw
    assert rh * rw <= BUDGET.max_pixels or min(rh, rw) == 28
    if min(w, h) >= 28 and max(rh, rw) > 28:  # aspect kept within one grid step where the grid allows
        assert abs(rw / rh - w / h) / (w / h) < 0.5


def test_extreme_aspect_ratio_is_refused() -> None:
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_size(20, 20000, BUDGET)


@pytest.mark.parametrize(("w", "h"), SIZES)
def test_placeholder_count_equals_vision_tower_output(model_and_processor, w: int, h: int) -> None:
    model, processor = model_and_processor
    image = fit_image(Image.new("RGB", (w, h), (200, 30, 30)), BUDGET)
    n_tokens = num_image_tokens(image.height, image.width, BUDGET)
    inputs = pixel_inputs([image], processor.image_processor)
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    assert features.pooler_output[0].shape[0] == n_tokens
    ids = encode_prompt(processor.tokenizer, build_messages("<image>What colour?", 1), [n_tokens])
    assert ids.count(model.config.image_token_id) == n_tokens


def test_position_ids_equal_model_get_rope_index_on_mixed_padded_batch(model_and_processor) -> None:
    model, processor = model_and_processor
    tok = processor.tokenizer
    images = [fit_image(Image.new("RGB", s, (0, 90, 200)), BUDGET) for s in [(56, 84), (140, 28), (300, 200)]]
    counts = [num_image_tokens(i.height, i.width, BUDGET) for i in images]
    prompts = [
        encode_prompt(tok, build_messages("<image>How many circles?", 1), counts[:1]),
        encode_prompt(tok, build_messages("plain text only", 0), []),
        encode_prompt(tok, build_messages("<image> left, <image> right: which is red?", 2), counts[1:]),
    ]
    width = max(map(len, prompts)) + 3
    ids = torch.full((3, width), tok.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding, as in generation
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    grid = pixel_inputs(images, processor.image_processor)["image_grid_thw"]
    ours = mrope_position_ids(
        ids,
        mask,
        grid,
        image_token_id=model.config.image_token_id,
        video_token_id=model.config.video_token_id,
        spatial_merge_size=2,
    )
    mm_types = (ids == model.config.image_token_id).int()
    theirs, _ = model.model.get_rope_index(ids, mm_types, image_grid_thw=grid, attention_mask=mask)
    assert ours.shape == (3, 3, width)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours[0], ours[1])  # the image rows really have 2-D positions


def test_placeholders_that_the_grids_do_not_cover_are_an_error() -> None:
    """Position ids need a grid for every image's placeholders; extra grids after the last one are not
    this batch's and are ignored."""
    ids = torch.tensor([[5, 12, 12, 12, 12, 6]])
    grid = torch.tensor([[1, 4, 4]])  # 4 placeholders after a 2x2 merge
    kw = {"image_token_id": 12, "video_token_id": 13, "spatial_merge_size": 2}
    ones = torch.ones_like(ids)
    assert mrope_position_ids(ids, ones, grid, **kw)[0, 0].tolist() == [0, 1, 1, 1, 1, 3]
    assert torch.equal(
        mrope_position_ids(ids, ones, torch.cat([grid, grid]), **kw),
        mrope_position_ids(ids, ones, grid, **kw),
    )
    with pytest.raises(ValueError, match="do not fit the grids"):
        mrope_position_ids(ids, ones, torch.tensor([[1, 2, 2]]), **kw)
    with pytest.raises(ValueError, match="do not fit the grids"):
        mrope_position_ids(ids, ones, None, **kw)


def test_load_image_handles_bytes_modes_and_exif(tmp_path) -> None:
    buf = io.BytesIO()
    Image.new("CMYK", (30, 20)).save(buf, format="JPEG")
    assert load_image(buf.getvalue()).mode == "RGB"
    assert load_image(Image.new("P", (4, 4))).mode == "RGB"
    assert load_image(Image.new("I;16", (4, 4))).mode == "RGB"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display": width and height swap once applied
    path = tmp_path / "rot.jpg"
    Image.new("RGB", (40, 10)).save(path, exif=exif)
    assert load_image(path).size == (10, 40)
    assert load_image("rot.jpg", base_dir=tmp_path).size == (10, 40)


def test_a_file_url_is_read_and_a_web_url_is_refused_saying_so(tmp_path) -> None:
    path = tmp_path / "a b.png"
    Image.new("RGB", (12, 8)).save(path)
    assert load_image(path.as_uri()).size == (12, 8)  # file:///.../a%20b.png
    for url in ("https://example.org/cat.png", "s3://bucket/cat.png"):
        with pytest.raises(ImageError, match=r"cannot read image .*:// URLs are not fetched.*give its path"):
            load_image(url, base_dir=tmp_path)
    with pytest.raises(
        VideoError, match=r"cannot read video http://x/clip.mp4: http:// URLs are not fetched"
    ):
        read_video("http://x/clip.mp4", VideoBudget())


@pytest.mark.parametrize("bad", [b"", b"\x89PNG\r\n\x1a\n\x00\x00", "missing.png", 12])
def test_load_image_bad_input_raises_image_error(tmp_path, bad) -> None:
    with pytest.raises(ImageError):
        load_image(bad, base_dir=tmp_path)


def test_marker_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        build_messages("<image><image> two?", 1)


# Budgets where min = max (as in configs/quickstart.yaml), on Qwen2.5's 28 px grid and Qwen3-VL's 32 px
# grid. transformers' rule rounds each side on its own, so only some shapes land exactly on the budget:
# a 4:3 photo takes a grid step less, a 4:7 one a step more, and a huge square can come out a step
# short (its float square root lands a hair under a whole cell). These are the sizes each family's image
# processor gives (tests/test_resize_rule.py); the hand-written rule this replaced searched for a grid
# size exactly on the budget, which no image processor or vLLM would have matched.
@pytest.mark.parametrize(
    ("budget", "w", "h", "size"),
    [
        (PixelBudget(12544, 12544), 640, 480, (112, 84)),
        (PixelBudget(12544, 12544), 40, 70, (112, 168)),
        (PixelBudget(12544, 12544), 1, 1, (112, 112)),
        (PixelBudget(12544, 12544), 10000, 10000, (84, 84)),
        (PixelBudget(56 * 56, 56 * 56), 10000, 10000, (28, 28)),
        (PixelBudget(16384, 16384, patch_size=16), 10000, 10000, (128, 128)),
        (PixelBudget(16384, 16384, patch_size=16), 4000, 3000, (128, 96)),
    ],
)
def test_a_budget_where_min_equals_max_is_met_as_transformers_meets_it(
    budget: PixelBudget, w: int, h: int, size: tuple[int, int]
) -> None:
    rh, rw = smart_size(h, w, budget)
    assert (rw, rh) == size


def test_a_huge_image_is_read_without_pils_raw_warning(tmp_path, monkeypatch) -> None:
    path = tmp_path / "huge.png"
    Image.new("RGB", (90, 90), (10, 20, 30)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)  # 90 x 90 is past PIL's warning, short of its error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(path).size == (90, 90)
