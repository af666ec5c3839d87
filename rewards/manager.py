"""Score a batch with several weighted reward functions, keeping any one bad function from hurting training.

Every call either scores or is counted as a failure and scores 0 for that sample and that function only;
`score` never raises because of a user function. The first failure of each kind per function is logged
(with its traceback for exceptions), later ones are only counted, so a broken reward shows up once in the
log and then as a failure metric rather than as thousands of identical tracebacks.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from rewards.loader import load_reward_function, split_file_spec
from rewards.outcome import Outcome, evaluate
from rewards.pool import WorkerPool
from rewards.types import RewardFn, RewardInput, RewardResult

logger = logging.getLogger("mmrl.rewards")

_SPEC_KEYS = {"name", "weight", "kwargs"}


@dataclass(frozen=True)
class _Function:
    """One configured reward function. `spec` is canonical (file paths absolute) for worker processes;
    `remote` says whether calls run in one."""

    label: str
    spec: str
    fn: RewardFn
    weight: float
    kwargs: dict[str, Any]
    remote: bool


class RewardManager:
    """Weighted sum of reward functions, each given as {"name": spec, "weight": 1.0, "kwargs": {}}.

    `spec` is a built-in grader name or "path/to/file.py:function". With isolation="process", functions
    from files run in `num_workers` spawned processes, each call limited to `timeout_s`; built-in graders
    are trusted and fast, so they run in-process either way. With isolation="inline" everything runs
    in-process: exceptions and invalid values are still caught, but there is no timeout.
    """

    def __init__(
        self,
        specs: list[dict[str, Any]],
        timeout_s: float = 10.0,
        isolation: Literal["inline", "process"] = "inline",
        num_workers: int = 2,
    ):
        if isolation not in ("inline", "process"):
            raise ValueError(f"isolation must be 'inline' or 'process', got {isolation!r}")
        if not timeout_s > 0 or num_workers < 1:
            raise ValueError(f"need timeout_s > 0 and num_workers >= 1, got {timeout_s} and {num_workers}")
        if not specs:
            raise ValueError("RewardManager needs at least one reward function spec")
        self._functions = [_configure(spec, isolate=isolation == "process") for spec in specs]
        labels = [f.label for f in self._functions]
        if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
            raise ValueError(f"reward functions must have distinct names; repeated: {', '.join(duplicates)}")
        self._logged: set[tuple[str, str]] = set()
        self._remote = [f for f in self._functions if f.remote]
        worker_functions = [(f.spec, f.kwargs) for f in self._remote]
        self._pool = WorkerPool(worker_functions, num_workers, timeout_s) if worker_functions else None
        self._closed = False

    def score(self, samples: list[RewardInput]) -> RewardResult:
        """Score every sample with every function and combine them by weight."""
        if self._closed:
            raise RuntimeError("RewardManager is closed")
        outcomes: dict[str, list[Outcome]] = {
            f.label: [evaluate(f.fn, sample, f.kwargs) for sample in samples]
            for f in self._functions
            if not f.remote
        }
        if self._pool is not None:
            remote = self._pool.run(samples)
            outcomes.update((f.label, row) for f, row in zip(self._remote, remote, strict=True))
        return self._combine(len(samples), outcomes)

    def close(self) -> None:
        """Stop the worker processes, if any; safe to call more than once."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _combine(self, num_samples: int, outcomes: dict[str, list[Outcome]]) -> RewardResult:
        result = RewardResult(overall=[0.0] * num_samples)
        for f in self._functions:
            scores = result.components[f.label] = [0.0] * num_samples
            for i, outcome in enumerate(outcomes[f.label]):
                if outcome.kind != "ok":
                    result.failures[f"{f.label}/{outcome.kind}"] += 1
                    self._log_first(f.label, outcome)
                    continue
                for key, value in outcome.scores.items():
                    if key == "overall":
                        scores[i] = value
                        result.overall[i] += f.weight * value
                    else:
                        result.components.setdefault(f"{f.label}/{key}", [0.0] * num_samples)[i] = value
        return result

    def _log_first(self, label: str, outcome: Outcome) -> None:
        if (label, outcome.kind) in self._logged:
            return
        self._logged.add((label, outcome.kind))
        if outcome.kind == "exception":
            logger.error(
                "reward function %r raised; the sample scores 0 and later exceptions are only counted.\n%s",
                label,
                outcome.detail,
            )
        else:
            logger.warning(
                "reward function %r failed (%s: %s); the sample scores 0 and later ones of this kind are "
                "only counted.",
                label,
                outcome.kind,
                outcome.detail,
            )


def _configure(spec: dict[str, Any], isolate: bool) -> _Function:
    """Validate one spec and load its function, so config mistakes fail at start-up, not mid-training."""
    if unknown := set(spec) - _SPEC_KEYS:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in reward spec {spec}; allowed: name, weight, kwargs"
        )
    if "name" not in spec:
        raise ValueError(f"reward spec {spec} has no 'name'")
    name, weight, kwargs = spec["name"], spec.get("weight", 1.0), dict(spec.get("kwargs") or {})
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"weight of reward {name!r} must be a finite number, got {weight!r}")
    fn = load_reward_function(name)
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as err:
        raise ValueError(f"reward function {name!r} cannot take kwargs {kwargs}: {err}") from err
    file_spec = split_file_spec(name)
    if file_spec is None:
        return _Function(name, name, fn, float(weight), kwargs, remote=False)
    path, function_name = file_spec
    return _Function(function_name, f"{path}:{function_name}", fn, float(weight), kwargs, remote=isolate)
