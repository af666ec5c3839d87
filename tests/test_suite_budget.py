"""The suite's time budgets (conftest.py), under xdist as CI runs it: a run over `MMRL_TEST_BUDGET_MIN` fails
and names its slowest tests, and a test over three times its recorded time fails under its own name.

Both checks are read off one run of a small part of this suite with both limits crossed (its processes
import torch and mmrl, so each run costs a quarter of a minute). The suite itself, passing within the
default budget and records, shows that neither check touches a good run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.xdist_group("suite_budget")  # one worker, so the two tests share one run


@pytest.fixture(scope="module")
def over_both() -> subprocess.CompletedProcess[str]:
    """`test_schedule.py` under `pytest -n 2` with the budget at 6 ms and every record scaled to a
    millionth: the run is over its budget, and every test over three times its record."""
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
        # PYTEST_ADDOPTS of the outer run (-v, say) would change the lines the tests read
        env={
            **os.environ,
            "MMRL_TEST_BUDGET_MIN": "0.0001",
            "MMRL_TEST_RECORD_SCALE": "1e-6",
            "PYTEST_ADDOPTS": "",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_run_over_its_budget_fails_naming_the_slowest_tests(over_both) -> None:
    assert over_both.returncode == 1, over_both.stdout[-2000:]
    assert (
        "over its budget of 1e-10 min (MMRL_TEST_BUDGET_MIN 0.0001 x MMRL_TEST_RECORD_SCALE 1e-06)"
        in " ".join(over_both.stdout.split())
    )
    assert "test_schedule.py::" in over_both.stdout.split("time budget")[-1], "the slowest tests are named"


@pytest.mark.slow
def test_a_test_over_twice_its_recorded_time_fails_under_its_name(over_both) -> None:
    """Each test of the run fails naming itself and its record (an ERROR where its setup was already over)."""
    failed = [line for line in over_both.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert failed and all("test_schedule.py::" in line for line in failed), over_both.stdout[-2000:]
    assert "over 3 times its recorded" in over_both.stdout


@pytest.mark.parametrize("probe, scale", [(0.5, 1.0), (1.0, 1.0), (1.9, 1.9), (100.0, 4.0)])
def test_the_limits_scale_with_this_machines_speed_within_1_and_4(monkeypatch, probe, scale) -> None:
    import machine_speed

    monkeypatch.setattr(machine_speed, "probe_s", lambda: probe * machine_speed.PROBE_REFERENCE_S)
    assert machine_speed.slowness() == pytest.approx(scale)


def test_the_scale_is_measured_once_and_a_scale_given_by_hand_is_kept(monkeypatch) -> None:
    """The pytest controller measures before xdist starts the workers, which inherit the factor through
    their environment; a factor given by hand is never measured over."""
    import machine_speed

    monkeypatch.setattr(machine_speed, "probe_s", lambda: 3 * machine_speed.PROBE_REFERENCE_S)
    monkeypatch.delenv(machine_speed.SCALE_ENV, raising=False)
    assert machine_speed.record_scale() == 1.0
    assert machine_speed.measure_scale() and os.environ[machine_speed.SCALE_ENV] == "3.00"
    assert machine_speed.record_scale() == 3.0
    monkeypatch.setenv(machine_speed.SCALE_ENV, "1.5")
    assert not machine_speed.measure_scale() and machine_speed.record_scale() == 1.5
