"""Tools an agent can call, and running its calls without letting any of them stop the run.

A tool is a built-in (`image_zoom`, `calculator`) or a plain function in a Python file named
`path/to/file.py:function`, with a JSON schema of its arguments, as reward functions are named. Every
call gets a result: what the tool returned, or an error observation saying what was wrong (a malformed
call, an unknown tool, arguments that do not fit the schema or that the tool refused, an exception, a
hang past `timeout_s`, a result that is neither text nor an image). Failures are counted per tool and
kind. Functions from files run in the reward layer's worker processes (`mmrl.rewards.pool`), so one that
hangs or kills its interpreter costs one call; built-ins are trusted and run in-process.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmrl.agent.builtin import BUILTIN_TOOLS, SeenImage, ToolError, check_options
from mmrl.agent.calls import CallError, ToolCall
from mmrl.errors import ConfigError
from mmrl.rewards.loader import load_file_function
from mmrl.rewards.outcome import Outcome
from mmrl.rewards.pool import RemoteFunction, WorkerPool

log = logging.getLogger("mmrl.agent.tools")

# What a call comes back as: text and images, in order.
Result = list[str | Image.Image]

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
}


@dataclass(frozen=True)
class ToolSpec:
    """A configured tool: `function` is a built-in name or `path/to/file.py:function`; `kwargs` are fixed
    keyword arguments the model does not see (such as `image_zoom`'s coordinate `frame`)."""

    name: str
    function: str
    description: str
    parameters: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def builtin(self) -> bool:
        return self.function in BUILTIN_TOOLS

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @classmethod
    def from_config(cls, entry: dict[str, Any]) -> ToolSpec:
        """A built-in brings its own name, description and schema (each may be overridden); a file
        function needs `parameters`, and its name defaults to the function's."""
        function = entry["function"]
        if function in BUILTIN_TOOLS:
            _, description, parameters = BUILTIN_TOOLS[function]
            name = function
            check_options(function, entry.get("kwargs") or {})
        elif ":" in function:
            description, parameters, name = "", None, function.rpartition(":")[2]
        else:
            raise ValueError(
                f"unknown tool {function!r}: built-ins are {', '.join(BUILTIN_TOOLS)}; for your own "
                "function use 'path/to/file.py:function_name' with its `parameters` (a JSON schema)"
            )
        parameters = entry.get("parameters") or parameters
        if parameters is None:
            raise ValueError(f"tool {function}: give `parameters`, the JSON schema of its arguments")
        return cls(
            name=entry.get("name") or name,
            function=function,
            description=entry.get("description") or description,
            parameters=parameters,
            kwargs=dict(entry.get("kwargs") or {}),
        )


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` under the (object) JSON schema, or None: required keys, types
    (also of array items), array lengths and enums; unknown keys where `additionalProperties` is false."""
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    if schema.get("additionalProperties") is False and (unknown := set(arguments) - set(properties)):
        names = ", ".join(sorted(map(str, unknown)))
        return f"unknown argument(s) {names}; the arguments are {', '.join(properties)}"
    for key, value in arguments.items():
        if key in properties and (problem := _check_value(properties[key], value)):
            return f"argument {key}: {problem}"
    return None


def _check_value(schema: dict[str, Any], value: Any) -> str | None:
    kind = schema.get("type")
    if kind in _TYPES and (
        not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool))
    ):
        return f"expected {kind}, got {type(value).__name__} {value!r}"[:200]
    if "enum" in schema and value not in schema["enum"]:
        return f"expected one of {schema['enum']}, got {value!r}"
    if kind == "array":
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return f"expected {schema.get('minItems', 0)} to {schema.get('maxItems', 'any')} items, got {len(value)}"
        items = schema.get("items")
        for item in value if isinstance(items, dict) else ():  # a list of schemas (tuples) is not checked
            if problem := _check_value(items, item):
                return f"item {problem}"
    return None


@dataclass(frozen=True)
class ToolRequest:
    """One call as the function that runs it receives it."""

    name: str
    arguments: dict[str, Any]
    images: tuple[SeenImage, ...] = ()


class ToolRunner:
    """The configured tools loaded, called one request at a time with every failure turned into an
    `Outcome`: a `mmrl.rewards.pool` worker's callable, and the in-process runner of the built-ins."""

    is_async = False

    def __init__(self, specs: Sequence[ToolSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        self.functions = {
            s.name: BUILTIN_TOOLS[s.function][0] if s.builtin else load_file_function(s.function, "tool")
            for s in specs
        }
        # Tools that declare `images` get the trajectory's images; no others are sent them.
        self.takes_images = {
            n for n, fn in self.functions.items() if "images" in inspect.signature(fn).parameters
        }

    def __call__(self, requests: Sequence[ToolRequest]) -> list[Outcome]:
        (request,) = requests
        spec, fn = self.specs[request.name], self.functions[request.name]
        kwargs = {**request.arguments, **spec.kwargs}
        if request.name in self.takes_images:
            kwargs["images"] = list(request.images)
        try:
            value = fn(**kwargs)
        except ToolError as err:
            return [Outcome("invalid", detail=str(err))]
        except TypeError as err:  # arguments the schema allowed but the function does not take
            if _raised_by_call(err):
                return [Outcome("invalid", detail=str(err))]
            return [Outcome("exception", detail=traceback.format_exc())]
        except (Exception, SystemExit):
            return [Outcome("exception", detail=traceback.format_exc())]
        result = _as_result(value)
        if result is None:
            shown = repr(value)[:80]
            return [
                Outcome("exception", detail=f"returned {type(value).__name__} {shown}, not text or an image")
            ]
        return [Outcome("ok", value=result)]


def _raised_by_call(err: TypeError) -> bool:
    """Whether a TypeError came from binding the arguments (the traceback ends in the caller's frame)."""
    tb = err.__traceback__
    return tb is not None and tb.tb_next is None


def _as_result(value: Any) -> Result | None:
    items = value if isinstance(value, (list, tuple)) else [value]
    out: Result = []
    for item in items:
        if isinstance(item, Image.Image):
            out.append(item)
        elif isinstance(item, (str, int, float)) and not isinstance(item, bool):
            out.append(str(item))
        else:
            return None
    return out


def _tool_runner(function: RemoteFunction) -> ToolRunner:
    """A worker's runner (`RemoteFunction.build`): the tools travel as their config entries."""
    return ToolRunner([ToolSpec(**spec) for spec in function.kwargs["specs"]])


@dataclass
class Observation:
    """What one call returns to the model; `failure` is the counted kind when it went wrong."""

    parts: Result
    failure: str | None = None


class ToolBox:
    """The run's tools: their schemas for the prompt, and `run`, which answers every call of a round.

    Failure kinds, counted as `name/kind` (`failures`): malformed (unreadable call), unknown_tool,
    bad_arguments (schema or the tool's own ToolError), exception, timeout."""

    def __init__(self, specs: Sequence[ToolSpec], timeout_s: float = 10.0, num_workers: int = 2) -> None:
        self.specs: dict[str, ToolSpec] = {}
        for spec in specs:  # one name, one tool: a second one would silently replace the first
            if (first := self.specs.setdefault(spec.name, spec)) is not spec:
                raise ConfigError(
                    f"agent.tools: two tools are named {spec.name!r} ({first.function} and {spec.function}); "
                    "give one of them another `name`"
                )
        self.inline = ToolRunner([s for s in specs if s.builtin])
        remote = [s for s in specs if not s.builtin]
        # Loaded here first too, so a broken file fails at start as one line, and to read signatures.
        self.takes_images = self.inline.takes_images | ToolRunner(remote).takes_images
        self.pool = (
            WorkerPool(
                [RemoteFunction("tools", {"specs": [vars(s) for s in remote]}, build=_tool_runner)],
                num_workers,
                timeout_s,
            )
            if remote
            else None
        )
        self.failures: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._logged: set[str] = set()  # the failure kinds already printed, as `tool/kind`

    def schemas(self) -> list[dict[str, Any]]:
        return [s.schema() for s in self.specs.values()]

    def run(
        self, calls: Sequence[ToolCall | CallError], images: Sequence[Sequence[SeenImage]]
    ) -> list[Observation]:
        """One observation per call; `images[i]` are the images call i's trajectory has shown."""
        out: list[Observation | None] = [None] * len(calls)
        remote: list[tuple[int, ToolRequest]] = []
        for i, call in enumerate(calls):
            if isinstance(call, CallError):
                out[i] = self._failed("call", call.kind, call.detail)
                continue
            self.calls[call.name] += 1
            spec = self.specs.get(call.name)
            if spec is None:
                known = ", ".join(self.specs)
                out[i] = self._failed(
                    call.name, "unknown_tool", f"there is no tool {call.name!r}; the tools are {known}"
                )
                continue
            if problem := check_arguments(spec.parameters, call.arguments):
                out[i] = self._failed(call.name, "bad_arguments", problem)
                continue
            request = ToolRequest(
                call.name, call.arguments, tuple(images[i]) if call.name in self.takes_images else ()
            )
            if spec.builtin:
                out[i] = self._observed(call.name, self.inline([request])[0])
            else:
                remote.append((i, request))
        if remote and self.pool is not None:
            (outcomes,) = self.pool.run([r for _, r in remote])
            for (i, request), outcome in zip(remote, outcomes, strict=True):
                out[i] = self._observed(request.name, outcome)
        return [o for o in out if o is not None]

    def _observed(self, name: str, outcome: Outcome) -> Observation:
        if outcome.kind == "ok":
            return Observation(outcome.value)
        kind = {"invalid": "bad_arguments"}.get(outcome.kind, outcome.kind)
        detail = outcome.detail.strip().splitlines()[-1] if outcome.kind == "exception" else outcome.detail
        return self._failed(name, kind, detail)

    def _failed(self, name: str, kind: str, detail: str) -> Observation:
        """A failed call: counted, answered with an error turn, and the first of its tool and kind printed
        with its message (a tool that fails on every call would otherwise be seen only as a count)."""
        key = f"{name}/{kind}"
        self.failures[key] += 1
        if key not in self._logged:
            self._logged.add(key)
            log.warning(
                "tool %r failed (%s): %s. The model is told so; later failures of this kind are only counted "
                "(agent/tool_failures/%s in the metrics).",
                name,
                kind,
                detail,
                key,
            )
        return Observation([f"Error: {detail}"], failure=kind)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
