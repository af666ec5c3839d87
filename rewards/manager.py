"""Score a batch with several weighted reward functions, keeping any one bad function from hurting training.

Every call either scores or is counted as a failure and scores 0 for that sample and that function only
(for every sample of the call, when a batched call fails as a whole); `score` never raises because of a
user function. The first failure of each kind per function is logged (with its traceback for exceptions),
later ones are only counted, so a broken reward shows up once in the log and then as a failure metric
rather than as thousands of identical tracebacks.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, cast

from mmrl.rewards.graders import BATCHED_GRADERS
from mmrl.rewards.loader import load_reward_function, split_file_spec
from mmrl.rewards.outcome import (
    MAX_SCORE,
    EventLoop,
    Outcome,
    Scorer,
    exits_raised,
    report_crashes,
    run_calls,
)
from mmrl.rewards.pool import RemoteFunction, WorkerPool
from mmrl.rewards.types import RewardInput, RewardResult

logger = logging.getLogger("mmrl.rewards")

_SPEC_KEYS = {"name", "weight", "kwargs", "batched"}
# With each score within ±MAX_SCORE, a weighted total stays far inside float32 (an inf total would make
# every advantage of its group NaN, then 0).
MAX_WEIGHT = 1e6
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Function:
    """One configured reward function. `spec` is canonical (file paths absolute) for worker processes;
    `remote` says whether calls run in one."""

    label: str
    spec: str
    scorer: Scorer
    weight: float
    remote: bool

    def remote_function(self) -> RemoteFunction:
        return RemoteFunction(self.spec, dict(self.scorer.kwargs), self.scorer.batched, self.scorer.is_async)


class RewardManager:
    """Weighted sum of reward functions, each given as {"name": spec, "weight": 1.0, "kwargs": {}} with an
    optional "batched": True.

    `spec` is a built-in grader name or "path/to/file.py:function". A `batched` function is called once per
    batch with list[RewardInput] and returns one score per sample. An `async def` function is detected and
    awaited: the calls of one batch run concurrently, each limited to `timeout_s`, in-process too.

    With isolation="process" (the default), functions from files run in `num_workers` spawned processes,
    each call (a batched call counts as one) limited to `timeout_s` (None: 10 s), so a call that hangs,
    exits or crashes the interpreter costs one score, not the run; built-in graders are trusted and fast, so
    they run in-process either way. With isolation="inline" everything runs in-process: exceptions and
    invalid values are still caught, but only async calls can be cut off, so a `timeout_s` given for a
    synchronous file function there is refused rather than ignored.
    """

    def __init__(
        self,
        specs: list[dict[str, Any]],
        timeout_s: float | None = None,
        isolation: Literal["inline", "process"] = "process",
        num_workers: int = 2,
    ):
        self._functions = configure_functions(specs, timeout_s, isolation)
        if any(split_file_spec(f.spec) and not f.remote for f in self._functions):
            report_crashes()  # user code in this process: a segfault there prints the stack that names it
        if num_workers < 1:
            raise ValueError(f"need num_workers >= 1, got {num_workers}")
        self._logged: set[tuple[str, str]] = set()
        self._timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._loop = EventLoop()
        self._remote = [f for f in self._functions if f.remote]
        worker_functions = [f.remote_function() for f in self._remote]
        self._pool = WorkerPool(worker_functions, num_workers, self._timeout_s) if worker_functions else None
        self._closed = False

    def score(self, samples: list[RewardInput]) -> RewardResult:
        """Score every sample with every function and combine them by weight."""
        if self._closed:
            raise RuntimeError("RewardManager is closed")
        outcomes = self._score_inline(samples)
        if self._pool is not None:
            remote = self._pool.run(samples)
            outcomes.update((f.label, row) for f, row in zip(self._remote, remote, strict=True))
        return self._combine(len(samples), outcomes)

    def close(self) -> None:
        """Stop the worker processes, if any; safe to call more than once."""
        self._closed = True
        self._loop.close()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _score_inline(self, samples: list[RewardInput]) -> dict[str, list[Outcome]]:
        """Outcomes of the functions that run in this process, by label. User code among them (inline
        isolation) runs with `os._exit` raising, so an exit is that function's counted failure."""
        inline = [f for f in self._functions if not f.remote]
        with exits_raised() if any(split_file_spec(f.spec) for f in inline) else nullcontext():
            return self._run_inline(inline, samples)

    def _run_inline(self, inline: list[_Function], samples: list[RewardInput]) -> dict[str, list[Outcome]]:
        outcomes: dict[str, list[Outcome | None]] = {f.label: [None] * len(samples) for f in inline}
        calls: list[tuple[tuple[str, range], Scorer, list[RewardInput]]] = []
        for f in inline:
            if not f.scorer.batched:
                calls += [((f.label, range(i, i + 1)), f.scorer, [s]) for i, s in enumerate(samples)]
            elif samples:
                calls.append(((f.label, range(len(samples))), f.scorer, samples))

        def report(key: tuple[str, range], results: list[Outcome]) -> None:
            label, indices = key
            outcomes[label][indices.start : indices.stop] = results

        run_calls(calls, self._timeout_s, self._loop, report)
        return cast(dict[str, list[Outcome]], outcomes)

    def _combine(self, num_samples: int, outcomes: dict[str, list[Outcome]]) -> RewardResult:
        result = RewardResult(overall=[0.0] * num_samples)
        for f in self._functions:
            scores = result.components[f.label] = [0.0] * num_samples
            for i, outcome in enumerate(outcomes[f.label]):
                if outcome.kind != "ok":
                    result.failures[f"{f.label}/{outcome.kind}"] += 1
                    result.errors.setdefault(f.label, _summary(outcome))
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


