"""Tests for the reward layer: answer extraction, graders, loading user functions, and fault isolation."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from mmrl.rewards import (
    GRADERS,
    RewardInput,
    RewardManager,
    extract_answer,
    load_reward_function,
    register_grader,
)
from mmrl.rewards.graders import normalize_answer

# A user reward file: `flaky` misbehaves on demand, so one batch can exercise every failure kind.
FLAKY_REWARDS = """
    import math
    import os
    import time
    from pathlib import Path

    def flaky(sample, pid_file=None):
        mode = sample.extra["mode"]
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "hang":
            Path(pid_file).write_text(str(os.getpid()))
            time.sleep(30)
        if mode == "nan":
            return math.nan
        if mode == "str":
            return "0.5"
        if mode == "exit":
            os._exit(3)
        if mode == "slow":
            time.sleep(0.4)
        return {"overall": sample.extra["value"], "pid": os.getpid()}

    def steady(sample):
        return 1.0
"""

SIMPLE_REWARDS = """
    from textwrap import dedent

    def half(sample, value=0.5):
        return value

    def detailed(sample):
        return {"overall": 1.0 if "4" in sample.response else 0.0, "length": len(sample.response)}

    def _helper():
        return None
"""


def _write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def _alive(pid: int) -> bool:
    """True while `pid` exists, including as an unreaped zombie, i.e. a leaked child."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reward_workers() -> list[multiprocessing.process.BaseProcess]:
    """Live children that are reward workers (other tests' children are not this file's business)."""
    return [p for p in multiprocessing.active_children() if p.name == "mmrl-reward-worker"]


def _sample(response: str, ground_truth: object = None, **extra: object) -> RewardInput:
    return RewardInput(response=response, ground_truth=ground_truth, extra=dict(extra))


def _grade(name: str, response: str, ground_truth: object = None) -> float:
    return GRADERS[name](_sample(response, ground_truth))


# --- answer extraction -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"first \boxed{1}, then \boxed{ 2 }", "2"),
        (r"\boxed{3} and a truncated \boxed{4", "3"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\text{see }\boxed{2}}", r"\text{see }\boxed{2}"),
        (r"<answer>\boxed{7}</answer>", "7"),
        (r"<answer>5</answer> but really \boxed{6}", "6"),
        ("<answer> B </answer>", "B"),
        ("<answer>A</answer> no wait <answer>\nC\n</answer>", "C"),
        ("Reasoning.\nAnswer: 42\nDone.", "42"),
        ("answer: x\nFinal Answer:  y  \nbye", "y"),
        ("Answer:", None),
        ("The model rambles without committing.", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", [r"\boxed{", "}{}{", "\\", r"\boxed{\}", None, 42])
def test_extract_answer_never_raises(text: object) -> None:
    assert extract_answer(text) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  Paris ", "paris"),
        ('"Blue."', "blue"),
        ("$42$", "42"),
        ("New \t  York", "new york"),
        ("-0.5", "-0.5"),
        (".5", ".5"),
        ("'$x = 3$'.", "x = 3"),
        ("f(x)", "f(x)"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        (r"\boxed{ Paris }", "paris", 1.0),
        ('<answer>"Blue."</answer>', "blue", 1.0),
        ("Answer: $42$", "42", 1.0),
        ("<answer>New   York</answer>", "new york", 1.0),
        ("<answer>NewYork</answer>", "new york", 0.0),
        (r"\boxed{.5}", "5", 0.0),
        (r"\boxed{4}", ["four", "4"], 1.0),
        (r"\boxed{5}", ["four", "4"], 0.0),
        (r"\boxed{3}", 3, 1.0),
        (r"\boxed{}", "", 0.0),
        ("paris", "paris", 0.0),
    ],
)
def test_answer_match(response: str, ground_truth: object, expected: float) -> None:
    assert _grade("answer_match", response, ground_truth) == expected


# --- format graders --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>2 + 2</think><answer>4</answer>", 1.0),
        ("  <think>a</think>\n<answer> x </answer>\n", 1.0),
        ("<answer>4</answer>", 1.0),
        (r"The sum is \boxed{4}.", 1.0),
        (r"so $\boxed{4}$ ", 1.0),
        ("<answer>4</answer> because I said so", 0.0),
        ("<think>a</think><answer>4</answer>.", 0.0),
        ("<answer></answer>", 0.0),
        ("<answer>  </answer>", 0.0),
        ("<answer>1</answer><answer>2</answer>", 0.0),
        ("<answer>1</answer>2</answer>", 0.0),
        ("preamble <answer>4</answer>", 0.0),
        ("<think>a<answer>4</answer>", 0.0),
        ("<think>a</think></think><answer>4</answer>", 0.0),
        ("<think>a</think>", 0.0),
        (r"\boxed{1} or \boxed{2}", 0.0),
        (r"\boxed{4} because of the figure", 0.0),
        (r"\boxed{ }", 0.0),
        ("plain text", 0.0),
    ],
)
def test_format_answer(response: str, expected: float) -> None:
    assert _grade("format_answer", response) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"<think>work</think> so the answer is \boxed{3}.", 1.0),
        (r"  <think></think>\boxed{\frac{1}{2}}", 1.0),
        (r"\boxed{3}", 0.0),
        (r"<think>\boxed{3}</think> done", 0.0),
        (r"<think>a</think><think>b</think>\boxed{1}", 0.0),
        (r"<think>a</think> \boxed{3", 0.0),
        (r"preamble <think>a</think>\boxed{1}", 0.0),
        ("<think>a</think><answer>1</answer>", 0.0),
    ],
)
def test_format_think_boxed(response: str, expected: float) -> None:
    assert _grade("format_think_boxed", response) == expected


