"""Video inputs for Qwen2.5-VL: decoding, frame sampling, the one sizing rule and pixel tensors.

A video reaches the model as an even number of equally sized frames; each pair of frames is one
temporal patch. `read_video` decodes (decord, falling back to PyAV), samples by target fps and a
frame cap, and resizes every frame with `video_frame_size`, which applies the family's video
processor's own rule (`VideoBudget.rule`) and which rollout and training share, so the
`<|video_pad|>` count in a prompt always equals the vision tower's output.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

from mmrl.processors.files import local_path, media_size
from mmrl.processors.image import ImageError, entry_int, entry_keys, load_image

log = logging.getLogger("mmrl.processors.video")

Backend = Literal["auto", "decord", "pyav"]


class VideoError(ValueError):
    """A video that cannot be used; the message says which and why, for the skip log."""


# (num_frames, height, width, budget, max_pixels) -> the (height, width) of every frame, by the family's
# video processor's own rule; `budget.min_pixels` and `max_pixels` (the frame's share) bound one frame.
FrameRule = Callable[[int, int, int, "VideoBudget", int], tuple[int, int]]


def frame_by_frame(
    num_frames: int, height: int, width: int, budget: VideoBudget, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's and Qwen2.5-VL's video processor: each frame by transformers' `smart_resize`."""
    return smart_resize(height, width, budget.factor, budget.min_pixels, max_pixels)


@dataclass(frozen=True)
class VideoBudget:
    """How densely a video is sampled and how many pixels its frames may use.

    `min_pixels`/`max_pixels` bound each frame and `max_total_pixels` bounds the sum over all
    frames, so a long clip gets smaller frames rather than more tokens: a video costs at most
    `max_total_pixels / (temporal_patch_size * factor**2)` placeholder tokens, up to the rounding of
    `rule`, the family's video processor's own (`Family.video_size_rule`), which keeps a thin strip
    one grid cell across. `nframes` (a row's own key) takes that many frames instead of sampling at
    `fps`.
    """

    fps: float = 2.0
    max_frames: int = 32
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    max_total_pixels: int = 4096 * 28 * 28
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    nframes: int | None = None
    rule: FrameRule = frame_by_frame

    def __post_init__(self) -> None:
        if self.nframes is not None and self.nframes < 1:
            raise ValueError(f"VideoBudget.nframes={self.nframes}: use a positive frame count")
        if self.fps <= 0:
            raise ValueError(f"VideoBudget.fps={self.fps}: use a positive sampling rate such as 2.0")
        if self.max_frames < self.temporal_patch_size or self.max_frames % self.temporal_patch_size:
            raise ValueError(
                f"VideoBudget.max_frames={self.max_frames}: use a positive multiple of "
                f"temporal_patch_size={self.temporal_patch_size}"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"VideoBudget: min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}"
            )
        if self.min_pixels * self.max_frames > self.max_total_pixels:
            raise ValueError(
                f"VideoBudget: {self.max_frames} frames of at least {self.min_pixels} pixels need "
                f"{self.min_pixels * self.max_frames} pixels but max_total_pixels={self.max_total_pixels}; "
                "raise max_total_pixels or lower max_frames or min_pixels"
            )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True, eq=False)
