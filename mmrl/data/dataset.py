"""Datasets of image prompts: reading rows, turning each into model inputs, skipping bad ones.

Rows come in EasyR1's or verl's layout (`mmrl.data.layouts`), read as they are published.

A row that cannot be used (unreadable image, missing column, prompt over the token budget,
marker/image mismatch) is skipped with a named reason. Reasons are counted and the first of
each kind is logged, so a bad corpus shows up in the metrics instead of crashing the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jinja2 import Template
from PIL import Image

from mmrl.data.checks import check_batch, check_processes
from mmrl.data.layouts import (
    FORMAT_KEYS,
    LIFTED_COLUMN,
    SkipRow,
    columns_of,
    detect_format,
    from_messages,
    is_empty,
    layout_hint,
    lookup,
)
from mmrl.data.rows import Row, Rows, RowStream, cache_dir, read_rows
from mmrl.data.sample import PromptSample
from mmrl.errors import ConfigError
from mmrl.models import family_of
from mmrl.processors import (
    ImageError,
    PixelBudget,
    Video,
    VideoBudget,
    VideoError,
    build_messages,
    encode_prompt,
    fit_image,
    is_huge,
    load_image,
    num_image_tokens,
    pixel_inputs,
    read_video,
    video_pad_count,
    video_pixel_inputs,
)
from mmrl.processors.chat import IMAGE_PAD, VIDEO_PAD
from mmrl.rewards import ImageSize

if TYPE_CHECKING:
    from mmrl.config import DataConfig

log = logging.getLogger("mmrl.data.dataset")


def image_budget(cfg: DataConfig, model_config: Any) -> PixelBudget:
    """`data.min_pixels`/`max_pixels` on the checkpoint's own patch and merge sizes, sized by its
    image processor's own rule."""
    family = family_of(model_config)
    grid = family.grid()
    return PixelBudget(cfg.min_pixels, cfg.max_pixels, grid.patch, grid.merge, family.image_size_rule)


# A streamed set's layout (easyr1 or verl) is read from its first rows.
STREAM_HEAD = 1000
# Bump when `PromptDataset._text` changes what it checks: cached check results then no longer apply.
CHECKS_VERSION = 1
# Below this many rows the lazy checks of each batch cost less than a pass over all rows.
CHECK_AHEAD_ROWS = 10_000


class NoUsableRows(ConfigError):
    """A data set none of whose rows can be used: the data or the column names are wrong, so the
    message says what was skipped and why, not that training failed."""


class PreparedRows(list[PromptSample]):
    """Prepared samples (a validation set), with the skip counts of the rows they were drawn from."""

    def __init__(self, samples: list[PromptSample], skipped: Counter[str]) -> None:
        super().__init__(samples)
        self.skipped = skipped


def with_pixels(
    sample: PromptSample, videos: list[Video], image_processor: Any, video_processor: Any
) -> PromptSample:
    """`sample` with the model's inputs for its fitted images and for `videos` (sampled and sized): pixel
    patches, grids and, for videos, seconds per temporal patch."""
    if sample.images:
        inputs = pixel_inputs(sample.images, image_processor)
        sample.pixel_values, sample.image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
    if videos:
        v = video_pixel_inputs(videos, video_processor)
        sample.videos = videos
        sample.pixel_values_videos, sample.video_grid_thw = v["pixel_values_videos"], v["video_grid_thw"]
        sample.second_per_grid_ts = v["second_per_grid_ts"]
    return sample


@dataclass(frozen=True)
class PromptInputs:
    """What turns rows into a model's inputs besides the `data` section, all of it the model's or the
    run's: its tokenizer, its image and video processors and the pixel budgets sized on its grid, its
    family's video placeholder (`Family.video_placeholder`), image and video pad tokens as its chat
    template writes them (`Family.media_pads`) and image placeholder (`Family.image_placeholder`), and for
    agent runs the tools (JSON schemas) described in every prompt and whether each image is kept at full
    size too, for image tools. A text-only model's inputs are its tokenizer alone: no image processor and no pixel budget."""

    tokenizer: Any
    image_processor: Any = None
    budget: PixelBudget | None = None
    video_budget: VideoBudget | None = None
    video_processor: Any = None
    video_placeholder: Callable[[Video, VideoBudget], int | str] = video_pad_count
    media_pads: tuple[str, str] = (IMAGE_PAD, VIDEO_PAD)
    image_placeholder: Callable[[int, int, PixelBudget], int | str] = num_image_tokens
    tools: Sequence[dict[str, Any]] = ()
    keep_originals: bool = False


@dataclass
class _Text:
    """A row's parts that are read without decoding media; `messages` hold the media markers."""

    text: str
    answer: Any
    images: list[Any]
    videos: list[Any] | None
    messages: list[dict[str, Any]]