def test_register_grader_adds_a_usable_name_and_refuses_duplicates() -> None:
    try:

        @register_grader("test_only_length")
        def length(sample: RewardInput) -> float:
            return float(len(sample.response))

        with RewardManager([{"name": "test_only_length"}]) as manager:
            assert manager.score([_sample("abc")]).overall == [3.0]
        with pytest.raises(ValueError, match="already registered"):
            register_grader("test_only_length")(length)
    finally:
        GRADERS.pop("test_only_length", None)
    with pytest.raises(ValueError, match="identifier"):
        register_grader("bad:name")


# --- loading user functions ------------------------------------------------------------------------------


def test_load_builtin_and_relative_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward_function("answer_match") is GRADERS["answer_match"]
    _write(tmp_path, "my_rewards.py", SIMPLE_REWARDS)
    monkeypatch.chdir(tmp_path)
    half = load_reward_function("my_rewards.py:half")
    assert half(_sample("x"), value=0.25) == 0.25


def test_loader_errors_say_what_is_missing(tmp_path: Path) -> None:
    path = _write(tmp_path, "my_rewards.py", SIMPLE_REWARDS)
    with pytest.raises(AttributeError) as missing_function:
        load_reward_function(f"{path}:nope")
    message = str(missing_function.value)
    assert "'nope'" in message and "detailed, half" in message
    assert "dedent" not in message and "_helper" not in message

    with pytest.raises(FileNotFoundError, match=re.escape("absent.py")):
        load_reward_function(f"{tmp_path / 'absent.py'}:half")
    with pytest.raises(
        ValueError, match=r"Did you mean .answer_match.\? Built-in graders: answer_match, .*format_answer"
    ) as unknown:
        load_reward_function("answer_matsh")
    assert "path/to/file.py:function_name" in str(unknown.value)
    with pytest.raises(ValueError, match=re.escape("my_rewards.py:function_name")):
        load_reward_function("my_rewards.py")

    broken = _write(tmp_path, "broken.py", "raise RuntimeError('import-time failure')\n")
    with pytest.raises(ImportError, match="import-time failure"):
        load_reward_function(f"{broken}:anything")


def test_manager_rejects_bad_config(tmp_path: Path) -> None:
    path = _write(tmp_path, "my_rewards.py", SIMPLE_REWARDS)
    with pytest.raises(ValueError, match="weights"):
        RewardManager([{"name": "answer_match", "weights": 2.0}])
    with pytest.raises(ValueError, match="repeated: half"):
        RewardManager([{"name": f"{path}:half"}, {"name": f"{path}:half", "kwargs": {"value": 1.0}}])
    with pytest.raises(ValueError, match="expected `def answer_match"):
        RewardManager([{"name": "answer_match", "kwargs": {"strict": True}}])
    with pytest.raises(ValueError, match="isolation"):
        RewardManager([{"name": "answer_match"}], isolation="thread")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a number within ±1e\+06"):
        RewardManager([{"name": "answer_match", "weight": float("nan")}])


