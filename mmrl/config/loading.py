"""Reading a config: YAML files, `key.sub=value` overrides, and validation errors explained key by key.

A typo'd key fails with its dotted name, a close match if there is one, and the keys allowed there.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mmrl.config.run import Config
from mmrl.config.training import ActorConfig, AlgorithmConfig
from mmrl.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` and `3E4` as floats (YAML 1.2; PyYAML's 1.1 rules need a dot),
    so a learning rate or a reward kwarg written the usual way never arrives as a string, and that
    refuses a key written twice in one mapping, which PyYAML settles silently by keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden, by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the constructor below names it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key!r} appears twice in one mapping, first on line "
                    f"{first.start_mark.line + 1}; keep one",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def _read_yaml(path: Path) -> Any:
    """A config file's tree; a syntax error names the file, line and column instead of PyYAML's
    `"<unicode string>", line N`."""
    try:
        return _yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}); fix the file and run again") from None


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` in the config tree; a number addresses an item of a list of sections
    (`reward.functions.1.weight=0.5`), counted from 0."""
    node: Any = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        if isinstance(node, list):
            node = _item(node, part, dotted)
            continue
        child = node.setdefault(part, {})
        if not isinstance(child, dict | list):
            raise ConfigError(f"override {dotted}: {part} is a value, not a section")
        node = child
    if isinstance(node, list):
        raise ConfigError(
            f"override {dotted}: name a field of one item ({dotted}.<field>), or set the whole list"
        )
    node[leaf] = value


def _item(items: list[Any], index: str, dotted: str) -> dict[str, Any]:
    """The list item an override's index names."""
    if not index.isdigit() or int(index) >= len(items) or not isinstance(items[int(index)], dict):
        raise ConfigError(
            f"override {dotted}: {index!r} is not an item of this list; it has {len(items)} items, "
            f"numbered from 0"
        )
    return items[int(index)]


def parse_override(text: str) -> tuple[str, Any]:
    """`actor.lr=1e-5` -> ("actor.lr", 1e-5); values are YAML, so lists and null work."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    try:
        return key.strip(), _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML; quote it ({key}='\"...\"')"
        ) from None


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, directly or as the items of a list (`reward.functions`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        return _section_of(item)
    return None


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key; list items are addressed without their index (`reward.functions.weight`)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        section = _section_of(field.annotation)
        if section is not None:
            keys += _known_keys(section, prefix + name + ".")
    return keys


def _suggest(where: str, known: list[str]) -> tuple[str, list[str]]:
    """(' Did you mean x.y?' or '', the keys allowed beside `where`) for an unknown dotted key."""
    parts = where.split(".")
    generic = ".".join(p for p in parts if not p.isdigit())  # list indices dropped, as in `known`
    parent, _, leaf = generic.rpartition(".")
    options = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    real_parent = where.rpartition(".")[0]
    # The exact key in another section first (`data.mini_batch_size` -> actor.mini_batch_size),
    # then a near-typo of a key allowed here, then a near-typo of any key.
    elsewhere = [k for k in known if k.rpartition(".")[2] == leaf and k != generic]
    if not elsewhere:
        close = difflib.get_close_matches(leaf, options, n=1)
        if close:
            return f" Did you mean {real_parent + '.' if real_parent else ''}{close[0]}?", options
        elsewhere = difflib.get_close_matches(generic, known, n=1)
    return (f" Did you mean {elsewhere[0]}?" if elsewhere else ""), options


def _explain(err: ValidationError) -> str:
    lines = []
    known = _known_keys(Config)
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            hint, options = _suggest(where, known)
            lines.append(f"{where}: unknown key.{hint} Keys allowed here: {', '.join(options)}.")
        elif item["type"] == "missing" and any(isinstance(p, int) for p in item["loc"]):
            lines.append(f"{where}: required (an item is missing from a list or pair).")
        elif item["type"] == "missing":
            lines.append(f"{where}: required, add it to the YAML or pass {where}=... on the command line.")
        else:
            value = item.get("input")
            shown = f" (got {value!r})" if not isinstance(value, dict) else ""
            lines.append(f"{where}: {item['msg']}{shown}.")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML, apply `a.b=c` overrides, validate; raises ConfigError with a readable message."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if path.is_dir():
            raise ConfigError(f"{path} is a folder; give the YAML file of a config (configs/quickstart.yaml)")
        tree = _read_yaml(path)
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} must hold a YAML mapping at the top level")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    applied = paper_defaults(tree)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    cfg.paper_defaults.extend(applied)
    return cfg


def paper_defaults(tree: dict[str, Any]) -> list[str]:
    """Set in `tree` the paper's value of every key that the chosen policy loss and advantage estimator
    name (`Needs.defaults`) and that the config leaves unset; `key=value (method)` for each one set. A
    method given as a file (`path.py:function`) is not imported here and sets nothing."""
    from mmrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, needs_of

    chosen = {
        "actor.policy_loss": (POLICY_LOSSES, ActorConfig.model_fields["policy_loss"].default),
        "algorithm.adv_estimator": (
            ADVANTAGE_ESTIMATORS,
            AlgorithmConfig.model_fields["adv_estimator"].default,
        ),
    }
    applied = []
    for key, (registry, default) in chosen.items():
        name = _get_dotted(tree, key, default)
        method = registry.get(name) if isinstance(name, str) else None
        for dotted, value in needs_of(method).defaults if method is not None else ():
            if _get_dotted(tree, dotted, _UNSET) is _UNSET:
                _set_dotted(tree, dotted, value)
                applied.append(f"{dotted}={value} ({name})")
    return applied


_UNSET = object()


def _get_dotted(tree: dict[str, Any], dotted: str, missing: Any) -> Any:
    """The value at `dotted` in the config tree, or `missing` where the tree does not set it."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, as `mmrl config show` prints it and runs record it."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
