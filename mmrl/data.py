"""Datasets of image prompts: reading rows, turning each into model inputs, skipping bad ones.

Two row layouts are read as they are published. EasyR1: `problem` (text with `<image>` markers),
`answer`, `images`. verl: `prompt` (chat messages, the system one becoming the system prompt),
`reward_model.ground_truth`, `images`, and `extra_info`, whose fields reach rewards in `extra`.

A row that cannot be used (unreadable image, missing column, prompt over the token budget,
marker/image mismatch) is skipped with a named reason. Reasons are counted and the first of
each kind is logged, so a bad corpus shows up in the metrics instead of crashing the run.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from jinja2 import Template
from PIL import Image

from mmrl.config import ConfigError
from mmrl.models import family_of
from processors import (
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
from processors.chat import IMAGE_MARKER
from rewards import ImageSize

if TYPE_CHECKING:
    from mmrl.config import DataConfig

log = logging.getLogger("mmrl.data")


@dataclass
class PromptSample:
    """One prompt, ready for rollout and training; built once per step and shared by its n responses."""

    row_id: int
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    images: list[Image.Image] = field(default_factory=list)
    image_sizes: list[ImageSize] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    videos: list[Video] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # seconds per temporal patch, one per video


def image_budget(cfg: DataConfig, model_config: Any) -> PixelBudget:
    """`data.min_pixels`/`max_pixels` on the checkpoint's own patch and merge sizes."""
    grid = family_of(model_config).grid()
    return PixelBudget(cfg.min_pixels, cfg.max_pixels, grid.patch, grid.merge)


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


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# Metadata that sits beside data files: `save_to_disk` bookkeeping and `mmrl data synth`'s summary.
_NOT_DATA = {"dataset_info.json", "state.json", "dataset_dict.json", "meta.json"}
_SHARD_STEM = re.compile(r"([A-Za-z]\w*?)(?:-\d+-of-\d+)?")


def read_rows(files: list[str]) -> list[tuple[dict[str, Any], Path]]:
    """All rows of the named data, each with the folder its relative image paths start from.

    Each entry is a file (.jsonl, .json, .parquet, .arrow), a dataset folder, or `FOLDER@SPLIT`
    (see `resolve_data`). Relative image paths start from a file's folder, or from a named folder.
    """
    rows: list[tuple[dict[str, Any], Path]] = []
    for spec in files:
        base, paths = resolve_data(spec)
        for path in paths:
            rows += [(record, base) for record in _read_file(path)]
    return rows


def resolve_data(spec: str) -> tuple[Path, list[Path]]:
    """The base folder and data files that `spec` names, or an error that says how to fix it.

    `spec` is a data file; a folder saved with `datasets.save_to_disk` or holding split files
    (`data/train-00000-of-00001.parquet`, `train.jsonl`, `test/0000.parquet`); either with
    `@SPLIT`; or a hub name `OWNER/NAME@SPLIT`, found only in the local hub cache, since mmrl
    reads local files and never downloads.
    """
    name, split = spec, None
    if not Path(spec).exists() and "@" in spec:
        name, _, split = spec.rpartition("@")
    path = Path(name)
    if not path.exists():
        snapshot = _hub_snapshot(name)
        if snapshot is None:
            raise _missing(spec, name)
        path = snapshot
    if path.is_dir():
        return path, _split_files(path, split, spec)
    if split is not None:
        raise ConfigError(f"data {spec}: @{split} picks a split of a dataset folder, but {name} is a file")
    return path.parent, [path]


def _missing(spec: str, name: str) -> FileNotFoundError:
    hint = ""
    if not Path(name).suffix:
        local = f"data/{Path(name).name}"
        hint = (
            f"; if {name!r} is a Hugging Face hub dataset, download it first (mmrl reads local files only), "
            f"e.g. `huggingface-cli download --repo-type dataset {name} --local-dir {local}`, "
            f"then name the folder: {local}@train"
        )
    return FileNotFoundError(
        f"data file {spec} does not exist (check data.train_files / data.val_files){hint}"
    )


def _hub_snapshot(name: str) -> Path | None:
    """The local hub cache's snapshot of dataset `name` (what `huggingface-cli download` fills)."""
    if name.count("/") != 1:
        return None
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    repo = Path(os.environ.get("HF_HUB_CACHE", home / "hub")) / f"datasets--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
    return snapshot if snapshot.is_dir() else None


