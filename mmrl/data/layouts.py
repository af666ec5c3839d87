"""Row layouts: which columns hold a row's prompt and answer, and reading a chat-message prompt.

Two layouts are read as they are published. EasyR1: `problem` (text with `<image>` markers), `answer`,
`images`. verl: `prompt` (chat messages, the system one becoming the system prompt),
`reward_model.ground_truth`, `images`, and `extra_info`, whose fields reach rewards in `extra`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmrl.data.rows import Row, Rows
from mmrl.processors.chat import IMAGE_MARKER

# Column defaults of each layout; a dotted key reaches into a struct column.
FORMAT_KEYS: dict[str, tuple[str, str]] = {
    "easyr1": ("problem", "answer"),
    "verl": ("prompt", "reward_model.ground_truth"),
}
# A struct column whose fields are also handed to rewards as top-level `extra` keys, so graders
# find e.g. `choices` wherever a verl-style preprocessing script put it.
LIFTED_COLUMN = "extra_info"


class SkipRow(Exception):
    """Raised while preparing a row; `reason` is the short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


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


def layout_hint(rows: Sequence[Row], keys: tuple[str, str, str], markers_unmatched: bool) -> str:
    """When no row has the prompt or answer column (or, with `<image>` markers left unmatched, the
    image column) that `keys` (prompt, answer, image) name, the columns the rows do have and the
    config keys that pick them."""
    columns = sorted(columns_of(rows))
    names = ("data.prompt_key", "data.answer_key", "data.image_key")
    absent = [
        (name, key)
        for name, key in zip(names, keys, strict=True)
        if all(lookup(row, key) is None for row, _ in rows)
        and (name != "data.image_key" or markers_unmatched)
    ]
    if not columns or not absent:
        return ""
    missing = " or ".join(f"{key!r} ({name})" for name, key in absent)
    config_keys = " and ".join(name for name, _ in absent)
    column = "columns" if len(absent) > 1 else "column"
    return f". No row has a column {missing}; the rows have columns {columns}: point {config_keys} at the right {column}"


def is_empty(value: Any) -> bool:
    """Whether a column's value is missing: None, blank text, or an empty list or struct."""
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


def from_messages(messages: list[Any]) -> tuple[str, str | None]:
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
