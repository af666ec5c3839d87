"""The prompt data's section: the files, their row layout, and how prompts, images and videos are sized."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mmrl.config.base import Section


class DataConfig(Section):
    train_files: list[str] = Field(
        [],
        description="jsonl/json/parquet/arrow files, dataset folders (save_to_disk or split files), "
        "or FOLDER@SPLIT; required unless an env section makes episodes the data",
    )
    val_files: list[str] = Field(
        [], description="Validation files or FOLDER@SPLIT, in the formats of train_files"
    )
    image_dir: str | None = Field(
        None, description="Base folder for relative image paths (default: the file's, or the named folder)"
    )
    format: Literal["auto", "easyr1", "verl"] = Field(
        "auto",
        description="Row layout; auto: verl if there are prompt and reward_model columns and no problem",
    )
    prompt_key: str | None = Field(
        None,
        description="Text or chat-messages column (default: problem, or prompt for verl); a.b reaches a field",
    )
    answer_key: str | None = Field(
        None, description="Ground-truth column (default: answer, or reward_model.ground_truth for verl)"
    )
    image_key: str = Field("images", description="Column holding each row's images")
    video_key: str = Field(
        "videos",
        description="Column of videos: a path, bytes or {bytes|path}, or a list of them; <video> marks each",
    )
    system_prompt: str | None = Field(
        None, description="For rows whose prompt has no system message of its own"
    )
    format_prompt: str | None = Field(
        None, description="Jinja template around the prompt, with {{ content }}"
    )
    max_prompt_length: int = Field(
        1024, gt=0, description="Tokens, images included; longer prompts are skipped"
    )
    min_pixels: int = Field(28 * 28, gt=0, description="Images are resized up to at least this many pixels")
    max_pixels: int = Field(
        1024 * 28 * 28, gt=0, description="Images are resized down to at most this many pixels"
    )
    video_fps: float = Field(2.0, gt=0, description="Frames sampled per second of video")
    video_max_frames: int = Field(
        32, gt=0, description="At most this many frames per video (a multiple of 2)"
    )
    video_min_pixels: int = Field(128 * 28 * 28, gt=0, description="Per frame")
    video_max_pixels: int = Field(768 * 28 * 28, gt=0, description="Per frame")
    video_max_total_pixels: int = Field(
        4096 * 28 * 28, gt=0, description="Over all frames of a video: longer clips get smaller frames"
    )
    train_batch_size: int = Field(
        8,
        gt=0,
        description="Prompts per training step (with an env: initial states, each run rollout.n times)",
    )
    val_batch_size: int = Field(64, gt=0, description="Prompts per validation generation call")
    max_val_samples: int | None = Field(
        None, gt=0, description="Validate on the first N rows only; None: all"
    )
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch")
    streaming: bool = Field(
        False,
        description="Read train_files one row at a time as training goes, without converting or caching "
        "them (data larger than the disk, hub ids not worth caching whole); resume replays the epoch's rows",
    )
    prefetch: bool = Field(
        True,
        description="Prepare the next training batch (images decoded, sized, tokenized) on a background "
        "thread while the current step runs; the batches are the same either way",
    )
    shuffle_buffer: int = Field(
        10_000,
        gt=0,
        description="With streaming: rows held to shuffle from (a seeded buffer, as in datasets)",
    )

    @model_validator(mode="before")
    @classmethod
    def _files_as_lists(cls, values: Any) -> Any:
        for key in ("train_files", "val_files"):
            if isinstance(values, dict) and isinstance(values.get(key), str):
                values[key] = [values[key]]
        return values

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError("data.min_pixels must not exceed data.max_pixels")
        return self