# --- combining rewards -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_weighted_combination(tmp_path: Path, isolation: str) -> None:
    path = _write(tmp_path, "my_rewards.py", SIMPLE_REWARDS)
    specs = [
        {"name": "answer_match"},
        {"name": "format_answer", "weight": 0.5},
        {"name": f"{path}:half", "weight": 2.0, "kwargs": {"value": 0.2}},
        {"name": f"{path}:detailed", "weight": -1.0},
    ]
    responses = ["<answer>4</answer>", "<answer>3</answer> trailing", r"\boxed{four}"]
    samples = [_sample(r, ["4", "four"]) for r in responses]
    with RewardManager(specs, isolation=isolation) as manager:  # type: ignore[arg-type]
        result = manager.score(samples)
    # answer_match · 1 + format_answer · 0.5 + half(0.2) · 2 − detailed · 1
    assert result.overall == pytest.approx([1 + 0.5 + 0.4 - 1, 0 + 0 + 0.4 - 0, 1 + 0.5 + 0.4 - 0])
    assert result.components == {
        "answer_match": [1.0, 0.0, 1.0],
        "format_answer": [1.0, 0.0, 1.0],
        "half": pytest.approx([0.2, 0.2, 0.2]),
        "detailed": [1.0, 0.0, 0.0],
        "detailed/length": [18.0, 27.0, 12.0],
    }
    assert result.failures == Counter()


def test_empty_batch_and_closed_manager() -> None:
    manager = RewardManager([{"name": "answer_match"}])
    result = manager.score([])
    assert (result.overall, result.components) == ([], {"answer_match": []})
    manager.close()
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.score([_sample("x")])


# --- fault isolation -------------------------------------------------------------------------------------


def test_inline_mode_contains_bad_return_values_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(
        tmp_path,
        "bad.py",
        """
        import math

        import numpy as np

        def bad(sample):
            kind = sample.response
            if kind == "raise":
                raise ValueError("bad input")
            if kind == "exit":
                raise SystemExit(1)
            return {
                "nan": math.nan, "inf": math.inf, "none": None, "str": "1.0", "nokey": {"score": 1.0},
                "badmetric": {"overall": 1.0, "m": "x"}, "vector": np.array([1.0, 2.0]),
                "numpy": np.float32(0.75), "dict": {"overall": np.array(0.25), "m": 2},
            }[kind]
        """,
    )
    kinds = "numpy raise nan inf none str nokey badmetric vector raise exit dict".split()
    specs = [{"name": f"{path}:bad", "weight": 2.0}, {"name": "format_answer"}]
    with (
        caplog.at_level(logging.WARNING, logger="mmrl.rewards"),
        RewardManager(specs, isolation="inline") as manager,
    ):
        result = manager.score([_sample(kind) for kind in kinds])
        manager.score([_sample("raise")])
    assert result.components["bad"] == [0.75] + [0.0] * 10 + [0.25]
    assert result.components["bad/m"] == [0.0] * 11 + [2.0]
    assert result.overall == [1.5] + [0.0] * 10 + [0.5]
    assert result.failures == Counter({"bad/invalid": 7, "bad/exception": 3})
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "ValueError: bad input" in errors[0].getMessage()
    assert "Traceback" in errors[0].getMessage()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "nan" in warnings[0]


