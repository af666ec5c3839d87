"""Video sampling, sizing, decoding and placeholders agree with each other and with the real model."""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path
from typing import NoReturn

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.models import load_policy, load_processor
from mmrl.processors import (
    PixelBudget,
    VideoBudget,
    VideoError,
    build_messages,
    encode_prompt,
    fit_image,
    mrope_position_ids,
    num_image_tokens,
    num_video_tokens,
    pixel_inputs,
    plan_frames,
    read_video,
    split_media_markers,
    video_frame_size,
    video_grid_thw,
    video_pixel_inputs,
)
from mmrl.processors import video as video_module

BUDGET = VideoBudget(
    fps=2.0, max_frames=8, min_pixels=28 * 28, max_pixels=56 * 84, max_total_pixels=8 * 56 * 84
)
IMAGES = PixelBudget(min_pixels=28 * 28, max_pixels=16 * 28 * 28)


def code_frame(index: int, size: tuple[int, int] = (64, 48)) -> np.ndarray:
    """A flat frame whose colour spells its index, so a decoded frame says which source frame it is."""
    frame = np.zeros((size[1], size[0], 3), np.uint8)
    frame[..., 0] = index % 16 * 16
    frame[..., 1] = index // 16 * 16
    return frame


def frame_index(frame: np.ndarray) -> int:
    """Inverse of `code_frame`, robust to a few levels of lossy-codec error."""
    red, green = frame[..., 0].mean(), frame[..., 1].mean()
    return round(red / 16) + 16 * round(green / 16)


def write_video(path: Path, num_frames: int, fps: float, size: tuple[int, int] = (64, 48)) -> Path:
    """An H.264 clip of coded frames, written with PyAV (libx264), container chosen by the suffix."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10"}
        for i in range(num_frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(code_frame(i, size), format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s at 7.5 fps: an odd source rate that 2 fps sampling does not divide evenly."""
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", 75, 7.5)


@pytest.fixture(scope="module")
def model_and_processor(tiny_model_dir):
    return load_policy(tiny_model_dir).eval(), load_processor(tiny_model_dir)


# --- frame sampling -------------------------------------------------------------------------


def test_plan_at_odd_source_fps_samples_every_half_second() -> None:
    plan = plan_frames(75, 7.5, VideoBudget(fps=2.0, max_frames=32))
    assert len(plan.indices) == 20 and plan.fps == pytest.approx(2.0)
    assert plan.timestamps == [i / 7.5 for i in plan.indices]
    gaps = np.diff(plan.timestamps)
    assert np.all(np.abs(gaps - 0.5) <= 1 / 7.5 + 1e-9)  # within one source frame of the target spacing
    assert 0 <= plan.timestamps[0] < 0.5 and 9.5 <= plan.timestamps[-1] < 10


@pytest.mark.parametrize("total", [1, 2, 3])
def test_very_short_clips_fill_one_temporal_patch(total: int) -> None:
    plan = plan_frames(total, 30.0, VideoBudget())
    assert len(plan.indices) == 2
    assert plan.indices == sorted(plan.indices) and max(plan.indices) < total
    assert (plan.indices[0] == plan.indices[1]) == (total == 1)  # only a single frame is repeated
    assert plan.fps == pytest.approx(30.0 * len(set(plan.indices)) / total)


def test_odd_frame_count_takes_another_real_frame_before_padding() -> None:
    plan = plan_frames(25, 7.5, VideoBudget(fps=2.0))  # 3.33 s -> 7 frames wanted, 8 real available
    assert len(plan.indices) == 8 and len(set(plan.indices)) == 8


def test_long_clip_is_capped_by_max_frames_and_spans_the_clip() -> None:
    plan = plan_frames(18_000, 30.0, VideoBudget(fps=2.0, max_frames=32))  # 10 minutes
    assert len(plan.indices) == 32 and plan.fps == pytest.approx(32 / 600)
    assert plan.timestamps[0] < 600 / 32 and plan.timestamps[-1] > 600 * 31 / 32


def test_long_frame_list_is_capped_too() -> None:
    frames = np.stack([code_frame(i) for i in range(240)])  # 8 s at 30 fps
    video = read_video(frames, BUDGET, fps=30.0)
    assert len(video.frames) == BUDGET.max_frames
    assert [frame_index(f) for f in video.frames] == [round(t * 30) for t in video.timestamps]