class PromptDataset:
    """Rows plus everything needed to turn one into a `PromptSample`.

    `data.format` (`auto`, `easyr1`, `verl`) picks the default prompt and answer columns; a prompt
    value may be text or a list of chat messages in either format. A system message in the row
    overrides `data.system_prompt`, which applies to rows without one.
    """

    def __init__(
        self, rows: Sequence[Row], cfg: DataConfig, inputs: PromptInputs, origin: str = "the data"
    ) -> None:
        """Rows read and keyed as the `data` section `cfg` says, turned into `inputs`' model inputs.
        `origin` names the data in messages, e.g. `data.train_files (train.jsonl)`."""
        if cfg.format not in ("auto", *FORMAT_KEYS):
            raise ConfigError(f"data.format must be auto, easyr1 or verl, got {cfg.format!r}")
        self.format = detect_format(columns_of(rows)) if cfg.format == "auto" else cfg.format
        default_prompt, default_answer = FORMAT_KEYS[self.format]
        self.rows = rows
        self.cfg, self.inputs = cfg, inputs
        self.origin = origin
        self.keys = (cfg.prompt_key or default_prompt, cfg.answer_key or default_answer, cfg.image_key)
        self.template = Template(cfg.format_prompt) if cfg.format_prompt else None
        self.bad_rows: dict[int, str] = {}  # row index -> skip reason; each bad row counts once
        self.huge_rows: dict[int, int] = {}  # row index -> its images past PIL's decompression-bomb size
        self.stream: RowStream | None = None  # set for a streamed training set (`from_config`)
        self.checked: dict[int, tuple[str, str]] = {}  # row index -> (reason, detail), by `check_rows`
        self.media_count: int | None = None  # rows naming images or videos, known once checked

    @classmethod
    def from_config(
        cls, cfg: DataConfig, inputs: PromptInputs, key: Literal["train_files", "val_files"] = "train_files"
    ) -> PromptDataset:
        """The dataset of data.`key`'s files, read and keyed as the `data` config section says.
        Memory-mapped sets of `CHECK_AHEAD_ROWS` or more are checked ahead (`check_rows`); a streamed
        training set (`data.streaming`) keeps its `stream` and holds only its first rows, read for the
        layout."""
        files = getattr(cfg, key)
        stream = RowStream(files) if cfg.streaming and key == "train_files" else None
        rows = read_rows(files) if stream is None else stream.head(STREAM_HEAD)
        dataset = cls(rows, cfg, inputs, origin=f"data.{key} ({', '.join(map(str, files))})")
        dataset.stream = stream
        if stream is None and len(dataset) >= CHECK_AHEAD_ROWS:
            dataset.check_rows()
        return dataset

    def check_rows(self) -> None:
        """Make every check that decodes no media (`_text`) once for all memory-mapped rows, with
        `datasets`' `map` (in several processes for large sets), and cache the results in `datasets`'
        cache, keyed on the rows' content and on every setting the checks read: the next run on the
        same files starts without redoing them. A row that fails is still skipped and counted when
        its turn comes, as without this pass; a set with no row left is refused before training."""
        if not isinstance(self.rows, Rows):
            return
        checker = copy.copy(self)
        checker.rows = []  # the worker processes need the settings, not the rows
        settings = self._settings_key()
        self.media_count = 0
        media = [key for key in (self.keys[2], self.cfg.video_key) if key in self.rows.columns()]
        for part, start in zip(self.rows.parts, self.rows.starts, strict=False):
            if not len(part):
                continue
            key = hashlib.sha256(f"{settings}-{part.key}".encode()).hexdigest()[:16]
            done = part.arrow.map(
                check_batch,
                batched=True,
                fn_kwargs={
                    "check": checker._text,
                    "has_media": checker.has_media,
                    "as_json": part.as_json,
                    "media": media,
                },
                remove_columns=part.table.column_names,
                new_fingerprint=key,
                cache_file_name=os.path.join(cache_dir(), "mmrl_checks", f"{key}.arrow"),
                num_proc=check_processes(len(part)),
                desc=f"checking {self.origin}",
            ).with_format(None)
            self.media_count += sum(done["media"])
            for i, (reason, detail) in enumerate(zip(done["skip"], done["detail"], strict=True)):
                if reason:
                    self.checked[start + i] = (reason, detail)

    def _settings_key(self) -> str:
        """Everything `_text` reads besides the row: columns, template, length limit, tokenizer."""
        tok = self.inputs.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        fields = (
            CHECKS_VERSION,
            self.format,
            self.keys,
            self.cfg.video_key,
            self.cfg.max_prompt_length,
            self.cfg.system_prompt,
            self.cfg.format_prompt,
            json.dumps(self.inputs.tools, sort_keys=True),
            self.inputs.budget is None,
            getattr(tok, "chat_template", None),
            hashlib.sha256(vocab.encode()).hexdigest(),
        )
        return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()

    def media_rows(self) -> int:
        """How many rows name images or videos (a text-only model can use none of them)."""
        if self.media_count is None:
            self.media_count = sum(self.has_media(row) for row, _ in self.rows)
        return self.media_count

    def rows_by_media(self) -> dict[str, int]:
        """How many rows name images and how many videos: a family may take only one kind, or not both in
        one `generate` call."""
        _, _, image_key = self.keys
        counts = {"image": 0, "video": 0}
        for row, _ in self.rows:  # one row at a time: a row may hold its images' bytes
            if "__bad__" not in row:
                counts["image"] += not is_empty(lookup(row, image_key))
                counts["video"] += not is_empty(lookup(row, self.cfg.video_key))
        return counts

    def has_media(self, row: dict[str, Any]) -> bool:
        """Whether the row names images or videos."""
        _, _, image_key = self.keys
        return "__bad__" not in row and not (
            is_empty(lookup(row, image_key)) and is_empty(lookup(row, self.cfg.video_key))
        )

    @property
    def skipped(self) -> Counter[str]:
        """How many distinct rows were skipped, by reason."""
        return Counter(self.bad_rows.values())

    @property
    def huge_images(self) -> int:
        """How many images past PIL's decompression-bomb size the rows read so far hold."""
        return sum(self.huge_rows.values())

    def unusable(self) -> NoUsableRows:
        """The error for data none of whose rows could be used: the skip counts by reason, and the
        columns to name when the rows look like another layout."""
        if not self.rows:
            return NoUsableRows(f"{self.origin} is empty: it holds no rows; point it at a file with data")
        bad = {i: reason for i, (reason, _) in self.checked.items()} | self.bad_rows
        counts = ", ".join(f"{reason} {n}" for reason, n in Counter(bad.values()).most_common())
        return NoUsableRows(
            f"{self.origin}: no usable row; all {len(bad)} rows read were skipped ({counts})"
            f"{layout_hint(self.rows, self.keys, 'image_marker_mismatch' in self.skipped)}"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def prepare(self, index: int, streamed: Row | None = None) -> PromptSample | None:
        """The sample for row `index` (`streamed`: the row itself, read from `stream`), or None if
        unusable: recorded once, and logged for the first row of each reason; a known-bad row is not
        read again."""
        if index in self.bad_rows:
            return None
        try:
            if index in self.checked:
                raise SkipRow(*self.checked[index])
            row, folder = self.rows[index] if streamed is None else streamed
            return self._prepare(index, row, folder)
        except SkipRow as skip:
            if skip.reason not in self.bad_rows.values():
                log.warning(
                    "skipping row %d (%s): %s; further rows like it are only counted",
                    index,
                    skip.reason,
                    skip,
                )
            self.bad_rows[index] = skip.reason
            return None

    def _text(self, row: dict[str, Any]) -> _Text:
        """The row's text, answer and media sources, after every check that decodes no media: the
        same checks `check_rows` makes once for all rows, so a row is skipped for the same reason
        whether it was checked ahead or is read lazily."""
        if "__bad__" in row:
            raise SkipRow("bad_row", row["__bad__"])
        _, answer_key, image_key = self.keys
        text, system = self._prompt(row)
        answer = lookup(row, answer_key)
        if is_empty(answer):
            raise SkipRow("missing_answer", f"column {answer_key!r} is missing or empty")
        sources = lookup(row, image_key) or []
        if not isinstance(sources, list):
            sources = [sources]
        if sources and self.inputs.budget is None:
            raise SkipRow(
                "bad_image", "this dataset was built without an image processor (a text-only model)"
            )
        videos = self._video_sources(row)
        if self.template is not None:
            text = self.template.render(content=text)
        try:  # rows without a video column keep a literal "<video>" as text
            messages = build_messages(
                text, len(sources), system, num_videos=None if videos is None else len(videos)
            )
        except ValueError as err:
            raise SkipRow("image_marker_mismatch", str(err)) from None
        prompt = _Text(text, answer, sources, videos, messages)
        # Each image and video takes at least one token: a prompt too long with that is too long.
        self._encode(prompt, [1] * len(sources), [1] * len(videos or []), least=True)
        return prompt

    def _encode(
        self, prompt: _Text, counts: list[int | str], video_counts: list[int | str], least: bool
    ) -> list[int]:
        """The prompt's token ids with `counts` placeholder tokens per image and video (`least`: lower
        bounds, which only tell a prompt that is too long whatever its media's sizes)."""
        try:
            ids = encode_prompt(
                self.inputs.tokenizer,
                prompt.messages,
                counts,
                video_counts,
                self.inputs.tools,
                self.inputs.media_pads,
            )
        except ValueError as err:  # e.g. a literal image-pad token typed into the question
            raise SkipRow("image_marker_mismatch", str(err)) from None
        if len(ids) > self.cfg.max_prompt_length:
            tokens = f"{'at least ' if least else ''}{len(ids)} tokens"
            raise SkipRow(
                "prompt_too_long", f"{tokens} > data.max_prompt_length={self.cfg.max_prompt_length}"
            )
        return ids

    def _prepare(self, index: int, row: dict[str, Any], folder: Path) -> PromptSample:
        prompt = self._text(row)
        sources = prompt.images
        base = Path(self.cfg.image_dir) if self.cfg.image_dir else folder
        try:
            images = [load_image(src, base_dir=base) for src in sources]
            self._note_huge(index, images)
            fitted = [
                fit_image(image, self.inputs.budget, src) for image, src in zip(images, sources, strict=True)
            ]
        except ImageError as err:
            raise SkipRow("bad_image", str(err)) from None
        videos = self._videos(prompt.videos, base)
        counts = [self.inputs.image_placeholder(im.height, im.width, self.inputs.budget) for im in fitted]
        video_counts = [self.inputs.video_placeholder(v, self.inputs.video_budget) for v in videos or []]
        sample = PromptSample(
            row_id=index,
            prompt_ids=self._encode(prompt, counts, video_counts, least=False),
            prompt_text=prompt.text,
            ground_truth=prompt.answer,
            images=fitted,
            image_sizes=[
                ImageSize(original=o.size, model_input=f.size) for o, f in zip(images, fitted, strict=True)
            ],
            extra=self._extra(row),
            originals=images if self.inputs.keep_originals else [],
        )
        return with_pixels(sample, videos or [], self.inputs.image_processor, self.inputs.video_processor)

    def _note_huge(self, index: int, images: list[Image.Image]) -> None:
        """Count images past PIL's decompression-bomb size, logging the first: they are used, but
        decoding them costs far more than the small model input they become."""
        huge = [image for image in images if is_huge(image)]
        if not huge:
            return
        if not self.huge_rows:
            log.warning(
                "%s row %d: a %dx%d image (%.0f megapixels) is far larger than the model sees (at most "
                "data.max_pixels=%d); it is used, but decoding it is slow and takes much memory. Shrink "
                "such images before training; further ones are only counted (data/huge_images)",
                self.origin,
                index,
                huge[0].width,
                huge[0].height,
                huge[0].width * huge[0].height / 1e6,
                self.inputs.budget.max_pixels if self.inputs.budget else 0,
            )
        self.huge_rows[index] = len(huge)

    def _video_sources(self, row: dict[str, Any]) -> list[Any] | None:
        """The row's videos as stored (None: the row has no video column)."""
        sources = lookup(row, self.cfg.video_key)
        if sources is None or (isinstance(sources, list) and not sources):
            return sources
        if not isinstance(sources, list) or not isinstance(sources[0], (str, bytes, dict)):
            sources = [sources]  # one video: a path, bytes, or a list of frames
        return sources

    def _videos(self, sources: list[Any] | None, base: Path) -> list[Video] | None:
        """The videos decoded, sampled and sized."""
        if not sources:
            return sources
        if self.inputs.video_budget is None or self.inputs.video_processor is None:
            raise SkipRow("bad_video", "this dataset was built without a video budget and processor")
        try:
            return [read_video(src, self.inputs.video_budget, base_dir=base) for src in sources]
        except VideoError as err:
            raise SkipRow("bad_video", str(err)) from None

    def _prompt(self, row: dict[str, Any]) -> tuple[str, str | None]:
        """The user text and system prompt of a row whose prompt is text or chat messages."""
        key = self.keys[0]
        value = lookup(row, key)
        if isinstance(value, list) and value:
            text, system = from_messages(value)
        else:
            text, system = value, None
        if not isinstance(text, str) or not text.strip():
            raise SkipRow("missing_prompt", f"column {key!r} is missing, empty or not text or chat messages")
        return text, system or self.cfg.system_prompt

    def _extra(self, row: dict[str, Any]) -> dict[str, Any]:
        """Every column the prompt, answer and images were not read from, plus `extra_info`'s fields
        (a column of the same name wins over a lifted field)."""
        used = {key if key in row else key.split(".")[0] for key in (*self.keys, self.cfg.video_key)}
        extra = {k: v for k, v in row.items() if k not in used}
        lifted = extra.get(LIFTED_COLUMN)
        return {**lifted, **extra} if isinstance(lifted, dict) else extra

    def prepare_all(self, limit: int | None = None) -> PreparedRows:
        """Every usable row (validation sets are small enough to hold prepared)."""
        indices = range(len(self) if limit is None else min(limit, len(self)))
        return PreparedRows([s for s in (self.prepare(i) for i in indices) if s is not None], self.skipped)
