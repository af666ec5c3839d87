"""Datasets of image prompts: reading rows, turning each into model inputs, skipping bad ones.

Two row layouts are read as they are published. EasyR1: `problem` (text with `<image>` markers),
`answer`, `images`. verl: `prompt` (chat messages, the system one becoming the system prompt),
`reward_model.ground_truth`, `images`, and `extra_info`, whose fields reach rewards in `extra`.

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
from typing import TYPE_CHECKING, Any

from jinja2 import Template
from PIL import Image

from mmrl.data.rows import Row, Rows, RowStream, cache_dir, json_row, read_rows
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
from mmrl.processors.chat import IMAGE_MARKER
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
# Rows per process in `check_rows`: below this, starting worker processes costs more than it saves.
ROWS_PER_CHECK_PROCESS = 8192


class NoUsableRows(ConfigError):
    """A data set none of whose rows can be used: the data or the column names are wrong, so the
    message says what was skipped and why, not that training failed."""


class PreparedRows(list[PromptSample]):
    """Prepared samples (a validation set), with the skip counts of the rows they were drawn from."""

    def __init__(self, samples: list[PromptSample], skipped: Counter[str]) -> None:
        super().__init__(samples)
        self.skipped = skipped


class SkipRow(Exception):
    """Raised while preparing a row; `reason` is the short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# Column defaults of each layout; a dotted key reaches into a struct column.
FORMAT_KEYS: dict[str, tuple[str, str]] = {
    "easyr1": ("problem", "answer"),
    "verl": ("prompt", "reward_model.ground_truth"),
}
# A struct column whose fields are also handed to rewards as top-level `extra` keys, so graders
# find e.g. `choices` wherever a verl-style preprocessing script put it.
LIFTED_COLUMN = "extra_info"


def columns_of(rows: Sequence[Row]) -> set[str]:
    """Every column the rows have."""
    if isinstance(rows, Rows):
        return rows.columns()
    return set().union(*(row.keys() for row, _ in rows if "__bad__" not in row))


def detect_format(columns: set[str]) -> str:
    """`verl` if the rows have `prompt` and `reward_model` columns and no `problem`, else `easyr1`
    (also when neither fits, so skip reasons then name EasyR1's columns)."""
    return "verl" if {"prompt", "reward_model"} <= columns and "problem" not in columns else "easyr1"


def lookup(row: dict[str, Any], key: str) -> Any:
    """Column `key`, or for a dotted key a field inside struct columns; a column named with dots wins."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or value == [] or value == {}


def _message_text(content: Any) -> str:
    """A message's content as text with `<image>` markers: a string, or OpenAI-style parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SkipRow(
            "bad_prompt", f"message content is {type(content).__name__}, not text or a list of parts"
        )
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "image":
            pieces.append(IMAGE_MARKER)
        else:
            raise SkipRow("bad_prompt", f"message part {part!r} is neither text nor an image")
    return "".join(pieces)


