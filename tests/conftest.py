"""Shared fixtures: one tiny Qwen2.5-VL checkpoint per test session, built locally (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One process per core (pytest -n): two torch threads per process would fight over the cores and
    # make every step several times slower. Subprocesses the tests start inherit the setting.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def local_ray():
    """A real local Ray cluster with two logical CPUs, whatever this machine has: room for two workers."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


# Minutes-long tests (learning runs, worker groups) go first: under `pytest -n` a long test that starts
# last runs alone on one core while the others idle, which once made CI several minutes longer.
LONG_MODULES = (
    "test_learning.py",
    "test_learning_recipes.py",
    "test_vla_learning.py",
    "test_custom_reward_learning.py",
    "test_distributed.py",
    "test_geo_recipe.py",
    "test_resources.py",
    "test_crash_resume.py",
)


def _start_order(item: pytest.Item) -> tuple[bool, bool]:
    """Ray tests first, then the long modules. `--dist loadgroup` runs the whole `ray` group on one
    worker, one test after another; started last, that chain alone set CI's length."""
    group = item.get_closest_marker("xdist_group")
    in_ray = group is not None and "ray" in (*group.args, group.kwargs.get("name"))
    return (not in_ray, item.path.name not in LONG_MODULES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_start_order)  # stable: the order within each class is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
