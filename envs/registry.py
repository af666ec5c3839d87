"""Tasks by name, so a config can say ``env: reach`` and external simulators can join the same list.

An entry is either a factory (a class or function) or a ``"module:attr"`` path imported on first use:
the path form keeps ``import envs`` cheap and lets a LIBERO or ManiSkill adapter be registered
without importing its simulator until someone asks for it.

A name ending in ``/`` registers a family of tasks: ``register_env("metaworld/", ...)`` makes
``make_env("metaworld/reach-v3")`` call the factory with ``task="reach-v3"``, and the factory says
which task names it knows.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from mmrl.envs.base import Env

__all__ = ["env_factory", "make_env", "register_env", "registered_envs"]

Factory = Callable[..., Env]
F = TypeVar("F", bound=Factory)

_REGISTRY: dict[str, Factory | str] = {}
_IMPORTED: dict[str, Factory] = {}  # path entries, once imported


@overload
def register_env(name: str) -> Callable[[F], F]: ...
@overload
def register_env(name: str, target: Factory | str) -> None: ...
def register_env(name: str, target: Factory | str | None = None) -> Callable[[F], F] | None:
    """Register a task: ``@register_env("mytask")`` on a class or factory, or ``register_env(name, target)``
    where ``target`` is the factory itself or a ``"package.module:Attribute"`` path.

    Re-registering a name with a different target is an error, because two tasks silently sharing a
    name would make runs irreproducible. A name ending in ``/`` is a family (module docstring).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if target is None:

        def decorator(factory: F) -> F:
            _add(name, factory)
            return factory

        return decorator
    if isinstance(target, str) and target.count(":") != 1:
        raise ValueError(f"env target must look like 'package.module:Attribute', got {target!r}")
    _add(name, target)
    return None


def registered_envs() -> tuple[str, ...]:
    """The registered names, sorted; a family shows as ``family/<task>``."""
    return tuple(sorted(name + "<task>" if name.endswith("/") else name for name in _REGISTRY))


def env_factory(name: str) -> tuple[Factory, str | None]:
    """The factory registered as ``name`` (imported on first use) and, for a family, the task within it.

    A family's factory may list the tasks it knows as ``task_names``, so a misspelt task is caught before
    any env is built."""
    entry, task = _lookup(name)
    return _resolve(entry), task


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the task registered as ``name``; options it does not accept fail here, listing those it does."""
    factory, task = env_factory(name)
    if task is not None:
        if "task" in kwargs:
            raise TypeError(f"env {name!r} names its task; pass no task= option")
        kwargs = {"task": task, **kwargs}
    signature = inspect.signature(factory)
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        accepted = ", ".join(signature.parameters) or "no options"
        raise TypeError(f"env {name!r}: {err}; it accepts: {accepted}") from None
    try:
        return factory(**kwargs)
    except (ValueError, TypeError) as err:  # an option's value the env refuses (max_steps=0, a bad camera)
        if isinstance(err, EnvOptionError):
            raise
        options = ", ".join(f"{key}={value!r}" for key, value in kwargs.items()) or "no options"
        raise EnvOptionError(f"env {name!r} cannot be built with {options}: {err}") from err


class EnvOptionError(ValueError):
    """An env refused the options it was built with: a setup mistake that `mmrl` shows as one line naming
    the env and its options, not as a traceback from inside the simulator."""


def _lookup(name: str) -> tuple[str, str | None]:
    """The registry entry for ``name``, and the task within it when the entry is a family."""
    if name in _REGISTRY and not name.endswith("/"):
        return name, None
    families = [key for key in _REGISTRY if key.endswith("/") and name.startswith(key) and name != key]
    if families:
        family = max(families, key=len)
        return family, name[len(family) :]
    known = ", ".join(registered_envs()) or "none"
    raise KeyError(f"unknown env {name!r}; registered envs: {known} (add one with envs.register_env)")


def _add(name: str, entry: Factory | str) -> None:
    if name in _REGISTRY and _REGISTRY[name] != entry:
        raise ValueError(
            f"env {name!r} is already registered to {_describe(_REGISTRY[name])}; pick another name"
        )
    _REGISTRY[name] = entry


def _resolve(name: str) -> Factory:
    entry = _REGISTRY[name]
    if not isinstance(entry, str):
        return entry
    if name not in _IMPORTED:
        module_name, attr = entry.split(":")
        try:
            _IMPORTED[name] = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ImportError(
                f"env {name!r} is registered as {entry!r}, which could not be imported ({err}); "
                "install the simulator it needs or fix the path"
            ) from err
    return _IMPORTED[name]


def _describe(entry: Factory | str) -> str:
    return entry if isinstance(entry, str) else f"{entry.__module__}.{entry.__qualname__}"