class Video:
    """Frames ready for the model and where in the source they came from."""

    frames: np.ndarray  # (T, H, W, 3) uint8; T is a multiple of the temporal patch size
    timestamps: tuple[float, ...]  # seconds into the source, one per frame (padding repeats the last)
    fps: float  # the rate the frames were sampled at, which sets the temporal position spacing
    source_size: tuple[int, int]  # (height, width) before resizing, to map boxes back

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of every frame."""
        return int(self.frames.shape[1]), int(self.frames.shape[2])


class FramePlan(NamedTuple):
    """Which source frames to take, when they were shown, and the resulting sampling rate."""

    indices: list[int]
    timestamps: list[float]
    fps: float


def plan_frames(total_frames: int, source_fps: float, budget: VideoBudget) -> FramePlan:
    """Spread `duration * budget.fps` (or `budget.nframes`) frames evenly over the clip, capped by
    `max_frames`.

    The count is rounded up to a whole temporal patch with real frames while the source has them;
    only clips too short for that repeat their last frame. Each pick is the frame at the middle of
    its slice of the clip, so the first and last second are sampled alike.
    """
    if total_frames < 1:
        raise VideoError("video has no frames; re-encode it or drop the row")
    if not source_fps > 0:
        raise VideoError(f"video reports frame rate {source_fps}; re-encode it with a fixed rate (ffmpeg -r)")
    tps = budget.temporal_patch_size
    wanted = budget.nframes or round(total_frames / source_fps * budget.fps)
    wanted = max(1, min(wanted, total_frames, budget.max_frames))
    real = min(wanted + -wanted % tps, total_frames)
    indices = [math.floor((i + 0.5) * total_frames / real) for i in range(real)]
    indices += indices[-1:] * (-real % tps)
    return FramePlan(indices, [i / source_fps for i in indices], real * source_fps / total_frames)


def video_frame_size(height: int, width: int, num_frames: int, budget: VideoBudget) -> tuple[int, int]:
    """The (height, width) every frame of a video is resized to: the one sizing rule for videos.

    Each frame gets an equal share of `max_total_pixels`, capped by `max_pixels`, and the family's
    video processor's rule (`budget.rule`) snaps it to the patch grid.
    """
    share = min(budget.max_pixels, budget.max_total_pixels // num_frames)
    try:
        return budget.rule(num_frames, height, width, budget, share)
    except ValueError as err:
        raise VideoError(
            f"video frames of {width}x{height} cannot be sized ({err}); crop or pad them"
        ) from err


def video_grid_thw(video: Video, budget: VideoBudget) -> tuple[int, int, int]:
    """(temporal, height, width) patch grid of a fitted video, as the video processor reports it."""
    h, w = video.size
    return len(video.frames) // budget.temporal_patch_size, h // budget.patch_size, w // budget.patch_size


def num_video_tokens(num_frames: int, height: int, width: int, budget: VideoBudget) -> int:
    """Placeholder tokens for a fitted video: one per merged patch of each temporal patch."""
    per_frame = (height // budget.patch_size) * (width // budget.patch_size) // budget.merge_size**2
    return num_frames // budget.temporal_patch_size * per_frame


def video_pad_count(video: Video, budget: VideoBudget) -> int:
    """A video's placeholder as Qwen2-VL and Qwen2.5-VL expand it: one pad per token, no text between."""
    return num_video_tokens(len(video.frames), *video.size, budget)


def timestamped_video_text(video: Video, budget: VideoBudget) -> str:
    """A video's placeholder as Qwen3-VL and Qwen3.5 expand it: each temporal patch is its own
    `<t seconds><|vision_start|>pads<|vision_end|>`, t the mean time of its frames (1 decimal).

    The frames are taken as indices 0.. of a clip shown at `video.fps`, which is how the vLLM engine
    hands them over (`mmrl.rollout.vllm.video_item`), so both engines see the same text."""
    tps = budget.temporal_patch_size
    per_group = num_video_tokens(tps, *video.size, budget)
    groups = len(video.frames) // tps
    text = ""
    for g in range(groups):
        seconds = (g * tps + g * tps + tps - 1) / 2 / video.fps
        text += f"<{seconds:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_group + "<|vision_end|>"
    return text


def read_video(
    source: Any,
    budget: VideoBudget,
    *,
    fps: float | None = None,
    base_dir: str | Path | None = None,
    backend: Backend = "auto",
) -> Video:
    """Decode, sample and size a video from a path, bytes, a dict, or frames.

    Frames are a list (or a (T, H, W, 3) array) of PIL images, HxWx3 uint8 arrays or image paths
    shown at `fps`; without it they are taken to be sampled at `budget.fps` already (files carry
    their own rate, so `fps` applies to frames only). A dict holds the video under `video`, `bytes`
    or `path`, with qwen-vl-utils' keys for this video (`entry_budget`, `entry_keys`). Files go
    through decord and, when decord is missing or fails, PyAV. Anything unusable raises
    `VideoError` naming the source, so the caller can skip and count it.
    """
    entry = source if isinstance(source, dict) else None
    if entry is not None:
        budget = entry_budget(entry, budget)
        source = entry["video"] if entry.get("video") is not None else entry.get("bytes") or entry.get("path")
    if isinstance(source, (list, tuple, np.ndarray)):
        frames, plan = _sample_frame_list(source, budget.fps if fps is None else fps, budget, base_dir)
    else:
        frames, plan = _decode(_file_source(source, base_dir), backend, budget)
    height, width = frames[0].shape[:2]
    try:
        fit_height, fit_width, budget = entry_keys(entry, height, width, budget)
    except ValueError as err:
        raise VideoError(f"video entry: {err}") from None
    size = video_frame_size(fit_height, fit_width, len(plan.indices), budget)
    return Video(_resize(frames, size), tuple(plan.timestamps), plan.fps, (height, width))


