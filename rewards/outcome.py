"""One reward call's outcome, and the rules for what a reward function may return.

Calls are checked where they run (in-process or in a worker) so only plain, picklable data ever crosses a
process boundary, whatever the user function returned.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, SupportsFloat

from rewards.types import RewardFn, RewardInput

OutcomeKind = Literal["ok", "exception", "timeout", "invalid"]


@dataclass(frozen=True)
class Outcome:
    """`scores` (with "overall") when kind is "ok"; otherwise `detail` says what went wrong (a traceback
    for an exception)."""

    kind: OutcomeKind
    scores: dict[str, float] = field(default_factory=dict)
    detail: str = ""


class InvalidRewardError(ValueError):
    """A reward function returned something that is not a finite score."""


def evaluate(fn: RewardFn, sample: RewardInput, kwargs: Mapping[str, Any]) -> Outcome:
    """Call `fn` on one sample; never raises, so one bad call cannot take down a batch. SystemExit is
    caught too: a reward function calling exit() is a bug to report, not a request to stop training."""
    try:
        value = fn(sample, **kwargs)
    except (Exception, SystemExit):
        return Outcome("exception", detail=traceback.format_exc())
    try:
        return Outcome("ok", scores=to_scores(value))
    except InvalidRewardError as err:
        return Outcome("invalid", detail=str(err))


def to_scores(value: object) -> dict[str, float]:
    """A reward function's return value as {"overall": ..., **metrics}, all finite floats."""
    if isinstance(value, Mapping):
        if "overall" not in value:
            raise InvalidRewardError(f"returned a dict without 'overall' (keys: {sorted(map(str, value))})")
        return {_key(key): _finite(score, f"value of {key!r}") for key, score in value.items()}
    return {"overall": _finite(value, "return value")}


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise InvalidRewardError(f"returned a dict with a non-string key {key!r}")
    return key


def _finite(value: object, what: str) -> float:
    """`value` as a finite float. Anything with __float__ counts (numpy scalars, one-element tensors);
    strings do not, since a string score is a bug rather than a number."""
    try:
        number = float(value) if isinstance(value, SupportsFloat) else None
    except (TypeError, ValueError):  # e.g. a tensor with several elements
        number = None
    if number is None:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise InvalidRewardError(f"{what} is {type(value).__name__} {shown}, expected a float")
    if not math.isfinite(number):
        raise InvalidRewardError(f"{what} is {number}, expected a finite float")
    return number