# --- the pixel budget -------------------------------------------------------------------------


@pytest.mark.parametrize(("w", "h"), [(640, 480), (480, 640), (1920, 1080), (64, 48), (30, 900)])
def test_frame_size_shares_the_total_budget(w: int, h: int) -> None:
    budget = VideoBudget(
        max_frames=32, min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28, max_total_pixels=2048 * 784
    )
    areas = []
    for frames in (2, 4, 8, 16, 32):
        rh, rw = video_frame_size(h, w, frames, budget)
        assert rh % 28 == 0 and rw % 28 == 0
        assert budget.min_pixels <= rh * rw <= budget.max_pixels
        assert frames * rh * rw <= budget.max_total_pixels
        areas.append(rh * rw)
    assert areas == sorted(areas, reverse=True)  # more frames, smaller frames
    if min(w, h) >= 480:
        assert areas[0] == pytest.approx(budget.max_pixels, rel=0.15) and areas[-1] < areas[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_frames": 7}, "multiple"),
        ({"fps": 0}, "positive"),
        ({"min_pixels": 10_000, "max_pixels": 5_000}, "exceeds"),
        (
            {"max_frames": 64, "min_pixels": 128 * 784, "max_total_pixels": 4096 * 784},
            "raise max_total_pixels",
        ),
    ],
)
def test_impossible_budgets_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VideoBudget(**kwargs)


# --- decoding -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["decord", "pyav", "auto"])
def test_decoded_frames_are_the_planned_source_frames(clip: Path, backend: str) -> None:
    video = read_video(clip, BUDGET, backend=backend)
    plan = plan_frames(75, 7.5, BUDGET)
    assert len(video.frames) == 8 and video.timestamps == tuple(plan.timestamps)
    assert video.fps == pytest.approx(plan.fps) and video.source_size == (48, 64)
    assert [frame_index(f) for f in video.frames] == plan.indices
    assert video.frames.shape[1:] == (*video_frame_size(48, 64, 8, BUDGET), 3)


def test_decord_and_pyav_agree(clip: Path) -> None:
    budget = VideoBudget(
        fps=7.5, max_frames=76, min_pixels=28 * 28, max_pixels=56 * 56, max_total_pixels=76 * 56 * 56
    )
    a = read_video(clip, budget, backend="decord")
    b = read_video(clip, budget, backend="pyav")
    assert a.frames.shape == b.frames.shape == (76, 56, 56, 3)  # 75 frames, the last repeated
    assert a.timestamps == b.timestamps and a.fps == b.fps == pytest.approx(7.5)
    diff = np.abs(a.frames.astype(int) - b.frames.astype(int))
    assert diff.mean() < 1.0 and diff.max() <= 8


def test_container_without_frame_count_is_counted(tmp_path: Path, clip: Path) -> None:
    mkv = write_video(tmp_path / "clip.mkv", 75, 7.5)
    with av.open(str(mkv)) as container:
        assert container.streams.video[0].frames == 0  # mkv stores no count: PyAV has to count packets
    ours = read_video(mkv, BUDGET, backend="pyav")
    assert [frame_index(f) for f in ours.frames] == [frame_index(f) for f in read_video(clip, BUDGET).frames]


def test_bytes_and_dict_inputs_match_the_path(clip: Path) -> None:
    from_path = read_video(clip, BUDGET)
    data = clip.read_bytes()
    for source in (data, {"bytes": data}, {"path": clip.name}):
        video = read_video(source, BUDGET, base_dir=clip.parent)
        assert np.array_equal(video.frames, from_path.frames) and video.timestamps == from_path.timestamps


def test_frame_lists_of_pil_and_arrays(clip: Path) -> None:
    arrays = [code_frame(i) for i in range(75)]
    from_arrays = read_video(arrays, BUDGET, fps=7.5)
    from_pil = read_video([Image.fromarray(a) for a in arrays], BUDGET, fps=7.5)
    assert np.array_equal(from_arrays.frames, from_pil.frames)
    assert [frame_index(f) for f in from_arrays.frames] == [
        frame_index(f) for f in read_video(clip, BUDGET).frames
    ]
    assert from_arrays.timestamps == read_video(clip, BUDGET).timestamps
    as_sampled = read_video(arrays[:5], BUDGET)  # no fps: already at the budget's rate, every frame kept
    assert [frame_index(f) for f in as_sampled.frames] == [0, 1, 2, 3, 4, 4]
    assert as_sampled.fps == BUDGET.fps


