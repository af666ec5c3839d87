"""Turn a reward spec from a config (a built-in name or `path/to/file.py:function`) into a callable.

Errors name what was looked for and what exists, because they surface at launch time to someone editing a
config, not to someone reading this code.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mmrl.rewards.graders import GRADERS
from mmrl.rewards.outcome import exits_raised
from mmrl.rewards.types import RewardFn


def split_file_spec(spec: str) -> tuple[Path, str] | None:
    """(absolute file path, function name) for a `file.py:function` spec; None for a built-in name.
    The path is resolved against the current directory now, so worker processes find the same file."""
    path, sep, function = spec.rpartition(":")
    if not sep:
        return None
    return Path(path).expanduser().resolve(), function


def load_reward_function(spec: str) -> RewardFn:
    """The reward function `spec` names: a registered grader or a function in a Python file."""
    parts = split_file_spec(spec)
    if parts is None:
        if spec in GRADERS:
            return GRADERS[spec]
        raise ValueError(f"unknown reward function {spec!r}.{_unknown_name_hint(spec)}")
    return load_file_function(spec, "reward")


def load_file_function(spec: str, what: str) -> Callable[..., Any]:
    """The function a `path/to/file.py:function` spec names; `what` (reward, tool) words the errors."""
    path, name = split_file_spec(spec) or (Path(spec), "")
    if path.suffix != ".py" or not name:
        raise ValueError(f"{what} spec {spec!r} should look like 'path/to/file.py:function_name'")
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} file {path} not found (spec {spec!r}); relative paths are resolved against the "
            f"current directory, {Path.cwd()}"
        )
    module = import_file(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = ", ".join(_functions_defined_in(module)) or "none"
        raise AttributeError(f"{path} has no function {name!r}; functions it defines: {defined}")
    return fn


def import_file(path: Path) -> ModuleType:
    """Execute a user file as a fresh module, registered in sys.modules so that dataclasses and pickling
    inside it work; the module name is unique per path so two `rewards.py` files never collide."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"mmrl_reward_file_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        with exits_raised(OS_EXIT):
            module_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        raise ImportError(f"{err.filename or path}, line {err.lineno}: syntax error: {err.msg}") from err
    except SystemExit as err:  # sys.exit() or os._exit() while it loads: the run would end without a word
        del sys.modules[module_name]
        said = err.code if isinstance(err.code, str) and err.code.startswith("os._exit(") else None
        raise ImportError(
            f"importing {path} failed: it calls {said or f'sys.exit({err.code!r})'} at import"
        ) from None
    except Exception as err:
        del sys.modules[module_name]
        raise ImportError(f"importing {path} failed: {type(err).__name__}: {err}") from err
    return module


OS_EXIT = "os._exit({code})"  # how `import_file` words a file's os._exit call


def _unknown_name_hint(spec: str) -> str:
    """What to write instead of an unknown grader name: the close built-in one, or how to name a file."""
    if spec.endswith(".py"):
        return f" To use a file, add the function: '{spec}:function_name'."
    close = difflib.get_close_matches(spec, GRADERS, n=1)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{guess} Built-in graders: {', '.join(sorted(GRADERS))}; "
        "for your own function use 'path/to/file.py:function_name'."
    )


def _functions_defined_in(module: ModuleType) -> list[str]:
    """Public functions defined in the module itself, not imported into it."""
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("_")
    )