def test_a_score_too_large_for_the_advantage_statistics_is_invalid_and_counted(tmp_path: Path) -> None:
    """From about 1e19, GRPO's float32 group statistics overflow and every advantage of the group is 0
    without a word; such a score is refused as a NaN is: that sample scores 0, counted and logged."""
    import torch

    from mmrl.algorithms import get_advantage_estimator

    path = _write(tmp_path, "huge.py", "def huge(sample):\n    return {'overall': float(sample.response)}\n")
    responses = ["1e19", "1", "-1e12", "3", "-2e30", "5"]
    with RewardManager([{"name": f"{path}:huge"}], isolation="inline") as manager:
        result = manager.score([_sample(r) for r in responses])
    assert result.overall == [0.0, 1.0, -1e12, 3.0, 0.0, 5.0]
    assert result.failures == Counter({"huge/invalid": 2})
    assert "1e+19, beyond ±1e+12; scale the reward down" in result.errors["huge"]
    scores = torch.tensor([result.overall[i] for i in (0, 1, 3, 5)], dtype=torch.float32)
    mask = torch.ones(4, 1)
    advantages, _ = get_advantage_estimator("grpo")(scores[:, None], mask, torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(advantages).all() and advantages.abs().sum() > 0


@pytest.mark.timeout(60)
def test_process_mode_isolates_crashes_hangs_and_bad_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path, "flaky.py", FLAKY_REWARDS)
    pid_file = tmp_path / "hung.pid"
    specs = [
        {"name": f"{path}:flaky", "weight": 2.0, "kwargs": {"pid_file": str(pid_file)}},
        {"name": f"{path}:steady"},
        {"name": "answer_match", "weight": 0.5},
    ]
    bad = {1: "raise", 4: "hang", 7: "nan", 9: "str", 12: "exit", 15: "raise"}
    # 18-20 share a chunk and together outlast the timeout: each call must get its own clock.
    modes = [bad.get(i, "slow" if 18 <= i <= 20 else "ok") for i in range(24)]
    samples = [_sample(r"\boxed{7}", "7", mode=mode, value=i / 100) for i, mode in enumerate(modes)]
    manager = RewardManager(specs, timeout_s=1.0, isolation="process", num_workers=2)
    with caplog.at_level(logging.ERROR, logger="mmrl.rewards"):
        started = time.monotonic()
        result = manager.score(samples)
        elapsed = time.monotonic() - started

    assert elapsed < 10, "the hung call must be cut off at the timeout, not run for 30 s"
    flaky = [0.0 if i in bad else i / 100 for i in range(24)]
    assert result.components["flaky"] == pytest.approx(flaky)
    assert result.components["steady"] == [1.0] * 24, "a timeout must not lose the sample's other calls"
    assert result.overall == pytest.approx([2 * f + 1 + 0.5 for f in flaky])
    assert result.failures == Counter({"flaky/exception": 3, "flaky/invalid": 2, "flaky/timeout": 1})
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1 and "RuntimeError: boom" in errors[0]
    hung_pid = int(pid_file.read_text())
    assert not _alive(hung_pid), "the hung worker must be killed and reaped"

    # The pool recovered: the next batch scores fully.
    again = manager.score([_sample("x", mode="ok", value=0.3)] * 8)
    assert again.overall == pytest.approx([2 * 0.3 + 1] * 8) and again.failures == Counter()

    live_pids = {int(pid) for pid in again.components["flaky/pid"]}
    assert live_pids and all(_alive(pid) for pid in live_pids)
    manager.close()
    assert _reward_workers() == []
    every_pid = live_pids | {int(pid) for pid in result.components["flaky/pid"] if pid}
    assert not any(_alive(pid) for pid in every_pid)


@pytest.mark.timeout(60)
def test_process_mode_survives_unpicklable_samples_and_workers_that_cannot_start(tmp_path: Path) -> None:
    flaky = _write(tmp_path, "flaky.py", FLAKY_REWARDS)
    with RewardManager([{"name": f"{flaky}:steady"}], isolation="process", num_workers=1) as manager:
        result = manager.score([_sample("a", callback=lambda: None), _sample("b")])
        assert result.overall == [0.0, 1.0] and result.failures == Counter({"steady/exception": 1})

    parent_only = _write(
        tmp_path,
        "parent_only.py",
        """
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise ImportError("this file refuses to load in a worker")

        def reward(sample):
            return 1.0
        """,
    )
    specs = [{"name": f"{parent_only}:reward"}, {"name": "answer_match"}]
    with RewardManager(specs, isolation="process", num_workers=2) as manager:
        result = manager.score([_sample(r"\boxed{1}", "1")] * 3)
    assert result.overall == [1.0] * 3
    assert result.failures == Counter({"reward/exception": 3})
    assert _reward_workers() == []


