"""Tool calls in the model's own format, read tolerantly.

Qwen models call a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (with
newlines around the JSON). Small and half-trained policies get it slightly wrong, and a call that is
almost right should still run: a missing closing tag at the end of the turn, a ```json fence, single
quotes, `arguments` given as a JSON string (the OpenAI wire format) or under `parameters`. What cannot
be read becomes a `CallError` the model is told about, never an exception.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A `<tool_call>` block that is not a call: `detail` is what the model is told."""

    detail: str
    kind: str = "malformed"


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
    """Every `<tool_call>` block of an assistant turn, in order; none means the turn is an answer."""
    return [_parse_block(match.group(1)) for match in _BLOCK.finditer(text)]


def _parse_block(body: str) -> ToolCall | CallError:
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    value = _load(body)
    if not isinstance(value, dict):
        shown = body if len(body) <= 120 else body[:117] + "..."
        return CallError(
            f'the tool call {shown!r} is not a JSON object like {{"name": ..., "arguments": {{...}}}}'
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return CallError('the tool call has no "name" string')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # the OpenAI wire format sends arguments as a JSON string
        arguments = _load(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return CallError(f'the "arguments" of the call to {name} are not a JSON object')
    return ToolCall(name, arguments)


def _load(text: str) -> Any:
    """JSON, else a Python literal (single quotes, True/None), else None."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a thousand nested brackets overflow the parser's stack
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
