"""Batched and async reward functions: scores, failures per kind, concurrency and timeouts, in-process and in
worker processes."""

from __future__ import annotations

import logging
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import pytest

from mmrl.config import RewardFunctionConfig
from mmrl.rewards import RewardInput, RewardManager, RewardResult

Isolation = Literal["inline", "process"]

BATCHED_REWARDS = """
    import math
    import time

    def lengths(samples, scale=1.0):
        # One score per sample, plus how many samples the call saw: one call must see the whole batch.
        return [{"overall": scale * len(s.response), "batch": len(samples)} for s in samples]

    def one_short(samples):
        return [1.0] * (len(samples) - 1)

    def scalar(samples):
        return 1.0

    def picky(samples):
        bad = {"nan": math.nan, "text": "1.0", "nokey": {"score": 1.0}}
        return [bad.get(s.response, 0.5) for s in samples]

    def raises(samples):
        raise RuntimeError("judge service down")

    def hangs(samples):
        time.sleep(30)
        return [1.0] * len(samples)

    def plain(sample):
        return 0.25
"""

ASYNC_REWARDS = """
    import asyncio
    import math
    import os
    import time

    async def judge(sample, delay=0.3):
        # Stands in for an HTTP judge: waits on I/O, then scores.
        await asyncio.sleep(delay)
        return {"overall": 1.0 if "4" in sample.response else 0.0, "pid": os.getpid()}

    async def flaky(sample):
        mode = sample.response
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "raise":
            raise ValueError("bad judge reply")
        if mode == "own_timeout":
            raise TimeoutError("the judge's own client timed out")
        if mode == "nan":
            return math.nan
        if mode == "exit":
            raise SystemExit(2)
        if mode == "block":
            time.sleep(30)
        return {"overall": 1.0, "loop": id(asyncio.get_running_loop()), "pid": os.getpid()}

    async def judge_batch(samples, bonus=0.0):
        await asyncio.sleep(0.1)
        return [len(s.response) + bonus for s in samples]

    async def batch_hangs(samples):
        await asyncio.sleep(30)

    def forgot_async(sample):
        return judge(sample)
"""


def _write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def _samples(*responses: str) -> list[RewardInput]:
    return [RewardInput(response=r) for r in responses]


def _timed(manager: RewardManager, samples: list[RewardInput]) -> tuple[RewardResult, float]:
    started = time.monotonic()
    result = manager.score(samples)
    return result, time.monotonic() - started


# --- batched ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_batched_functions_score_the_whole_batch_and_bad_returns_fail_per_kind(
    tmp_path: Path, isolation: Isolation
) -> None:
    path = _write(tmp_path, "batched.py", BATCHED_REWARDS)
    names = ["lengths", "one_short", "scalar", "picky", "raises"]
    specs = [{"name": f"{path}:{name}", "batched": True} for name in names]
    specs[0] |= {"kwargs": {"scale": 0.5}, "weight": 2.0}
    specs.append({"name": f"{path}:plain"})  # a per-sample function beside them
    if isolation == "process":
        specs.append({"name": f"{path}:hangs", "batched": True})
    samples = _samples("ab", "nan", "text", "abcd", "nokey")
    timeout_s = 1.0 if isolation == "process" else None  # inline, a sync call cannot be cut off
    with RewardManager(specs, timeout_s=timeout_s, isolation=isolation, num_workers=2) as manager:
        result, elapsed = _timed(manager, samples)

    assert result.components["lengths"] == [1.0, 1.5, 2.0, 2.0, 2.5]  # 0.5 · len(response)
    assert result.components["lengths/batch"] == [5.0] * 5
    assert result.components["picky"] == [0.5, 0.0, 0.0, 0.5, 0.0]
    for failed_as_a_whole in ("one_short", "scalar", "raises"):
        assert result.components[failed_as_a_whole] == [0.0] * 5
    assert result.components["plain"] == [0.25] * 5
    assert result.overall == [2.75, 3.25, 4.25, 4.75, 5.25]  # 2 · lengths + picky + plain
    expected = Counter(
        {"one_short/invalid": 5, "scalar/invalid": 5, "picky/invalid": 3, "raises/exception": 5}
    )
    if isolation == "process":
        expected["hangs/timeout"] = 5
        assert elapsed < 10, "the hung batch call must be cut off at the timeout"
    assert result.failures == expected


def test_batched_function_errors_say_what_was_expected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path, "batched.py", BATCHED_REWARDS)
    with caplog.at_level(logging.WARNING, logger="mmrl.rewards"):
        with RewardManager([{"name": f"{path}:one_short", "batched": True}], isolation="inline") as manager:
            manager.score(_samples("a", "b", "c"))
        with RewardManager([{"name": f"{path}:scalar", "batched": True}], isolation="inline") as manager:
            manager.score(_samples("a"))
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "returned 2 scores for 3 samples; expected a list of 3 scores" in messages
    assert "returned float; expected a list of 1 scores" in messages


