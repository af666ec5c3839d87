"""Datasets of image prompts: reading rows, turning each into model inputs, skipping bad ones.

A row that cannot be used (unreadable image, missing column, prompt over the token budget,
marker/image mismatch) is skipped with a named reason. Reasons are counted and the first of
each kind is logged, so a bad corpus shows up in the metrics instead of crashing the run.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jinja2 import Template
from PIL import Image

from processors import (
    ImageError,
    PixelBudget,
    build_messages,
    encode_prompt,
    fit_image,
    load_image,
    num_image_tokens,
    pixel_inputs,
)
from rewards import ImageSize

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


class SkipRow(Exception):
    """Raised while preparing a row; `reason` is the short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def read_rows(files: list[str]) -> list[tuple[dict[str, Any], Path]]:
    """All rows of jsonl/json/parquet files, each with the folder its relative image paths start from."""
    rows: list[tuple[dict[str, Any], Path]] = []
    for name in files:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(
                f"data file {path} does not exist (check data.train_files / data.val_files)"
            )
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8", errors="replace") as fh:
                records = [_json_or_bad(line) for line in fh if line.strip()]
        elif path.suffix == ".json":
            loaded = json.loads(path.read_text(encoding="utf-8"))
            records = [r if isinstance(r, dict) else {"__bad__": "row is not a JSON object"} for r in loaded]
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            records = pq.read_table(path).to_pylist()
        else:
            raise ValueError(
                f"data file {path}: unsupported format {path.suffix!r}; use .jsonl, .json or .parquet"
            )
        rows += [(r, path.parent) for r in records]
    return rows


def _json_or_bad(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        return {"__bad__": f"invalid JSON: {err}"}
    return value if isinstance(value, dict) else {"__bad__": "line is not a JSON object"}


class PromptDataset:
    """Rows plus everything needed to turn one into a `PromptSample`."""

    def __init__(
        self,
        rows: list[tuple[dict[str, Any], Path]],
        tokenizer: Any,
        image_processor: Any,
        *,
        budget: PixelBudget,
        max_prompt_length: int,
        prompt_key: str = "problem",
        answer_key: str = "answer",
        image_key: str = "images",
        image_dir: str | None = None,
        system_prompt: str | None = None,
        format_prompt: str | None = None,
    ) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.budget = budget
        self.max_prompt_length = max_prompt_length
        self.keys = (prompt_key, answer_key, image_key)
        self.image_dir = image_dir
        self.system_prompt = system_prompt
        self.template = Template(format_prompt) if format_prompt else None
        self.bad_rows: dict[int, str] = {}  # row index -> skip reason; each bad row counts once

    @property
    def skipped(self) -> Counter[str]:
        """How many distinct rows were skipped, by reason."""
        return Counter(self.bad_rows.values())

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
        prompt_key, answer_key, image_key = self.keys
        text = row.get(prompt_key)
        if not isinstance(text, str) or not text.strip():
            raise SkipRow("missing_prompt", f"column {prompt_key!r} is missing, empty or not text")
        answer = row.get(answer_key)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise SkipRow("missing_answer", f"column {answer_key!r} is missing or empty")
        sources = row.get(image_key) or []
        if not isinstance(sources, list):
            sources = [sources]
        base = Path(self.image_dir) if self.image_dir else folder
        try:
            images = [load_image(src, base_dir=base) for src in sources]
            fitted = [fit_image(image, self.budget) for image in images]
        except ImageError as err:
            raise SkipRow("bad_image", str(err)) from None
        if self.template is not None:
            text = self.template.render(content=text)
        try:
            messages = build_messages(text, len(fitted), self.system_prompt)
        except ValueError as err:
            raise SkipRow("image_marker_mismatch", str(err)) from None
        counts = [num_image_tokens(im.height, im.width, self.budget) for im in fitted]
        try:
            ids = encode_prompt(self.tokenizer, messages, counts)
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
            extra={k: v for k, v in row.items() if k not in self.keys},
        )
        if fitted:
            inputs = pixel_inputs(fitted, self.image_processor)
            sample.pixel_values, sample.image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
        return sample

    def prepare_all(self, limit: int | None = None) -> list[PromptSample]:
        """Every usable row (validation sets are small enough to hold prepared)."""
        indices = range(len(self) if limit is None else min(limit, len(self)))
        return [s for s in (self.prepare(i) for i in indices) if s is not None]


class PromptLoader:
    """Endless, seeded, resumable batches: epoch e visits rows in permutation(seed, e).

    The cursor (epoch, position) is all the state there is, so a resumed run sees exactly the
    rows an uninterrupted one would. Skipped rows are consumed and replaced from the stream.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if len(dataset) == 0:
            raise ValueError("the training set is empty; check data.train_files")
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
        failures = 0
        while len(batch) < self.batch_size:
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
            sample = self.dataset.prepare(int(order[self.position]))
            self.position += 1
            if sample is not None:
                batch.append(sample)
                failures = 0
            elif (failures := failures + 1) > len(self.dataset):
                raise RuntimeError(
                    f"no usable rows in the training set: {failures} failed in a row; "
                    f"skipped so far: {dict(self.dataset.skipped)}"
                )
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