# --- a row's own keys (qwen-vl-utils' `fps`, `nframes` and pixel keys) ---------------------------


def test_a_video_entrys_nframes_and_fps_pick_the_frames(clip: Path) -> None:
    """The 10 s clip at 7.5 fps: `nframes` spreads that many frames over it (at most the run's
    max_frames), `fps` replaces the run's sampling rate."""
    entry = {"video": clip.name}
    four = read_video({**entry, "nframes": 4}, BUDGET, base_dir=clip.parent)
    assert [frame_index(f) for f in four.frames] == [9, 28, 46, 65]
    assert four.fps == pytest.approx(0.4) and four.timestamps[0] == pytest.approx(9 / 7.5)
    assert len(read_video({**entry, "nframes": 20}, BUDGET, base_dir=clip.parent).frames) == BUDGET.max_frames
    slow = read_video({**entry, "fps": 0.5}, BUDGET, base_dir=clip.parent)  # 5 frames, a 6th before padding
    assert len(slow.frames) == 6 and slow.fps == pytest.approx(0.6)
    assert len(read_video(entry, BUDGET, base_dir=clip.parent).frames) == 8  # 2 fps, capped at max_frames


def test_a_video_entrys_pixel_keys_size_its_frames(clip: Path) -> None:
    small = read_video({"video": str(clip), "max_pixels": 28 * 28}, BUDGET)
    assert small.size == (28, 28) and small.source_size == (48, 64)
    resized = read_video({"path": str(clip), "resized_height": 112, "resized_width": 56}, BUDGET)
    assert resized.size == video_frame_size(112, 56, 8, BUDGET) == (84, 28)  # snapped within the run's budget


def test_a_video_entry_may_list_its_frames_as_image_files(tmp_path: Path) -> None:
    names = []
    for i in range(6):
        names.append(f"f{i}.png")
        Image.fromarray(code_frame(i)).save(tmp_path / names[-1])
    video = read_video({"video": names, "nframes": 2}, BUDGET, base_dir=tmp_path)
    assert [frame_index(f) for f in video.frames] == [1, 4]


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"fps": 1.0, "nframes": 4}, "give one or the other"),
        ({"nframes": 0}, "nframes=0: use a positive whole number"),
        ({"fps": "fast"}, "fps='fast'"),
        ({"fps": -1}, "positive sampling rate"),
        ({"min_pixels": 100 * 784}, "exceeds max_pixels"),
        ({"video": ["missing.png"]}, "frame 0: cannot read image"),
    ],
)
def test_bad_video_entry_keys_raise_video_error(clip: Path, keys: dict, match: str) -> None:
    with pytest.raises(VideoError, match=match):
        read_video({"video": str(clip), **keys}, BUDGET, base_dir=clip.parent)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        ([np.zeros((8, 8), np.uint8)], "HxWx3 uint8"),
        ([np.zeros((8, 8, 3), np.float32)], "uint8"),
    ],
)
def test_bad_frame_lists_raise_video_error(frames: list, match: str) -> None:
    with pytest.raises(VideoError, match=match):
        read_video(frames, BUDGET)


