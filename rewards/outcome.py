"""One reward call's outcome, the rules for what a reward function may return, and how each kind of
function (plain or batched, sync or async) is called.

Calls are checked where they run (in-process or in a worker) so only plain, picklable data ever crosses a
process boundary, whatever the user function returned.
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import math
import os
import signal
import threading
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, SupportsFloat, TypeVar

from mmrl.rewards.types import RewardFn, RewardInput

OutcomeKind = Literal["ok", "exception", "timeout", "invalid"]

_T = TypeVar("_T")
_Key = TypeVar("_Key")


@dataclass(frozen=True)
class Outcome:
    """`scores` (with "overall") when kind is "ok"; otherwise `detail` says what went wrong (a traceback
    for an exception). Functions that are not rewards (agent tools) return their result as `value`."""

    kind: OutcomeKind
    scores: dict[str, float] = field(default_factory=dict)
    detail: str = ""
    value: Any = None


class InvalidRewardError(ValueError):
    """A reward function returned something that is not a finite score."""


@dataclass(frozen=True)
class Scorer:
    """A loaded reward function and how to call it.

    A plain function takes one sample; a `batched` one takes the whole list and returns one score per
    sample, for rewards that are cheaper per batch (vectorised, or one request for many samples). Either
    may be `async def`: async calls run concurrently, each limited to a timeout even in-process. Calling a
    Scorer never raises because of the user function: every sample it covers gets an Outcome.
    """

    fn: RewardFn
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    batched: bool = False

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, samples: Sequence[RewardInput]) -> list[Outcome]:
        """Outcomes of one synchronous call on `samples` (exactly one sample unless batched)."""
        try:
            value = self.fn(self._argument(samples), **self.kwargs)
        except (Exception, SystemExit):
            # SystemExit too: a reward function calling exit() is a bug to report, not a request to stop.
            return [Outcome("exception", detail=traceback.format_exc())] * len(samples)
        except KeyboardInterrupt as err:
            if not raised_by_the_function(err):
                raise
            return [Outcome("exception", detail=traceback.format_exc())] * len(samples)
        return self._outcomes(value, len(samples))

    async def acall(self, samples: Sequence[RewardInput], timeout_s: float) -> list[Outcome]:
        """Outcomes of one async call, cut off after `timeout_s`. `asyncio.wait` rather than `wait_for`:
        it tells our timeout from a TimeoutError the function raised itself (an "exception"), and it never
        waits on a coroutine that ignores its cancellation."""
        task = asyncio.ensure_future(self._settle(samples))
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            return [Outcome("timeout", detail=f"no result within {timeout_s:g}s")] * len(samples)
        return task.result()

    async def _settle(self, samples: Sequence[RewardInput]) -> list[Outcome]:
        """Await the function, turning anything it raises into outcomes. SystemExit must not escape: an
        asyncio task re-raises it into the event loop, which would stop the loop for every later call."""
        try:
            value = await self.fn(self._argument(samples), **self.kwargs)
        except (Exception, SystemExit):
            return [Outcome("exception", detail=traceback.format_exc())] * len(samples)
        except KeyboardInterrupt as err:
            if not raised_by_the_function(err):
                raise
            return [Outcome("exception", detail=traceback.format_exc())] * len(samples)
        return self._outcomes(value, len(samples))

    def _argument(self, samples: Sequence[RewardInput]) -> RewardInput | list[RewardInput]:
        if self.batched:
            return list(samples)
        (sample,) = samples
        return sample

    def _outcomes(self, value: object, num_samples: int) -> list[Outcome]:
        if not self.batched:
            return [_checked(value)]
        try:
            items = _batch_items(value, num_samples)
        except InvalidRewardError as err:
            return [Outcome("invalid", detail=str(err))] * num_samples
        return [_checked(item) for item in items]


def _checked(value: object) -> Outcome:
    """An "ok" outcome for a valid score, "invalid" (saying why) for anything else."""
    try:
        return Outcome("ok", scores=to_scores(value))
    except InvalidRewardError as err:
        return Outcome("invalid", detail=str(err))


def _batch_items(value: object, num_samples: int) -> list[object]:
    """A batched function's return value as one item per sample; a wrong type or length makes the whole
    call invalid, since no item could be matched to its sample."""
    expected = f"expected a list of {num_samples} scores, one per sample, in order"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidRewardError(f"batched function returned {type(value).__name__}; {expected}")
    try:
        items = list(value)
    except Exception as err:  # e.g. iterating a 0-d array
        raise InvalidRewardError(
            f"batched function returned an unusable {type(value).__name__} ({err}); {expected}"
        ) from err
    if len(items) != num_samples:
        raise InvalidRewardError(
            f"batched function returned {len(items)} scores for {num_samples} samples; {expected}"
        )
    return items


# A score past this magnitude is refused as a NaN is. No reward means a trillion, and GRPO's float32 group
# statistics (sums of squared deviations) overflow to inf from about 1e19, which turns every advantage of
# the group into 0 without a word; a bound far below that keeps every estimator's arithmetic finite.
MAX_SCORE = 1e12


def to_scores(value: object) -> dict[str, float]:
    """A reward function's return value as {"overall": ..., **metrics}, all finite floats, the overall
    score within ±`MAX_SCORE`."""
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never awaited: close it so Python does not warn about it later
        raise InvalidRewardError(
            "returned an awaitable; declare the reward function with `async def` so it is awaited"
        )
    if isinstance(value, Mapping):
        if "overall" not in value:
            raise InvalidRewardError(f"returned a dict without 'overall' (keys: {sorted(map(str, value))})")
        scores = {_key(key): _finite(score, f"value of {key!r}") for key, score in value.items()}
        what = "value of 'overall'"
    else:
        scores, what = {"overall": _finite(value, "return value")}, "return value"
    if abs(scores["overall"]) > MAX_SCORE:
        raise InvalidRewardError(
            f"{what} is {scores['overall']:.3g}, beyond ±{MAX_SCORE:.0e}; scale the reward down (GRPO's "
            "group statistics overflow at such magnitudes)"
        )
    return scores


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


class EventLoop:
    """One event loop on a background thread, started on first use and kept for every later batch.

    Kept, so async rewards can cache clients and semaphores, which are tied to the loop they were made on;
    on its own thread, so it also works where the caller already runs a loop (a notebook).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run `coroutine` on the loop and wait for its result; an interrupt cancels it."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="mmrl-reward-loop", daemon=True
            )
            self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop; calls still hanging on it (they were cancelled at their timeout) are dropped."""
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._loop = self._thread = None


def run_calls(
    calls: Sequence[tuple[_Key, Scorer, Sequence[RewardInput]]],
    timeout_s: float,
    loop: EventLoop,
    report: Callable[[_Key, list[Outcome]], None],
) -> None:
    """Run every call and `report` each one's outcomes as it finishes: the async calls first, all at once
    on `loop`, then the sync calls in order. Worker processes rely on that order to time the calls."""
    concurrent = [(key, scorer, samples) for key, scorer, samples in calls if scorer.is_async]
    if concurrent:
        loop.run(_gather(concurrent, timeout_s, report))
    for key, scorer, samples in calls:
        if not scorer.is_async:
            report(key, scorer(samples))


async def _gather(
    calls: Sequence[tuple[_Key, Scorer, Sequence[RewardInput]]],
    timeout_s: float,
    report: Callable[[_Key, list[Outcome]], None],
) -> None:
    async def one(key: _Key, scorer: Scorer, samples: Sequence[RewardInput]) -> None:
        report(key, await scorer.acall(samples, timeout_s))

    awaitables: list[Awaitable[None]] = [one(*call) for call in calls]
    await asyncio.gather(*awaitables)


def raised_by_the_function(err: KeyboardInterrupt) -> bool:
    """Whether a KeyboardInterrupt came from the reward function itself, not from the keyboard. Ctrl-C
    reaches only the main thread (async rewards run on the loop's own), and while a handler other than
    Python's default holds SIGINT (mmrl's training loop: `StopSignals`) it never raises a bare one;
    elsewhere one cannot be told apart, so it counts as Ctrl-C."""
    if type(err) is not KeyboardInterrupt:
        return False
    elsewhere = threading.current_thread() is not threading.main_thread()
    return elsewhere or signal.getsignal(signal.SIGINT) is not signal.default_int_handler


INLINE_EXIT = (
    "os._exit({code}) called in the trainer's process (reward.isolation: inline); the run goes on. "
    "Under reward.isolation: process such a call ends only a worker"
)


@contextmanager
def exits_raised(said: str = INLINE_EXIT) -> Iterator[None]:
    """While user code runs in the trainer's process (a reward function, a file being imported),
    `os._exit` raises SystemExit(`said`, with `{code}` filled in) instead of ending the process on the spot
    with no word: the call then counts as that code's failure, printed with its name, as `exit()` does."""
    real = os._exit

    def refuse(code: int) -> NoReturn:
        raise SystemExit(said.format(code=code))

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def report_crashes() -> None:
    """Have a crash of native code (a segfault, an abort) in this process print every thread's Python
    stack, which names the user function it happened in, instead of ending the run without a word."""
    if not faulthandler.is_enabled():
        with suppress(AttributeError, ValueError, OSError):  # a stderr without a file descriptor (a notebook)
            faulthandler.enable(all_threads=True)