def configure_functions(
    specs: list[dict[str, Any]], timeout_s: float | None, isolation: Literal["inline", "process"]
) -> list[_Function]:
    """Validate the specs and load every function, starting no worker: the whole check a config gets
    before a run, so its mistakes surface at launch rather than mid-training."""
    if isolation not in ("inline", "process"):
        raise ValueError(f"isolation must be 'inline' or 'process', got {isolation!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"need timeout_s > 0, got {timeout_s}")
    if not specs:
        raise ValueError("RewardManager needs at least one reward function spec")
    functions = [_configure(spec, isolate=isolation == "process") for spec in specs]
    labels = [f.label for f in functions]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise ValueError(f"reward functions must have distinct names; repeated: {', '.join(duplicates)}")
    unbounded = [
        f.label for f in functions if split_file_spec(f.spec) and not f.remote and not f.scorer.is_async
    ]
    if timeout_s is not None and unbounded:
        raise ValueError(
            f"reward.timeout_s={timeout_s:g} cannot be enforced on {', '.join(unbounded)} under "
            "reward.isolation: inline, as a synchronous call in the trainer's process cannot be cut off; "
            "use reward.isolation: process (the default) or remove reward.timeout_s"
        )
    return functions


def _summary(outcome: Outcome) -> str:
    """A failure in one line: the exception line of a traceback, or the kind and what went wrong."""
    if outcome.kind == "exception":
        lines = outcome.detail.strip().splitlines()
        return lines[-1] if lines else "an exception"
    return f"{outcome.kind}: {outcome.detail}"


def _configure(spec: dict[str, Any], isolate: bool) -> _Function:
    """Validate one spec and load its function, so config mistakes fail at start-up, not mid-training."""
    if unknown := set(spec) - _SPEC_KEYS:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in reward spec {spec}; allowed: name, weight, kwargs, batched"
        )
    if "name" not in spec:
        raise ValueError(f"reward spec {spec} has no 'name'")
    name, weight, kwargs = spec["name"], spec.get("weight", 1.0), dict(spec.get("kwargs") or {})
    batched = spec.get("batched")
    if batched is None:  # unset: built-in model-based graders are batched, everything else per sample
        batched = name in BATCHED_GRADERS
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not abs(weight) <= MAX_WEIGHT:
        raise ValueError(
            f"weight of reward {name!r} must be a number within ±{MAX_WEIGHT:.0e}, got {weight!r} (a score is "
            f"capped at ±{MAX_SCORE:.0e}; beyond that, scale the reward function's scores instead)"
        )
    if not isinstance(batched, bool):
        raise ValueError(f"batched of reward {name!r} must be true or false, got {batched!r}")
    if name in BATCHED_GRADERS and not batched:
        raise ValueError(f"the built-in reward {name!r} scores whole batches; remove batched: false")
    fn = load_reward_function(name)
    _check_signature(name, fn, kwargs, batched)
    scorer = Scorer(fn, kwargs, batched)
    file_spec = split_file_spec(name)
    if file_spec is None:
        return _Function(name, name, scorer, float(weight), remote=False)
    path, function_name = file_spec
    return _Function(function_name, f"{path}:{function_name}", scorer, float(weight), remote=isolate)


def _check_signature(name: str, fn: Any, kwargs: dict[str, Any], batched: bool) -> None:
    """Refuse a function that cannot be called with one sample (or list of them) and its kwargs, showing
    the signature expected, since the mismatch would otherwise fail every call of the run."""
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as err:
        label = getattr(fn, "__name__", "reward")
        argument = "samples: list[RewardInput]" if batched else "sample: RewardInput"
        extra = "".join(f", {key}=..." for key in kwargs) or ", **kwargs"
        given = f" with kwargs {kwargs}" if kwargs else ""
        raise ValueError(
            f"reward function {name!r} cannot be called{given} ({err}); expected "
            f"`def {label}({argument}{extra}) -> float | dict[str, float]`"
        ) from err