def _from_messages(messages: list[Any]) -> tuple[str, str | None]:
    """The user text and the system prompt (None if absent) of a verl-style chat prompt."""
    system: list[str] = []
    user: list[str] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "user"):
            raise SkipRow(
                "bad_prompt", f"prompt message {message!r}: only system and user messages are supported"
            )
        (system if role == "system" else user).append(_message_text(message.get("content")))
    if len(user) != 1:
        raise SkipRow("bad_prompt", f"prompt has {len(user)} user messages; a single-turn prompt needs one")
    return user[0], "\n\n".join(system) or None


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

    `data_format` (`auto`, `easyr1`, `verl`) picks the default prompt and answer columns; a prompt
    value may be text or a list of chat messages in either format. A system message in the row
    overrides `system_prompt`, which applies to rows without one.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        tokenizer: Any,
        image_processor: Any,
        *,
        budget: PixelBudget | None,
        max_prompt_length: int,
        data_format: str = "auto",
        origin: str = "the data",
        prompt_key: str | None = None,
        answer_key: str | None = None,
        image_key: str = "images",
        image_dir: str | None = None,
        system_prompt: str | None = None,
        format_prompt: str | None = None,
        video_key: str = "videos",
        video_budget: VideoBudget | None = None,
        video_processor: Any = None,
        video_placeholder: Callable[[Video, VideoBudget], int | str] = video_pad_count,
        tools: Sequence[dict[str, Any]] = (),
        keep_originals: bool = False,
    ) -> None:
        """`video_placeholder` is the model family's (`Family.video_placeholder`). A text-only
        model's dataset has no image processor and no pixel budget (None). `origin` names the data
        in messages, e.g. `data.train_files (train.jsonl)`. `tools` (JSON schemas) are described in
        every prompt (agent runs); `keep_originals` keeps each image at full size too, for image tools."""
        if data_format not in ("auto", *FORMAT_KEYS):
            raise ConfigError(f"data.format must be auto, easyr1 or verl, got {data_format!r}")
        self.format = detect_format(columns_of(rows)) if data_format == "auto" else data_format
        default_prompt, default_answer = FORMAT_KEYS[self.format]
        self.rows = rows
        self.origin = origin
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.budget = budget
        self.max_prompt_length = max_prompt_length
        self.keys = (prompt_key or default_prompt, answer_key or default_answer, image_key)
        self.video_key, self.video_budget, self.video_processor = video_key, video_budget, video_processor
        self.video_placeholder = video_placeholder
        self.tools, self.keep_originals = list(tools), keep_originals
        self.image_dir = image_dir
        self.system_prompt = system_prompt
        self.template_source = format_prompt
        self.template = Template(format_prompt) if format_prompt else None
        self.bad_rows: dict[int, str] = {}  # row index -> skip reason; each bad row counts once
        self.huge_rows: dict[int, int] = {}  # row index -> its images past PIL's decompression-bomb size
        self.stream: RowStream | None = None  # set for a streamed training set (`from_config`)
        self.checked: dict[int, tuple[str, str]] = {}  # row index -> (reason, detail), by `check_rows`
        self.media_count: int | None = None  # rows naming images or videos, known once checked

    @classmethod
    def from_config(
        cls,
        files: list[str],
        cfg: DataConfig,
        tokenizer: Any,
        image_processor: Any,
        budget: PixelBudget | None,
        video_budget: VideoBudget | None = None,
        video_processor: Any = None,
        video_placeholder: Callable[[Video, VideoBudget], int | str] = video_pad_count,
        key: str = "train_files",
        tools: Sequence[dict[str, Any]] = (),
        keep_originals: bool = False,
    ) -> PromptDataset:
        """The dataset of `files`, data.`key` (train_files or val_files), read and keyed as the `data`
        config section says. Memory-mapped sets of `CHECK_AHEAD_ROWS` or more are checked ahead
        (`check_rows`); a streamed training set (`data.streaming`) keeps its `stream` and holds only its
        first rows, read for the layout."""
        stream = RowStream(files) if cfg.streaming and key == "train_files" else None
        dataset = cls(
            read_rows(files) if stream is None else stream.head(STREAM_HEAD),
            tokenizer,
            image_processor,
            budget=budget,
            max_prompt_length=cfg.max_prompt_length,
            data_format=cfg.format,
            origin=f"data.{key} ({', '.join(map(str, files))})",
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            image_key=cfg.image_key,
            image_dir=cfg.image_dir,
            system_prompt=cfg.system_prompt,
            format_prompt=cfg.format_prompt,
            video_key=cfg.video_key,
            video_budget=video_budget,
            video_processor=video_processor,
            video_placeholder=video_placeholder,
            tools=tools,
            keep_originals=keep_originals,
        )
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
        media = [key for key in (self.keys[2], self.video_key) if key in self.rows.columns()]
        for part, start in zip(self.rows.parts, self.rows.starts, strict=False):
            if not len(part):
                continue
            key = hashlib.sha256(f"{settings}-{part.key}".encode()).hexdigest()[:16]
            done = part.arrow.map(
                _check_batch,
                batched=True,
                fn_kwargs={"dataset": checker, "as_json": part.as_json, "media": media},
                remove_columns=part.table.column_names,
                new_fingerprint=key,
                cache_file_name=os.path.join(cache_dir(), "mmrl_checks", f"{key}.arrow"),
                num_proc=_check_processes(len(part)),
                desc=f"checking {self.origin}",
            ).with_format(None)
            self.media_count += sum(done["media"])
            for i, (reason, detail) in enumerate(zip(done["skip"], done["detail"], strict=True)):
                if reason:
                    self.checked[start + i] = (reason, detail)

    def _settings_key(self) -> str:
        """Everything `_text` reads besides the row: columns, template, length limit, tokenizer."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        fields = (
            CHECKS_VERSION,
            self.format,
            self.keys,
            self.video_key,
            self.max_prompt_length,
            self.system_prompt,
            self.template_source,
            json.dumps(self.tools, sort_keys=True),
            self.budget is None,
            getattr(tok, "chat_template", None),
            hashlib.sha256(vocab.encode()).hexdigest(),
        )
        return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()

    def media_rows(self) -> int:
        """How many rows name images or videos (a text-only model can use none of them)."""
        if self.media_count is None:
            self.media_count = sum(self.has_media(row) for row, _ in self.rows)
        return self.media_count

    def has_media(self, row: dict[str, Any]) -> bool:
        """Whether the row names images or videos."""
        _, _, image_key = self.keys
        return "__bad__" not in row and not (
            _is_empty(lookup(row, image_key)) and _is_empty(lookup(row, self.video_key))
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
            f"{self._layout_hint()}"
        )

    def _layout_hint(self) -> str:
        """When no row has the prompt or answer column (or, with `<image>` markers left unmatched, the
        image column) the config names, the columns the rows do have and the keys that pick them."""
        columns = sorted(columns_of(self.rows))
        names = ("data.prompt_key", "data.answer_key", "data.image_key")
        absent = [
            (name, key)
            for name, key in zip(names, self.keys, strict=True)
            if all(lookup(row, key) is None for row, _ in self.rows)
            and (name != "data.image_key" or "image_marker_mismatch" in self.skipped)
        ]
        if not columns or not absent:
            return ""
        missing = " or ".join(f"{key!r} ({name})" for name, key in absent)
        keys = " and ".join(name for name, _ in absent)
        column = "columns" if len(absent) > 1 else "column"
        return f". No row has a column {missing}; the rows have columns {columns}: point {keys} at the right {column}"

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
        if _is_empty(answer):
            raise SkipRow("missing_answer", f"column {answer_key!r} is missing or empty")
        sources = lookup(row, image_key) or []
        if not isinstance(sources, list):
            sources = [sources]
        if sources and self.budget is None:
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
        self, prompt: _Text, counts: list[int], video_counts: list[int | str], least: bool
    ) -> list[int]:
        """The prompt's token ids with `counts` placeholder tokens per image and video (`least`: lower
        bounds, which only tell a prompt that is too long whatever its media's sizes)."""
        try:
            ids = encode_prompt(self.tokenizer, prompt.messages, counts, video_counts, self.tools)
        except ValueError as err:  # e.g. a literal image-pad token typed into the question
            raise SkipRow("image_marker_mismatch", str(err)) from None
        if len(ids) > self.max_prompt_length:
            tokens = f"{'at least ' if least else ''}{len(ids)} tokens"
            raise SkipRow("prompt_too_long", f"{tokens} > data.max_prompt_length={self.max_prompt_length}")
        return ids

    def _prepare(self, index: int, row: dict[str, Any], folder: Path) -> PromptSample:
        prompt = self._text(row)
        sources = prompt.images
        base = Path(self.image_dir) if self.image_dir else folder
        try:
            images = [load_image(src, base_dir=base) for src in sources]
            self._note_huge(index, images)
            fitted = [fit_image(image, self.budget, src) for image, src in zip(images, sources, strict=True)]
        except ImageError as err:
            raise SkipRow("bad_image", str(err)) from None
        videos = self._videos(prompt.videos, base)
        counts = [num_image_tokens(im.height, im.width, self.budget) for im in fitted]
        video_counts = [self.video_placeholder(v, self.video_budget) for v in videos or []]
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
            originals=images if self.keep_originals else [],
        )
        return with_pixels(sample, videos or [], self.image_processor, self.video_processor)

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
                self.budget.max_pixels if self.budget else 0,
            )
        self.huge_rows[index] = len(huge)

    def _video_sources(self, row: dict[str, Any]) -> list[Any] | None:
        """The row's videos as stored (None: the row has no video column)."""
        sources = lookup(row, self.video_key)
        if sources is None or (isinstance(sources, list) and not sources):
            return sources
        if not isinstance(sources, list) or not isinstance(sources[0], (str, bytes, dict)):
            sources = [sources]  # one video: a path, bytes, or a list of frames
        return sources

    def _videos(self, sources: list[Any] | None, base: Path) -> list[Video] | None:
        """The videos decoded, sampled and sized."""
        if not sources:
            return sources
        if self.video_budget is None or self.video_processor is None:
            raise SkipRow("bad_video", "this dataset was built without a video budget and processor")
        try:
            return [read_video(src, self.video_budget, base_dir=base) for src in sources]
        except VideoError as err:
            raise SkipRow("bad_video", str(err)) from None

    def _prompt(self, row: dict[str, Any]) -> tuple[str, str | None]:
        """The user text and system prompt of a row whose prompt is text or chat messages."""
        key = self.keys[0]
        value = lookup(row, key)
        if isinstance(value, list) and value:
            text, system = _from_messages(value)
        else:
            text, system = value, None
        if not isinstance(text, str) or not text.strip():
            raise SkipRow("missing_prompt", f"column {key!r} is missing, empty or not text or chat messages")
        return text, system or self.system_prompt

    def _extra(self, row: dict[str, Any]) -> dict[str, Any]:
        """Every column the prompt, answer and images were not read from, plus `extra_info`'s fields
        (a column of the same name wins over a lifted field)."""
        used = {key if key in row else key.split(".")[0] for key in (*self.keys, self.video_key)}
        extra = {k: v for k, v in row.items() if k not in used}
        lifted = extra.get(LIFTED_COLUMN)
        return {**lifted, **extra} if isinstance(lifted, dict) else extra

    def prepare_all(self, limit: int | None = None) -> PreparedRows:
        """Every usable row (validation sets are small enough to hold prepared)."""
        indices = range(len(self) if limit is None else min(limit, len(self)))
        return PreparedRows([s for s in (self.prepare(i) for i in indices) if s is not None], self.skipped)