def entry_budget(entry: dict[str, Any], budget: VideoBudget) -> VideoBudget:
    """The run's sampling with a row's video entry's `fps` or `nframes`, one or the other, as
    qwen-vl-utils' `smart_nframes` reads them: `fps` replaces data.video_fps (for a list of frames,
    the rate they were taken at), `nframes` takes that many frames evenly over the clip, still at
    most data.video_max_frames. Pixel keys are `entry_keys`'."""
    fps, nframes = entry.get("fps"), entry.get("nframes")
    if fps is not None and nframes is not None:
        raise VideoError(f"video entry gives fps={fps} and nframes={nframes}; give one or the other")
    try:
        if fps is not None:
            if isinstance(fps, bool) or not isinstance(fps, (int, float)):
                raise ValueError(f"fps={fps!r}: use a positive number of frames per second")
            return replace(budget, fps=float(fps))
        return budget if nframes is None else replace(budget, nframes=entry_int(entry, "nframes"))
    except ValueError as err:
        raise VideoError(f"video entry: {err}") from None


def keep_frames_kwargs(video_processor: Any) -> dict[str, Any]:
    """Video processor options that take frames as `read_video` prepared them: no resampling, no resizing."""
    kwargs: dict[str, Any] = {"do_resize": False, "do_sample_frames": False}
    if "cap_pixels_per_frame" in getattr(video_processor.valid_kwargs, "__annotations__", {}):
        kwargs["cap_pixels_per_frame"] = False  # only acts when resizing; set to silence its warning
    return kwargs


def video_pixel_inputs(videos: Sequence[Video], video_processor: Any) -> dict[str, torch.Tensor]:
    """Normalise and patchify with the checkpoint's own video processor, never resizing or resampling.

    Letting the processor resize would let it and the prompt disagree on the token count; the
    returned `second_per_grid_ts` is what `get_rope_index` and `mrope_position_ids` expect.
    """
    kwargs = {**keep_frames_kwargs(video_processor), "return_tensors": "pt"}
    out = video_processor(videos=[v.frames for v in videos], input_data_format="channels_last", **kwargs)
    tps = video_processor.temporal_patch_size
    return {
        "pixel_values_videos": out["pixel_values_videos"],
        "video_grid_thw": out["video_grid_thw"],
        "second_per_grid_ts": torch.tensor([tps / v.fps for v in videos], dtype=torch.float32),
    }


def _file_source(source: Any, base_dir: str | Path | None) -> str | bytes:
    """A readable path or non-empty bytes; empty and missing files fail here, before any decoder."""
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise VideoError("video bytes are empty (0 bytes)")
        return bytes(source)
    if not isinstance(source, (str, Path)):
        raise VideoError(
            f"unsupported video value of type {type(source).__name__}; pass a path, bytes or frames"
        )
    try:
        path = local_path(source, base_dir)
    except ValueError as err:
        raise VideoError(f"cannot read video {source}: {err}") from None
    try:
        size = media_size(path)  # a FIFO or a hung mount must not block
    except FileNotFoundError:
        raise VideoError(f"video {path} does not exist; check the path or data.base_dir") from None
    except OSError as err:
        raise VideoError(f"cannot read video {path}: {err}") from None
    if size == 0:
        raise VideoError(f"video {path} is empty (0 bytes); re-download or drop the row")
    return str(path)