@pytest.mark.timeout(60)
def test_workers_outlive_a_sigterm_sent_to_the_whole_job(tmp_path: Path) -> None:
    """A scheduler's pre-emption signals every process of the job; the trainer finishes its step before
    it stops, so its reward workers must still be there to score it."""
    path = _write(tmp_path, "flaky.py", FLAKY_REWARDS)
    with RewardManager([{"name": f"{path}:flaky"}], isolation="process", num_workers=2) as manager:
        batch = [_sample("x", mode="ok", value=1.0)] * 8
        scored: set[int] = set()
        while len(scored) < 2:  # both workers started (a worker still starting up takes signals as is)
            scored |= {int(p) for p in manager.score(batch).components["flaky/pid"]}
        workers = _reward_workers()
        assert {w.pid for w in workers} == scored
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers), [w.exitcode for w in workers]
        again = manager.score(batch)
        assert again.failures == Counter() and again.overall == [1.0] * 8
        assert {int(p) for p in again.components["flaky/pid"]} <= {w.pid for w in workers}


@pytest.mark.timeout(60)
def test_workers_are_reaped_when_a_manager_is_dropped_without_close(tmp_path: Path) -> None:
    path = _write(tmp_path, "flaky.py", FLAKY_REWARDS)
    manager = RewardManager([{"name": f"{path}:flaky"}], isolation="process", num_workers=2)
    pids = {int(p) for p in manager.score([_sample("x", mode="ok", value=1.0)] * 8).components["flaky/pid"]}
    assert pids and all(_alive(pid) for pid in pids)
    del manager
    gc.collect()
    assert not any(_alive(pid) for pid in pids)


INLINE_EXIT_AND_CRASH = """
    import ctypes
    import os


    def exits(sample):
        os._exit(3)


    def crashes(sample):
        ctypes.string_at(0)
"""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_inline_reward_raising_keyboardinterrupt_is_its_failure_not_the_users_ctrl_c(
    tmp_path: Path, asynchronous: bool
) -> None:
    """In the training loop (`StopSignals` holds SIGINT), or on the async rewards' own thread, a bare
    KeyboardInterrupt can only be the function's own: counted as its exception. A synchronous one outside
    the loop cannot be told from Ctrl-C, so it stops as Ctrl-C does."""
    from mmrl.run.signals import StopSignals

    prefix = "async " if asynchronous else ""
    path = _write(tmp_path, "ki.py", f"{prefix}def stop(sample):\n    raise KeyboardInterrupt\n")
    with RewardManager([{"name": f"{path}:stop"}], isolation="inline") as manager:
        with StopSignals():
            result = manager.score([_sample("a")])
        assert result.failures == {"stop/exception": 1} and result.overall == [0.0]
        if asynchronous:
            assert manager.score([_sample("a")]).failures == {"stop/exception": 1}
        else:
            with pytest.raises(KeyboardInterrupt):
                manager.score([_sample("a")])


def test_an_inline_reward_that_exits_or_segfaults_is_named(tmp_path: Path, caplog) -> None:
    """Under isolation=inline, `os._exit` in a reward is that reward's counted failure, printed with its
    name, not a silent end of the run; a segfault prints the stack that names the function."""
    path = _write(tmp_path, "bad.py", INLINE_EXIT_AND_CRASH)
    manager = RewardManager([{"name": f"{path}:exits"}], isolation="inline")
    with caplog.at_level(logging.WARNING, logger="mmrl.rewards"), manager:
        result = manager.score([_sample("a"), _sample("b")])
    assert result.failures == {"exits/exception": 2} and result.overall == [0.0, 0.0]
    assert "os._exit(3) called in the trainer's process" in result.errors["exits"]
    (record,) = [r for r in caplog.records if r.name == "mmrl.rewards"]
    assert "'exits'" in record.getMessage() and "os._exit(3)" in record.getMessage()
    assert os._exit.__module__ == "posix", "os._exit is restored after the call"

    code = (
        "from mmrl.rewards import RewardInput, RewardManager\n"
        f"m = RewardManager([{{'name': '{path}:crashes'}}], isolation='inline')\n"
        "m.score([RewardInput(response='a', ground_truth=None)])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    crashed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert crashed.returncode == -signal.SIGSEGV
    assert "Segmentation fault" in crashed.stderr and f'File "{path}", line 11 in crashes' in crashed.stderr