def _check_batch(batch: Any, dataset: PromptDataset, as_json: bool, media: list[str]) -> dict[str, list[Any]]:
    """`check_rows`' work on a batch of rows (an Arrow table): each row's skip reason and detail
    (empty when it passes) and whether it names media."""
    rows = map(json_row, batch["line"].to_pylist()) if as_json else _media_counted(batch, media)
    out: dict[str, list[Any]] = {"skip": [], "detail": [], "media": []}
    for row in rows:
        try:
            dataset._text(row)
            reason, detail = "", ""
        except SkipRow as skip:
            reason, detail = skip.reason, str(skip)
        out["skip"].append(reason)
        out["detail"].append(detail)
        out["media"].append(dataset.has_media(row))
    return out


def _media_counted(batch: Any, media: list[str]) -> list[dict[str, Any]]:
    """The rows of an Arrow batch with each media column's values replaced by stand-ins of the same
    count, read from the list offsets alone: the checks count media but never read them, and this
    way not a byte of an embedded image is paged in (the pass would otherwise touch the whole file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    stand_ins: dict[str, list[Any]] = {}
    for name in media:
        column = batch[name]
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            # A list of lists is one video given as frames (`_video_sources`): keep that shape.
            one = [] if pa.types.is_list(column.type.value_type) else "x"
            lengths = pc.list_value_length(column).to_pylist()
            stand_ins[name] = [None if n is None else [one] * n for n in lengths]
        else:
            stand_ins[name] = ["x" if valid else None for valid in column.is_valid().to_pylist()]
        batch = batch.drop_columns([name])
    rows = batch.to_pylist()
    for name, values in stand_ins.items():
        for row, value in zip(rows, values, strict=True):
            row[name] = value
    return rows


def _check_processes(rows: int) -> int | None:
    processes = min(os.cpu_count() or 1, rows // ROWS_PER_CHECK_PROCESS)
    return processes if processes > 1 else None