def _split_files(folder: Path, split: str | None, spec: str) -> list[Path]:
    """The data files of one split of a dataset folder."""
    if (folder / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: one folder per split
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        chosen = _pick_split(splits, split, spec)
        return _split_files(folder / chosen, None, f"{spec}/{chosen}")
    if (folder / "state.json").is_file():  # save_to_disk of one Dataset
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        if split is not None and split != state.get("_split"):
            raise ConfigError(
                f"data {spec}: {folder} holds a single split ({state.get('_split')}); drop @{split}"
            )
        return [folder / entry["filename"] for entry in state["_data_files"]]
    by_split: dict[str, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES):
        rel = path.relative_to(folder)
        if path.name not in _NOT_DATA and not _hidden(rel):
            by_split.setdefault(_split_name(rel), []).append(path)
    return by_split[_pick_split(sorted(by_split), split, spec)]


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _split_name(rel: Path) -> str:
    """`train` for `train.jsonl`, `data/train-00000-of-00002.parquet` and `train/0000.parquet`."""
    match = _SHARD_STEM.fullmatch(rel.stem)
    return match.group(1) if match else rel.parent.name


def _pick_split(splits: list[str], split: str | None, spec: str) -> str:
    if not splits:
        raise ConfigError(f"data {spec}: no data files ({', '.join(DATA_SUFFIXES)}) in this folder")
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None:
        raise ConfigError(f"data {spec}: the folder has splits {splits}; name one, e.g. {spec}@{splits[0]}")
    if split not in splits:
        raise ConfigError(f"data {spec}: no split {split!r}; the folder has {splits}")
    return split


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".json":
        return _read_json(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".arrow":
        return _read_arrow(path)
    raise ConfigError(
        f"data file {path}: unsupported format {path.suffix!r}; use {', '.join(DATA_SUFFIXES)} or a folder"
    )


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON list of row objects, or JSON lines saved as .json (as the hub's json loader allows)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        return [_json_or_bad(line) for line in text.splitlines() if line.strip()]
    if isinstance(loaded, dict):
        return [loaded]  # a single row: JSON lines with one line
    if not isinstance(loaded, list):
        raise ConfigError(f"data file {path}: a .json data file holds a list of row objects")
    return [r if isinstance(r, dict) else {"__bad__": "row is not a JSON object"} for r in loaded]


def _read_arrow(path: Path) -> list[dict[str, Any]]:
    """An Arrow IPC file: the stream format `save_to_disk` writes, or the random-access file format."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all().to_pylist()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all().to_pylist()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One row per non-blank line; a leading byte-order mark (Windows editors) is dropped.

    A line that is not UTF-8 becomes a bad row rather than being decoded with replacement
    characters, which would train on silently garbled text."""
    rows = []
    for raw in path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines():
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            rows.append(
                {"__bad__": f"line is not UTF-8 ({err.reason} at byte {err.start}); save the file as UTF-8"}
            )
            continue
        if line.strip():
            rows.append(_json_or_bad(line))
    return rows


def _json_or_bad(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        return {"__bad__": f"invalid JSON: {err}"}
    return value if isinstance(value, dict) else {"__bad__": "line is not a JSON object"}


# Column defaults of each layout; a dotted key reaches into a struct column.
FORMAT_KEYS: dict[str, tuple[str, str]] = {
    "easyr1": ("problem", "answer"),
    "verl": ("prompt", "reward_model.ground_truth"),
}
# A struct column whose fields are also handed to rewards as top-level `extra` keys, so graders
# find e.g. `choices` wherever a verl-style preprocessing script put it.
LIFTED_COLUMN = "extra_info"


def detect_format(rows: list[tuple[dict[str, Any], Path]]) -> str:
    """`verl` if the rows have `prompt` and `reward_model` columns and no `problem`, else `easyr1`
    (also when neither fits, so skip reasons then name EasyR1's columns)."""
    columns: set[str] = set().union(*(row.keys() for row, _ in rows))
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


class PromptDataset:
    """Rows plus everything needed to turn one into a `PromptSample`.

    `data_format` (`auto`, `easyr1`, `verl`) picks the default prompt and answer columns; a prompt
    value may be text or a list of chat messages in either format. A system message in the row
    overrides `system_prompt`, which applies to rows without one.
    """

    def __init__(
        self,
        rows: list[tuple[dict[str, Any], Path]],
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
    ) -> None:
        """`video_placeholder` is the model family's (`Family.video_placeholder`). A text-only
        model's dataset has no image processor and no pixel budget (None). `origin` names the data
        in messages, e.g. `data.train_files (train.jsonl)`."""
        if data_format not in ("auto", *FORMAT_KEYS):
            raise ConfigError(f"data.format must be auto, easyr1 or verl, got {data_format!r}")
        self.format = detect_format(rows) if data_format == "auto" else data_format
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
        self.image_dir = image_dir
        self.system_prompt = system_prompt
        self.template = Template(format_prompt) if format_prompt else None
        self.bad_rows: dict[int, str] = {}  # row index -> skip reason; each bad row counts once
        self.huge_rows: dict[int, int] = {}  # row index -> its images past PIL's decompression-bomb size

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
    ) -> PromptDataset:
        """The dataset of `files`, data.`key` (train_files or val_files), read and keyed as the `data`
        config section says."""
        return cls(
            read_rows(files),
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
        )

    def media_rows(self) -> int:
        """How many rows name images or videos (a text-only model can use none of them)."""
        _, _, image_key = self.keys
        return sum(
            1
            for row, _ in self.rows
            if "__bad__" not in row
            and not (_is_empty(lookup(row, image_key)) and _is_empty(lookup(row, self.video_key)))
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
        counts = ", ".join(f"{reason} {n}" for reason, n in self.skipped.most_common())
        return NoUsableRows(
            f"{self.origin}: no usable row; all {len(self.bad_rows)} rows read were skipped ({counts})"
            f"{self._layout_hint()}"
        )

    def _layout_hint(self) -> str:
        """When no row has the prompt or answer column (or, with `<image>` markers left unmatched, the
        image column) the config names, the columns the rows do have and the keys that pick them."""
        columns = sorted(set().union(*(row.keys() for row, _ in self.rows if "__bad__" not in row)))
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

    def prepare(self, index: int) -> PromptSample | None:
        """The sample for row `index`, or None if unusable: recorded once, and logged for the
        first row of each reason; a known-bad row is not read again."""
        if index in self.bad_rows:
            return None
        try:
            return self._prepare(index)
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

    def _prepare(self, index: int) -> PromptSample:
        row, folder = self.rows[index]
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
        base = Path(self.image_dir) if self.image_dir else folder
        if sources and self.budget is None:
            raise SkipRow(
                "bad_image", "this dataset was built without an image processor (a text-only model)"
            )
        try:
            images = [load_image(src, base_dir=base) for src in sources]
            self._note_huge(index, images)
            fitted = [fit_image(image, self.budget) for image in images]
        except ImageError as err:
            raise SkipRow("bad_image", str(err)) from None
        videos = self._videos(row, base)
        if self.template is not None:
            text = self.template.render(content=text)
        try:  # rows without a video column keep a literal "<video>" as text
            messages = build_messages(
                text, len(fitted), system, num_videos=None if videos is None else len(videos)
            )
        except ValueError as err:
            raise SkipRow("image_marker_mismatch", str(err)) from None
        counts = [num_image_tokens(im.height, im.width, self.budget) for im in fitted]
        video_counts = [self.video_placeholder(v, self.video_budget) for v in videos or []]
        try:
            ids = encode_prompt(self.tokenizer, messages, counts, video_counts)
        except ValueError as err:  # e.g. a literal image-pad token typed into the question
            raise SkipRow("image_marker_mismatch", str(err)) from None
        if len(ids) > self.max_prompt_length:
            raise SkipRow(
                "prompt_too_long", f"{len(ids)} tokens > data.max_prompt_length={self.max_prompt_length}"
            )
        sample = PromptSample(
            row_id=index,
            prompt_ids=ids,
            prompt_text=text,
            ground_truth=answer,
            images=fitted,
            image_sizes=[
                ImageSize(original=o.size, model_input=f.size) for o, f in zip(images, fitted, strict=True)
            ],
            extra=self._extra(row),
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

    def _videos(self, row: dict[str, Any], base: Path) -> list[Video] | None:
        """The row's videos decoded, sampled and sized (None: the row has no video column)."""
        sources = lookup(row, self.video_key)
        if sources is None:
            return None
        if isinstance(sources, list) and not sources:
            return []
        if self.video_budget is None or self.video_processor is None:
            raise SkipRow("bad_video", "this dataset was built without a video budget and processor")
        if not isinstance(sources, list) or (sources and not isinstance(sources[0], (str, bytes, dict))):
            sources = [sources]  # one video: a path, bytes, or a list of frames
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


class PromptLoader:
    """Endless, seeded, resumable batches: epoch e visits rows in permutation(seed, e).

    The cursor (epoch, position) is all the state there is, so a resumed run sees exactly the
    rows an uninterrupted one would. Skipped rows are consumed and replaced from the stream.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if len(dataset) == 0:
            raise dataset.unusable()
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))

    def next_batch(self) -> list[PromptSample]:
        batch: list[PromptSample] = []
        order = self._order()
        while len(batch) < self.batch_size:
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
            sample = self.dataset.prepare(int(order[self.position]))
            self.position += 1
            if sample is not None:
                batch.append(sample)
            elif len(self.dataset.bad_rows) == len(self.dataset):  # every row tried and skipped
                raise self.dataset.unusable()
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
