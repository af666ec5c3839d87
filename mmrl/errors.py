"""Errors that end a run with a message for the user rather than a traceback (the CLI prints them)."""

import difflib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class RunStopped(RuntimeError):
    """The run stopped for a reason the message explains, naming the step, what is intact and what to do."""


class RolloutError(RunStopped):
    """The rollout engine failed; the message names the step and where the last checkpoint is."""


class CheckpointError(RunStopped):
    """A checkpoint could not be written (a full disk, say) or read back (a damaged file); the other
    checkpoints are untouched."""


class NumericalError(RunStopped):
    """Too many steps in a row had non-finite gradients; the last good state was saved first."""


class WorkerError(RunStopped):
    """A Ray worker died or raised; the message names the worker, where it ran, and the step."""


class ResourceError(RunStopped):
    """The Ray cluster cannot hold the workers asked for; raised at startup instead of waiting forever."""


class RewardError(RunStopped):
    """A reward function failed on every sample for too many steps in a row; the run would learn nothing."""


class ConfigError(ValueError):
    """A configuration problem, with a message meant for the person running the command."""


def unknown_name(problem: str, name: str, known: Iterable[str], advice: str = "") -> ConfigError:
    """`problem` (what `name` is not), the known name closest to `name`, the known names (the first 12 of
    a longer list) and `advice`, as one line."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listed = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
    return ConfigError(f"{problem}{hint}; known: {listed}{advice}")


def read_json(path: Path, build: Callable[[Any], T], fix: str, what: str = "") -> T:
    """What `build` makes of the JSON file `path` (mmrl's side files, `datasets`' metadata). A damaged,
    truncated or foreign one is a ConfigError of one line: `what` it is to the run, the file, what is
    wrong and `fix`, what to do."""
    try:
        return build(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{what}{path} cannot be read ({type(err).__name__}: {err}); {fix}") from None
