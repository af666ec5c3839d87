"""The work of `PromptDataset.check_rows` on one batch of memory-mapped rows, run by `datasets`' `map`.

The checks decode no media, so a batch's media columns are replaced by stand-ins of the same count:
checking a set of embedded images then pages none of them in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mmrl.data.layouts import SkipRow
from mmrl.data.rows import json_row

# Rows per process in `check_rows`: below this, starting worker processes costs more than it saves.
ROWS_PER_CHECK_PROCESS = 8192


def check_batch(
    batch: Any,
    check: Callable[[dict[str, Any]], object],
    has_media: Callable[[dict[str, Any]], bool],
    as_json: bool,
    media: list[str],
) -> dict[str, list[Any]]:
    """Each row's skip reason and detail (empty when `check` passes it) and whether it names media, for
    a batch of rows (an Arrow table: JSON text lines if `as_json`, else columns, `media` among them)."""
    rows = map(json_row, batch["line"].to_pylist()) if as_json else media_counted(batch, media)
    out: dict[str, list[Any]] = {"skip": [], "detail": [], "media": []}
    for row in rows:
        try:
            check(row)
            reason, detail = "", ""
        except SkipRow as skip:
            reason, detail = skip.reason, str(skip)
        out["skip"].append(reason)
        out["detail"].append(detail)
        out["media"].append(has_media(row))
    return out


def media_counted(batch: Any, media: list[str]) -> list[dict[str, Any]]:
    """The rows of an Arrow batch with each media column's values replaced by stand-ins of the same
    count, read from the list offsets alone: the checks count media but never read them, and this
    way not a byte of an embedded image is paged in (the pass would otherwise touch the whole file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    stand_ins: dict[str, list[Any]] = {}
    for name in media:
        column = batch[name]
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            # A list of lists is one video given as frames (`PromptDataset._video_sources`): keep that shape.
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


def check_processes(rows: int) -> int | None:
    """Worker processes for checking `rows` rows: None (this process) unless more than one pays off."""
    processes = min(os.cpu_count() or 1, rows // ROWS_PER_CHECK_PROCESS)
    return processes if processes > 1 else None