@pytest.fixture(scope="module")
def broken_files(tmp_path_factory: pytest.TempPathFactory, clip: Path) -> dict[str, Path]:
    """Zero bytes, garbage, a tail-less mp4 and a faststart mp4 cut inside its frame data."""
    root = tmp_path_factory.mktemp("broken")
    faststart = root / "faststart.mp4"
    with av.open(str(faststart), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height = 64, 48
        rng = np.random.default_rng(0)  # noise frames make the frame data most of the file
        for _ in range(60):
            frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    data = clip.read_bytes()
    files = {
        "empty": b"",
        "garbage": b"not a video" * 50,
        "truncated": data[: len(data) // 2],
        "cut_frames": faststart.read_bytes()[: faststart.stat().st_size // 2],
    }
    for name, content in files.items():
        (root / f"{name}.mp4").write_bytes(content)
    return {name: root / f"{name}.mp4" for name in files}


@pytest.mark.parametrize("name", ["empty", "garbage", "truncated", "cut_frames"])
@pytest.mark.parametrize("backend", ["auto", "decord", "pyav"])
def test_broken_files_raise_video_error(broken_files: dict[str, Path], name: str, backend: str) -> None:
    path = broken_files[name]
    with pytest.raises(VideoError, match="empty" if name == "empty" else "cannot read video"):
        read_video(path, BUDGET, backend=backend)
    if name != "empty":
        with pytest.raises(VideoError):
            read_video(path.read_bytes(), BUDGET, backend=backend)


@pytest.mark.parametrize("source", [b"", "missing.mp4", 3.5])
def test_unusable_sources_raise_video_error(tmp_path: Path, source: object) -> None:
    with pytest.raises(VideoError):
        read_video(source, BUDGET, base_dir=tmp_path)


def test_auto_falls_back_to_pyav(clip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = read_video(clip, BUDGET, backend="pyav")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "decord", None)  # decord not installed
        assert np.array_equal(read_video(clip, BUDGET).frames, expected.frames)
        with pytest.raises(ImportError):
            read_video(clip, BUDGET, backend="decord")  # asked for by name: a setup error, not a bad video

    def broken(*_args: object) -> NoReturn:
        raise RuntimeError("decord crashed")

    monkeypatch.setitem(video_module._DECODERS, "decord", broken)  # decord fails on this file
    assert np.array_equal(read_video(clip, BUDGET).frames, expected.frames)


# --- placeholders and pixels agree with the model ------------------------------------------------


@pytest.mark.parametrize(("frames", "w", "h"), [(1, 64, 48), (3, 200, 90), (8, 50, 300), (75, 640, 480)])
def test_placeholder_count_equals_video_tower_output(
    model_and_processor, frames: int, w: int, h: int
) -> None:
    model, processor = model_and_processor
    video = read_video([code_frame(i, (w, h)) for i in range(frames)], BUDGET, fps=7.5)
    n_tokens = num_video_tokens(len(video.frames), *video.size, BUDGET)
    inputs = video_pixel_inputs([video], processor.video_processor)
    assert tuple(inputs["video_grid_thw"][0].tolist()) == video_grid_thw(video, BUDGET)
    assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2 / video.fps])
    with torch.no_grad():
        features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    assert features.pooler_output[0].shape[0] == n_tokens
    # The checkpoint's processor, left to size the raw frames itself under our per-frame cap, agrees.
    share = min(BUDGET.max_pixels, BUDGET.max_total_pixels // len(video.frames))
    raw = np.stack([code_frame(i, (w, h)) for i in range(len(video.frames))])
    theirs = processor.video_processor(
        videos=[raw],
        size={"shortest_edge": BUDGET.min_pixels, "longest_edge": share},
        cap_pixels_per_frame=False,
    )
    assert theirs["video_grid_thw"].tolist() == inputs["video_grid_thw"].tolist()
    ids = encode_prompt(
        processor.tokenizer, build_messages("<video>What moves?", 0, num_videos=1), [], [n_tokens]
    )
    assert ids.count(model.config.video_token_id) == n_tokens


# --- chat markers -------------------------------------------------------------------------


def test_image_and_video_markers_become_parts_in_order() -> None:
    parts = split_media_markers("<video> then <image> and <video>?", 1, 2)
    assert [p["type"] for p in parts] == ["video", "text", "image", "text", "video", "text"]
    assert [p["type"] for p in split_media_markers("which?", 1, 1)] == ["image", "video", "text"]
    assert [p["type"] for p in split_media_markers("<video>which?", 1, 1)] == ["image", "video", "text"]
    with pytest.raises(ValueError, match="2 <video> markers but the row has 1 videos"):
        split_media_markers("<video><video><image>", 1, 1)
    with pytest.raises(ValueError, match="<image> markers"):
        build_messages("<image><video>", 2, num_videos=1)
    # Rows without videos keep the old meaning: `<video>` is plain text.
    assert build_messages("a <video> tag", 0)[0]["content"] == [{"type": "text", "text": "a <video> tag"}]


def test_encode_prompt_checks_video_pad_counts(model_and_processor) -> None:
    _, processor = model_and_processor
    messages = build_messages("<image><video>", 1, num_videos=1)
    with pytest.raises(ValueError, match="1 video pads for 0 videos"):
        encode_prompt(processor.tokenizer, messages, [4])


# --- mRoPE positions equal the model's ----------------------------------------------------------


def _video(frames: int, fps: float, size: tuple[int, int]) -> np.ndarray:
    return np.stack([code_frame(i, size) for i in range(frames)])


PROMPTS = {
    # name: (text, image sizes, videos as (frames, source fps, frame size))
    "video_only": ("<video>", [], [(8, 2.0, (56, 56))]),
    "mixed": ("Look: <image> and <video> - what changed?", [(56, 84)], [(16, 4.0, (84, 56))]),
    # 30 s capped at 16 frames (0.53 fps), a 1 fps clip padded to 6 frames, 12 frames at 7.5 fps (2.5 fps)
    "different_fps": (
        "<video> vs <video> vs <video>",
        [],
        [(90, 3.0, (56, 56)), (5, 1.0, (28, 56)), (12, 7.5, (56, 28))],
    ),
    "text_only": ("no pictures here", [], []),
}


def _encode(processor, budget: VideoBudget, text: str, image_sizes: list, videos: list) -> dict:
    """One prompt as the data layer will build it: fitted media, expanded pads, pixel inputs."""
    images = [fit_image(Image.new("RGB", s, (0, 90, 200)), IMAGES) for s in image_sizes]
    clips = [read_video(_video(n, fps, size), budget, fps=fps) for n, fps, size in videos]
    ids = encode_prompt(
        processor.tokenizer,
        build_messages(text, len(images), num_videos=len(clips)),
        [num_image_tokens(i.height, i.width, IMAGES) for i in images],
        [num_video_tokens(len(c.frames), *c.size, budget) for c in clips],
    )
    out: dict = {"ids": ids}
    if images:
        out["image_grid_thw"] = pixel_inputs(images, processor.image_processor)["image_grid_thw"]
    if clips:
        out.update(video_pixel_inputs(clips, processor.video_processor))
    return out


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows)) + 2
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


