"""The suite's time budgets (conftest.py), under xdist as CI runs it: a run over `MMRL_TEST_BUDGET_MIN` fails
and names its slowest tests, and a test over twice its recorded time fails under its own name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _pytest(budget_min: str, record_scale: str = "1") -> subprocess.CompletedProcess[str]:
    """Two quick tests of this repo's suite under `pytest -n 2`, with the budget set to `budget_min`.
    (The suite itself, passing within the default budget, shows the check leaves a good run alone.)"""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            f"{TESTS / 'test_schedule.py'}",
        ],
        cwd=TESTS.parent,
        env={**os.environ, "MMRL_TEST_BUDGET_MIN": budget_min, "MMRL_TEST_RECORD_SCALE": record_scale},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_run_over_its_budget_fails_naming_the_slowest_tests() -> None:
    over = _pytest("0.0001")  # 6 ms: every run is over it
    assert over.returncode == 1, over.stdout[-2000:]
    assert "over its budget of 0.0001 min" in over.stdout
    assert "test_schedule.py::" in over.stdout.split("time budget")[-1], "the slowest tests are named"


@pytest.mark.slow
def test_a_test_over_twice_its_recorded_time_fails_under_its_name() -> None:
    """Records scaled to a millionth: every test of the run is over twice its record, and each fails
    naming itself and the record (an ERROR where its setup was already over); with the records as
    written the same tests pass."""
    over = _pytest("30", record_scale="1e-6")
    assert over.returncode == 1, over.stdout[-2000:]
    failed = [line for line in over.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert failed and all("test_schedule.py::" in line for line in failed), over.stdout[-2000:]
    assert "over twice its recorded" in over.stdout
    assert _pytest("30").returncode == 0