def _decode(src: str | bytes, backend: Backend, budget: VideoBudget) -> tuple[np.ndarray, FramePlan]:
    """Run the chosen decoder; under "auto", decord first and PyAV if decord is absent or fails.

    An explicitly chosen decoder that is not installed raises ImportError: that is a setup
    problem to fix, not a bad video to skip.
    """
    errors = []
    for name in ("decord", "pyav") if backend == "auto" else (backend,):
        handle = src if isinstance(src, str) else io.BytesIO(src)
        try:
            return _DECODERS[name](handle, lambda n, f: plan_frames(n, f, budget))
        except ImportError as err:
            if backend != "auto":
                raise
            errors.append(f"{name} is not installed ({err})")
        except VideoError as err:
            errors.append(f"{name}: {err}")
        except Exception as err:  # decoders raise their own types (DECORDError, av.FFmpegError, ...)
            errors.append(f"{name}: {type(err).__name__}: {err}")
        log.debug("%s failed on %s: %s", name, _name(src), errors[-1])
    raise VideoError(
        f"cannot read video {_name(src)} ({'; '.join(errors)}); the file is corrupt or truncated: "
        "check it plays (ffprobe), re-encode it (ffmpeg -i in -c:v libx264 out.mp4) or drop the row"
    )


def _decode_decord(
    src: str | io.BytesIO, plan: Callable[[int, float], FramePlan]
) -> tuple[np.ndarray, FramePlan]:
    """decord seeks straight to the sampled frames."""
    from decord import VideoReader, cpu

    reader = VideoReader(src, ctx=cpu(0))
    frame_plan = plan(len(reader), reader.get_avg_fps())
    return reader.get_batch(frame_plan.indices).asnumpy(), frame_plan


def _decode_pyav(
    src: str | io.BytesIO, plan: Callable[[int, float], FramePlan]
) -> tuple[np.ndarray, FramePlan]:
    """PyAV decodes in order and converts only the sampled frames to RGB."""
    import av

    with av.open(src) as container:
        if not container.streams.video:
            raise VideoError("file has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate
        total = stream.frames or _count_packets(container, stream)
        frame_plan = plan(total, float(rate) if rate else 0.0)
        wanted = set(frame_plan.indices)
        picked: dict[int, np.ndarray] = {}
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                picked[i] = frame.to_ndarray(format="rgb24")
            if len(picked) == len(wanted):
                break
    if len(picked) < len(wanted):
        raise VideoError(
            f"only {len(picked)} of {len(wanted)} sampled frames decode; the file looks truncated"
        )
    return np.stack([picked[i] for i in frame_plan.indices]), frame_plan


def _count_packets(container: Any, stream: Any) -> int:
    """Frame count for containers that do not store one (mkv, webm): one packet per frame, then rewind."""
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


_Decoder = Callable[[Any, Callable[[int, float], FramePlan]], tuple[np.ndarray, FramePlan]]
_DECODERS: dict[str, _Decoder] = {"decord": _decode_decord, "pyav": _decode_pyav}


def _sample_frame_list(
    frames: Any, fps: float, budget: VideoBudget, base_dir: str | Path | None
) -> tuple[list[np.ndarray], FramePlan]:
    """Frames in memory or image files: sampled by the same plan as decoded files (only the sampled
    files are read)."""
    if len(frames) == 0:
        raise VideoError("video has no frames; pass at least one frame")
    plan = plan_frames(len(frames), fps, budget)
    return [_as_rgb_array(frames[i], i, base_dir) for i in plan.indices], plan


def _as_rgb_array(frame: Any, index: int, base_dir: str | Path | None) -> np.ndarray:
    if isinstance(frame, (str, Path, bytes)):
        try:
            return np.asarray(load_image(frame, base_dir))
        except ImageError as err:
            raise VideoError(f"frame {index}: {err}") from None
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    arr = np.asarray(frame)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise VideoError(
            f"frame {index} is a {arr.dtype} array of shape {arr.shape}; pass HxWx3 uint8 RGB frames, PIL images or image paths"
        )
    return arr


def _resize(frames: Sequence[np.ndarray] | np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """All frames at `size` (bicubic, as `fit_image`), stacked as (T, H, W, 3) uint8."""
    h, w = size
    out = np.empty((len(frames), h, w, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        same = frame.shape[:2] == (h, w)
        out[i] = (
            frame if same else np.asarray(Image.fromarray(frame).resize((w, h), Image.Resampling.BICUBIC))
        )
    return out


def _name(src: str | bytes) -> str:
    return src if isinstance(src, str) else f"<{len(src)} bytes>"
