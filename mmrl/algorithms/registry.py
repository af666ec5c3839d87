"""Name → function registries, so a config can pick an algorithm by string.

Built-ins register themselves with a decorator; user code either does the same or is
named in the config as ``path/to/file.py:function`` and imported with `load_from_file`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mmrl.rewards.loader import import_file

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Needs:
    """What an algorithm asks of the run, carried by its registry entry: the config checks these, so
    neither it nor the trainer ever tests an algorithm's name.

    - ``groups``: it compares the responses to one prompt with each other, so ``rollout.n >= 2``.
    - ``exact_on_policy``: every update must be the first and only one on freshly sampled responses
      (one epoch, one mini-batch per step, no rollouts sent ahead), so π_θ = π_old throughout.
    - ``rows_per_group``: a response filter keeps at most this many of each group.
    - ``critic``: it needs a learned value of every response token (``values=``), so the run trains a
      critic (`mmrl.training.critic`).
    - ``prm``: it needs each token's implicit process reward (``process_rewards=``) from a second
      language model trained online on outcome labels (PRIME's implicit PRM, `mmrl.training.prm`), and
      the frozen reference that reward is measured against.
    - ``pairs_with``: the other half of a pair that only means something together: for an estimator,
      the policy loss it must train with; for a loss, the estimator whose target it takes (SPPO's
      win-rate target and its regression; GPG's corrected advantages and its plain gradient).
    - ``defaults``: the paper's values of config keys (`("actor.loss_agg_mode", "seq-mean-token-mean")`),
      applied where the config leaves the key unset (`mmrl.config.loading.paper_defaults`): choosing
      the method then trains it as its paper did, and `mmrl config show` lists what was applied.
    """

    groups: bool = False
    exact_on_policy: bool = False
    rows_per_group: int | None = None
    critic: bool = False
    prm: bool = False
    pairs_with: str | None = None
    defaults: tuple[tuple[str, Any], ...] = ()


def needs_of(fn: Callable[..., Any]) -> Needs:
    """The `Needs` a registered function declared; a user's own function declares none."""
    return getattr(fn, "needs", Needs())


def register(registry: dict[str, F], *names: str, needs: Needs | None = None) -> Callable[[F], F]:
    """Decorator adding a function under one or more names; refuses to silently replace one.

    `needs` is attached to the function (see `needs_of`)."""

    def decorator(fn: F) -> F:
        taken = [name for name in names if name in registry]
        if taken:
            raise ValueError(f"{taken} already registered; pick another name")
        if needs is not None:
            fn.needs = needs  # type: ignore[attr-defined]
        for name in names:
            registry[name] = fn
        return fn

    return decorator


def lookup(registry: dict[str, F], name: str, *, what: str, how_to_add: str) -> F:
    """Fetch `name`, a registered name or a user's `path/to/file.py:function`, or fail with the
    names on offer and how to add one (a bare KeyError helps nobody)."""
    if ":" in name:
        return load_from_file(name)
    try:
        return registry[name]
    except KeyError:
        raise KeyError(
            f"unknown {what} {name!r}; registered: {', '.join(sorted(registry))}. {how_to_add}"
        ) from None


def load_from_file(spec: str) -> Callable[..., Any]:
    """Import `function` from a ``path/to/file.py:function`` spec so users need not edit the package."""
    path_str, sep, fn_name = spec.rpartition(":")
    if not sep or not path_str or not fn_name:
        raise ValueError(f"expected 'path/to/file.py:function', got {spec!r}")
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{spec!r}: no file at {path}")
    module = import_file(path)
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(f"{spec!r}: {path} defines no {fn_name!r}; callables there: {public}")
    if not callable(fn):
        raise TypeError(f"{spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return fn