def test_batched_flag_comes_from_the_config_and_is_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "batched.py", BATCHED_REWARDS)
    spec = RewardFunctionConfig(name=f"{path}:lengths", batched=True, kwargs={"scale": 2.0}).model_dump()
    with RewardManager([spec], isolation="inline") as manager:
        assert manager.score(_samples("abc", "a")).overall == [6.0, 2.0]
    with pytest.raises(ValueError, match="must be true or false, got 'yes'"):
        RewardManager([{"name": f"{path}:lengths", "batched": "yes"}])
    with pytest.raises(ValueError, match="allowed: name, weight, kwargs, batched"):
        RewardManager([{"name": f"{path}:lengths", "batch": True}])


# --- async -----------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_async_calls_of_a_batch_run_concurrently(tmp_path: Path, isolation: Isolation) -> None:
    path = _write(tmp_path, "judges.py", ASYNC_REWARDS)
    specs = [
        {"name": f"{path}:judge", "kwargs": {"delay": 0.3}},
        {"name": f"{path}:judge_batch", "batched": True, "kwargs": {"bonus": 1.0}},
    ]
    samples = _samples(*(["4", "5"] * 4))
    with RewardManager(specs, timeout_s=5.0, isolation=isolation, num_workers=2) as manager:
        manager.score(samples)  # workers start on the first batch; time the second
        result, elapsed = _timed(manager, samples)
    assert elapsed < 1.0, f"8 calls of 0.3 s took {elapsed:.2f} s: they did not run concurrently"
    assert result.components["judge"] == [1.0, 0.0] * 4
    assert result.components["judge_batch"] == [2.0] * 8  # len("4") + bonus
    assert result.failures == Counter()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_async_failures_are_counted_per_sample_and_a_hang_costs_only_its_own_call(
    tmp_path: Path, isolation: Isolation
) -> None:
    path = _write(tmp_path, "judges.py", ASYNC_REWARDS)
    modes = ["ok", "hang", "raise", "own_timeout", "nan", "exit", "ok", "ok"]
    with RewardManager([{"name": f"{path}:flaky"}], timeout_s=0.5, isolation=isolation) as manager:
        warm = manager.score(_samples("ok", "ok", "ok", "ok"))
        result, elapsed = _timed(manager, _samples(*modes))
    assert elapsed < 5, "the hung call must be cancelled at the timeout, not awaited for 30 s"
    assert result.components["flaky"] == [1.0, 0, 0, 0, 0, 0, 1.0, 1.0]
    assert result.failures == Counter({"flaky/timeout": 1, "flaky/exception": 3, "flaky/invalid": 1})
    # One event loop per process, kept across batches, so clients cached on it stay usable; in workers the
    # hang was cancelled by the worker itself, so no worker was replaced.
    ok = [i for i, mode in enumerate(modes) if mode == "ok"]
    loops = {warm.components["flaky/loop"][0]} | {result.components["flaky/loop"][i] for i in ok}
    pids = set(warm.components["flaky/pid"]) | {result.components["flaky/pid"][i] for i in ok}
    assert len(pids) <= 2 and len(loops) == len(pids)


def test_inline_async_batched_hang_times_out_every_sample_and_sync_coroutines_are_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path, "judges.py", ASYNC_REWARDS)
    hangs = [{"name": f"{path}:batch_hangs", "batched": True}]
    with RewardManager(hangs, timeout_s=0.3, isolation="inline") as manager:
        assert manager.score(_samples("4", "5", "6")).failures == Counter({"batch_hangs/timeout": 3})
    with (
        caplog.at_level(logging.WARNING, logger="mmrl.rewards"),
        RewardManager([{"name": f"{path}:forgot_async"}], isolation="inline") as manager,
    ):
        result = manager.score(_samples("4", "5", "6"))
    assert result.failures == Counter({"forgot_async/invalid": 3})
    assert any("declare the reward function with `async def`" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_async_call_blocking_the_workers_event_loop_is_cut_off_by_the_parent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path, "judges.py", ASYNC_REWARDS)
    with RewardManager(
        [{"name": f"{path}:flaky"}], timeout_s=0.5, isolation="process", num_workers=2
    ) as manager:
        manager.score(_samples("ok", "ok"))
        with caplog.at_level(logging.WARNING, logger="mmrl.rewards"):
            result, elapsed = _timed(manager, _samples("block", "ok"))  # one sample per worker
        again = manager.score(_samples("ok", "ok"))
    assert elapsed < 6
    assert result.components["flaky"] == [0.0, 1.0]
    assert result.failures == Counter({"flaky/timeout": 1})
    assert any("blocking call inside `async def`" in r.getMessage() for r in caplog.records)
    assert again.failures == Counter() and again.overall == [1.0, 1.0]