def _cat(encoded: list[dict], key: str) -> torch.Tensor | None:
    parts = [e[key] for e in encoded if key in e]
    return torch.cat(parts) if parts else None


@pytest.mark.parametrize(
    "batch",
    [["video_only"], ["mixed"], ["different_fps"], ["video_only", "text_only", "mixed", "different_fps"]],
)
def test_position_ids_equal_model_get_rope_index(model_and_processor, batch: list[str]) -> None:
    model, processor = model_and_processor
    cfg = model.config
    budget = VideoBudget(
        fps=2.0, max_frames=16, min_pixels=28 * 28, max_pixels=84 * 84, max_total_pixels=16 * 84 * 84
    )
    encoded = [_encode(processor, budget, *PROMPTS[name]) for name in batch]
    ids, mask = _left_padded([e["ids"] for e in encoded], processor.tokenizer.pad_token_id)
    grids = {key: _cat(encoded, key) for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    ours = mrope_position_ids(
        ids,
        mask,
        grids["image_grid_thw"],
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        spatial_merge_size=cfg.vision_config.spatial_merge_size,
        video_grid_thw=grids["video_grid_thw"],
        second_per_grid_ts=grids["second_per_grid_ts"],
        tokens_per_second=cfg.vision_config.tokens_per_second,
    )
    mm_types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    theirs, _ = model.model.get_rope_index(ids, mm_types, attention_mask=mask, **grids)
    assert torch.equal(ours, theirs)
    video_rows = ours[0][ids == cfg.video_token_id]
    assert video_rows.unique().numel() > 1  # the temporal axis really moves across a video


def test_temporal_positions_follow_real_time(model_and_processor) -> None:
    """The same number of frames from a slower source spans more seconds, so wider temporal steps."""
    model, processor = model_and_processor
    cfg = model.config
    steps = []
    for fps in (1.0, 2.0):
        enc = _encode(processor, BUDGET, "<video>", [], [(8, fps, (56, 56))])
        ids = torch.tensor([enc["ids"]])
        pos = mrope_position_ids(
            ids,
            torch.ones_like(ids),
            None,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            spatial_merge_size=2,
            video_grid_thw=enc["video_grid_thw"],
            second_per_grid_ts=enc["second_per_grid_ts"],
            tokens_per_second=cfg.vision_config.tokens_per_second,
        )
        temporal = pos[0, 0][ids[0] == cfg.video_token_id].unique()
        steps.append((temporal[1] - temporal[0]).item())
    assert steps == [4, 2]  # tokens_per_second=2 x (2 frames / fps) seconds per temporal patch
