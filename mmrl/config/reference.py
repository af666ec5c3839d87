"""The config reference, generated from the config classes: every key with its type, default, allowed
values and one-line doc. `docs/configuration.md` is this module's output (`python -m mmrl.config.reference`
writes it; tests/test_docs.py fails when it is stale), and `mmrl config show --doc KEY` prints one key."""

from __future__ import annotations

import enum
import inspect
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mmrl.config.run import Config
from mmrl.errors import unknown_name

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m mmrl.config.reference"


@dataclass(frozen=True)
class Key:
    """One config key as the reference shows it."""

    name: str  # dotted; list items without their index (`reward.functions.weight`)
    type: str
    default: str
    allowed: str
    doc: str


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: directly, optionally (`env: EnvConfig | None`) or as list items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for arg in typing.get_args(annotation) for s in _sections(arg)]


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "str" if all(isinstance(a, str) for a in typing.get_args(annotation)) else "literal"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _literals(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [m.value for m in annotation]
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _allowed(field: FieldInfo) -> str:
    values = _literals(field.annotation)
    if values:
        return ", ".join(json.dumps(v) for v in values)
    bounds = {Gt: ">", Ge: "≥", Lt: "<", Le: "≤"}
    parts = [
        f"{op} {getattr(m, next(iter(m.__dataclass_fields__)))}"
        for m in field.metadata
        for t, op in bounds.items()
        if isinstance(m, t)
    ]
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[Key]:
    """Every leaf key under `model`, in the classes' order; sections are walked, not listed."""
    out = []
    for name, field in model.model_fields.items():
        sections = _sections(field.annotation)
        if sections:
            for section in sections:
                out += config_keys(section, prefix + name + ".")
            continue
        doc = " ".join((field.description or "").split())
        out.append(Key(prefix + name, _type(field.annotation), _default(field), _allowed(field), doc))
    return out


def _section_doc(name: str) -> str:
    (section,) = _sections(Config.model_fields[name].annotation)
    doc = inspect.getdoc(section) or ""
    return "" if doc == inspect.getdoc(section.__mro__[1]) else " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def render() -> str:
    """docs/configuration.md: one table per top-level section."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from mmrl/config/ by `" + REGENERATE + "`; do not edit by hand. -->",
        "",
        "A run is one YAML file. Every key below can also be set on the command line as `section.key=value`",
        "(`mmrl train CONFIG actor.lr=1e-6`), and `mmrl config show CONFIG` prints the resolved config. An unknown",
        "key stops the run at start and names the closest known one. `mmrl config show --doc KEY` prints one",
        "key's entry. Keys inside a list (`reward.functions`) are written without the item's index.",
        "",
    ]
    by_section: dict[str, list[Key]] = {}
    for key in config_keys():
        by_section.setdefault(key.name.split(".")[0], []).append(key)
    for section, rows in by_section.items():
        lines += [f"## `{section}`", ""]
        doc = _section_doc(section)
        if doc:
            lines += [doc, ""]
        lines += ["| Key | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
        for k in rows:
            default = f"`{_cell(k.default)}`" if k.default != "required" else "required"
            allowed = f"`{_cell(k.allowed)}`" if k.allowed else ""
            lines.append(f"| `{k.name}` | `{_cell(k.type)}` | {default} | {allowed} | {_cell(k.doc)} |")
        lines.append("")
    return "\n".join(lines)


def describe(name: str) -> str:
    """One key's entry for `mmrl config show --doc KEY`; a ConfigError naming the closest key otherwise."""
    known = {k.name: k for k in config_keys()}
    if name not in known:
        raise unknown_name(f"no config key {name!r}", name, known)
    k = known[name]
    lines = [f"{k.name}: {k.doc}", f"  type: {k.type}", f"  default: {k.default}"]
    if k.allowed:
        lines.append(f"  allowed: {k.allowed}")
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}", file=sys.stderr)
